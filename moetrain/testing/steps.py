"""Helpers the tests share to drive training steps and optimizer kernels (no test logic here)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from moetrain.data.loader import SyntheticLoader

ADAMW_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
"""AdamW hyperparameters for kernel-against-reference checks."""


def synthetic_batches(
    cfg, step: int, rank: int | None = None, rows: int = 2
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of optimizer step `step` (seeded by it) for `cfg`; with `rank`, that
    rank's `rows` rows of each (a data-parallel rank's share of the global micro-batch)."""
    loader = SyntheticLoader(
        seq_len=cfg.data.seq_len,
        micro_batch_size=cfg.train.micro_batch_size,
        seed=step,
        vocab_size=cfg.model.vocab_size,
    )
    batches = [loader.next_batch() for _ in range(cfg.train.grad_accum_steps)]
    if rank is None:
        return batches
    return [(x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]) for x, y in batches]


def adamw_inputs(n: int = 4096, seed: int = 1, moments_dtype: torch.dtype = torch.float32):
    """(param, grad, exp_avg, exp_avg_sq) of `n` elements, seeded."""
    g = torch.Generator().manual_seed(seed)
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m, v = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    return p, grad, m.to(moments_dtype), v.to(moments_dtype)


def run_in_triton_interpreter(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python with TRITON_INTERPRET=1 (Triton kernels executed on the CPU)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
