"""Hugging Face interoperability (`moetrain export-hf`, `moetrain import-hf`).

- convert.py: checkpoint ⇄ transformers directory, and the field-by-field mapping table;
- arch.py: what Qwen3-MoE and GLM-4-MoE represent, their config.json and tensor names;
- shards.py: sharded safetensors written a tensor at a time.
"""

from moetrain.hf.convert import export_hf, export_replaces, import_hf, import_replaces

__all__ = ["export_hf", "export_replaces", "import_hf", "import_replaces"]
