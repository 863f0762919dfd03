"""CUDA-event timing shared by the GPU probes under benchmarks/, and the trainer a preset's probe
starts from."""

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


def busy_ms(fn, calls: int = 3) -> float:
    """The summed kernel time per call of `fn` (torch.profiler over `calls` calls): the device
    time alone, without the gaps between kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1000 / calls


def probe_trainer(doc: str, example: str, extra_overrides: list[str] = ()):
    """(the preset's name, its overrides, a quiet `Trainer` on CUDA) from the command line
    `PRESET [--section.key=value ...]`: the preset as `moetrain bench` runs it (synthetic data,
    no evaluation, no checkpoints), in a temporary run directory, with `extra_overrides` last."""
    import argparse
    import tempfile

    from moetrain.bench import BENCH_OVERRIDES
    from moetrain.presets import resolve_config
    from moetrain.train.trainer import Trainer

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("preset")
    ap.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {example}")
    args, extra = ap.parse_known_args()
    overrides = [o.removeprefix("--") for o in args.overrides + extra]
    run = [f"train.run_dir={tempfile.mkdtemp()}", "train.device=cuda", *extra_overrides]
    return args.preset, overrides, Trainer(resolve_config(args.preset, overrides + BENCH_OVERRIDES + run), quiet=True)
