"""Hugging Face interoperability (`moetrain export-hf`, `moetrain import-hf`).

- convert.py: checkpoint ⇄ transformers directory;
- arch.py: which native class represents which model, its config.json and tensor names;
- shards.py: sharded safetensors written a tensor at a time.
"""

from moetrain.hf.convert import export_hf, export_replaces, import_hf, import_replaces

__all__ = ["export_hf", "export_replaces", "import_hf", "import_replaces"]
