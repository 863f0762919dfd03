"""The model: a plain-PyTorch decoder-only transformer with mixture-of-experts FFNs.

Read it top to bottom: norm → rope → attention → mlp → router → experts → token_dispatcher → moe →
block → transformer. Nothing here imports torch.distributed: parallelism is applied from
outside (src/moetrain/parallel/), through the token dispatcher seam in `token_dispatcher.py`, and
FP8 by the converter `apply_fp8` (fp8.py), which replaces linears and sets `GroupedExperts.mlp`.
Importing the package loads nothing, so its settings (config.py) load without torch.
"""
