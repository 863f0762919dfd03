"""CUDA-event timing shared by the GPU probes under benchmarks/."""

from __future__ import annotations

import statistics

import torch


def timed(fn, reps: int = 20, warmup: int = 5) -> float:
    """Median CUDA-event milliseconds of `fn` over `reps` calls, after `warmup`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def window_ms(fn, calls: int = 10, windows: int = 3) -> float:
    """Median over `windows` of CUDA-event ms per call, `calls` back to back in each with no host
    wait between them (launches may queue ahead of the GPU, as in training)."""
    out = []
    for _ in range(windows):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / calls)
    return statistics.median(out)
