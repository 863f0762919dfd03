"""Where a run executes: the device, the process group and this rank's share of the layout.

`setup_runtime(cfg)` is the first thing a run does (before any data or model exists):

    device (train.device) → the default process group (torchrun's environment; none for one
    process) → the layout on that many ranks (`RunConfig.build_dims`, which validates the run
    for this world size and device) → this rank's process groups
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moetrain.errors import ConfigError
from moetrain.parallel.dims import ParallelState
from moetrain.parallel.distributed import init_distributed, refuse_unless_alike
from moetrain.parallel.rehearsal import Rehearsal
from moetrain.train.config import RunConfig


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    par: ParallelState


def resolve_device(name: str) -> torch.device:
    """train.device as a torch.device: "auto" is cuda when a GPU is visible, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available here: use --device cpu.")
    return torch.device(name)


def setup_runtime(cfg: RunConfig, rehearsal: Rehearsal | None = None) -> Runtime:
    """The module docstring's steps, on each rank (under torchrun each takes GPU LOCAL_RANK); with
    `rehearsal` this process is that one rank of that world (src/moetrain/parallel/rehearsal.py)."""
    device = resolve_device(cfg.train.device)
    rank, world = init_distributed(device.type, cfg.parallel.timeout_s, cfg.parallel.peer_timeout_s, rehearsal)
    if rehearsal is None:  # train.device may name each rank's GPU; rank 0's train.run_dir is the run's
        refuse_unless_alike(dotted(cfg.to_dict()) | {"train.device": device.type, "train.run_dir": None})
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", torch.cuda.current_device())
    dims = cfg.build_dims(world, device)
    return Runtime(device, ParallelState.create(dims, device.type, rank, rehearsed=rehearsal is not None))


def dotted(tree: dict, prefix: str = "") -> dict:
    """A nested config dict as dotted key → value."""
    flat = {}
    for k, v in tree.items():
        flat |= dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return flat


def cpu_threads(sample_s: float = 0.3) -> tuple[int, int, float]:
    """(intra-op threads for a one-process CPU run, the cores this process may use, how many of
    those other processes kept busy over `sample_s`). The cores it may use: its CPU affinity,
    capped by a cgroup CPU quota; the threads: those left idle (threads beyond them wait on each
    other: docs/benchmarks.md, "On the CPU"), at least one, at most torch's own choice."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    may_use = min(len(cores), _cgroup_cores()) if cores else torch.get_num_threads()
    before = _idle_and_total(cores)
    time.sleep(sample_s)
    after = _idle_and_total(cores)
    busy = 0.0
    if before and after and after[1] > before[1]:
        busy = len(cores) * (1 - (after[0] - before[0]) / (after[1] - before[1]))
    free = max(1, min(may_use, len(cores) - round(busy)) if cores else may_use)
    return min(free, torch.get_num_threads()), may_use, busy


def _idle_and_total(cores: list[int]) -> tuple[int, int] | None:
    """Idle and total jiffies of `cores` in /proc/stat (None where there is none)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    idle = total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            values = [int(v) for v in fields[:8]]
            idle, total = idle + values[3] + values[4], total + sum(values)  # idle + iowait
    return (idle, total) if total else None


def _cgroup_cores() -> int:
    """The cgroup's CPU quota in whole cores (cgroup v2 cpu.max, v1 cfs_quota_us); a large number
    where there is none."""
    for quota_file, period_file in (
        ("/sys/fs/cgroup/cpu.max", None),
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    ):
        try:
            quota, *rest = Path(quota_file).read_text().split()
            period = rest[0] if rest else Path(period_file).read_text().strip()
            if quota not in ("max", "-1"):
                return max(1, math.ceil(int(quota) / int(period)))
        except (OSError, ValueError, IndexError, TypeError):
            continue
    return 1 << 16
