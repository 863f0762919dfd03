"""Process-group set-up from the environment torchrun provides (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK): NCCL on GPUs, gloo on CPU. A plain `python -m moetrain train` (no
torchrun) runs as a world of one without any process group."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device_type: str, timeout_s: float = 600.0) -> tuple[int, int]:
    """(rank, world size); initializes the default process group when there are several ranks
    and none exists yet. On CUDA each rank takes GPU LOCAL_RANK."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = world_size_from_env()
    if world == 1:
        return 0, 1
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend="nccl" if device_type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.get_rank(), dist.get_world_size()


_CPU_GROUP = None


def cpu_group() -> dist.ProcessGroup | None:
    """A process group over all ranks that moves CPU tensors: None (the default group) when that
    is gloo already, else a gloo group created once (collectively: every rank must call this the
    first time). For host-side agreement and background checkpoint writes."""
    global _CPU_GROUP
    if dist.get_backend() == "gloo":
        return None
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP
