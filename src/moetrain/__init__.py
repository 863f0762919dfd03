"""moetrain: train mixture-of-experts language models, from a laptop CPU to many GPUs.

The Python API (src/moetrain/api.py): `moetrain.load(path)` gives a `LoadedModel` with `.logits`,
`.loss` and `.generate`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["LoadedModel", "__version__", "load"]

if TYPE_CHECKING:
    from moetrain.api import LoadedModel, load

_API = ("LoadedModel", "load")


def __getattr__(name: str):
    # `import moetrain` stays cheap (the command line's --help and --version import it): torch
    # and the model load on the API's first use.
    if name in _API:
        return getattr(importlib.import_module("moetrain.api"), name)
    raise AttributeError(f"module 'moetrain' has no attribute {name!r}")
