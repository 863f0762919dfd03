"""The model: a plain-PyTorch decoder-only transformer with mixture-of-experts FFNs.

Read it top to bottom: norm → rope → attention → mlp → router → experts → token_dispatcher → moe →
block → transformer. Nothing here imports torch.distributed: parallelism is applied from
outside (src/moetrain/parallel/), through the token dispatcher seam in `token_dispatcher.py`.
Importing the package loads nothing, so its settings (config.py) load without torch.
"""
