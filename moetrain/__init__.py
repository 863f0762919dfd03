"""moetrain: train mixture-of-experts language models, from a laptop CPU to many GPUs."""

__version__ = "0.1.0"
