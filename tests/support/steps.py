"""Helpers the tests share to drive training steps, optimizer kernels and the MoE permutation (no
test logic here)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from moetrain.data.loader import SyntheticLoader

ADAMW_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
"""AdamW hyperparameters for kernel-against-reference checks."""
KERNEL_HYPER = {k: v for k, v in ADAMW_HYPER.items() if k != "lr"}
"""The same for the Triton kernels, which read the learning rate from their `corrections`."""


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


def carry_checkpoint(source, run_dir, *targets) -> None:
    """A real resume: `source`'s `checkpoint_state()` saved with DCP under `run_dir`, loaded into
    each target's `checkpoint_state()`, then the target's `checkpoint_loaded()` (every rank calls
    this; `run_dir` is the same on all)."""
    from moetrain.train.checkpoint_io import load_checkpoint, save_checkpoint

    path = save_checkpoint(run_dir, 0, source.checkpoint_state(), {"step": 0})
    for target in targets:
        load_checkpoint(path, target.checkpoint_state())
        target.checkpoint_loaded()


def saved_state(engine, run_dir) -> dict[str, dict[str, torch.Tensor]]:
    """What `engine`'s `checkpoint_state()` saves (with DCP under `run_dir`; every rank calls
    this, `run_dir` the same on all), read back whole on every rank: {"model": {entry: tensor},
    "optim": {"NAME.KEY": tensor}}, experts split per global index ("…/E")."""
    from moetrain.train.checkpoint_index import read_index
    from moetrain.train.checkpoint_io import load_checkpoint, save_checkpoint

    path = save_checkpoint(run_dir, 0, engine.checkpoint_state(), {"step": 0})
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, entry in read_index(path)[0].state_dict_metadata.items():
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = torch.empty(entry.size, dtype=entry.properties.dtype)
    load_checkpoint(path, out)
    return out


def adamw_inputs(n: int = 4096, seed: int = 1, moments_dtype: torch.dtype = torch.float32):
    """(param, grad, exp_avg, exp_avg_sq) of `n` elements, seeded."""
    g = torch.Generator().manual_seed(seed)
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m, v = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    return p, grad, m.to(moments_dtype), v.to(moments_dtype)


def run_in_triton_interpreter(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python with TRITON_INTERPRET=1 (Triton kernels executed on the CPU),
    tests/ on its path (`support` importable)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def routed_case(seed: int, N: int = 96, K: int = 4, D: int = 24, E: int = 16, skew: bool = False):
    """(topk ids (N, K), token rows (N, D) over four decades of scale, top-k weights, an output
    gradient) for permutation checks; `skew` sends most tokens to experts 0..K-1 (long runs of
    one expert, empty experts)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(N, E, generator=g)
    if skew:
        scores[: 3 * N // 4, :K] += 2.0
    ids = scores.topk(K, dim=-1).indices
    x = torch.randn(N, D, generator=g) * torch.logspace(-2, 2, N).unsqueeze(1)
    return ids, x, torch.rand(N, K, generator=g), torch.randn(N, D, generator=g)


def plain_permute_combine(x_ND, ids_NK, w_NK, experts):
    """The MoE permutation as plain autograd ops (autograd's own backward of each): index_select
    into expert order, `experts` on the sorted rows, index_copy back, weight, sum over k."""
    N, K = ids_NK.shape
    sort_idx = ids_NK.flatten().argsort(stable=True)
    y_MD = experts(x_ND.index_select(0, sort_idx // K))
    y_NKD = torch.empty_like(y_MD).index_copy(0, sort_idx, y_MD).view(N, K, -1)
    return (y_NKD * w_NK.unsqueeze(-1).to(y_NKD.dtype)).sum(1)


def fused_permute_combine(x_ND, ids_NK, w_NK, experts):
    """The same through src/moetrain/model/permute.py."""
    from moetrain.model.permute import permute, unpermute_combine
    from moetrain.model.token_dispatcher import sort_by_expert

    sort_idx, inv = sort_by_expert(ids_NK)
    return unpermute_combine(experts(permute(x_ND, sort_idx, inv)), w_NK, sort_idx, inv)
