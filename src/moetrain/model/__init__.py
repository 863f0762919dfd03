"""The model: a plain-PyTorch decoder-only transformer with mixture-of-experts FFNs.

Read it top to bottom: norm → rope → attention → mlp → router → experts → token_dispatcher → moe →
block → transformer. Nothing here imports torch.distributed: parallelism is applied from
outside (src/moetrain/parallel/), through the token dispatcher seam in `token_dispatcher.py`.
"""

import moetrain.cpu_math  # noqa: F401  (sets up the CPU's vector math: src/moetrain/cpu_math.py)
from moetrain.model.config import Gating, MoEConfig, Routing, TransformerConfig
from moetrain.model.transformer import Transformer

__all__ = ["Gating", "MoEConfig", "Routing", "Transformer", "TransformerConfig"]
