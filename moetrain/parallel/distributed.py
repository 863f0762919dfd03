"""Process-group set-up from the environment torchrun provides (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK): NCCL on GPUs, gloo on CPU. A plain `python -m moetrain train` (no
torchrun) runs as a world of one without any process group.

Every rank also keeps a heartbeat in the rendezvous store (a counter it increments once a second
from a background thread), so that when a collective fails because a peer is gone the survivors
can name it: `unresponsive_ranks()` watches the counters for a few seconds and returns the ranks
whose counter stood still. Under torchrun the store is the launcher's, which outlives the workers.
"""

from __future__ import annotations

import datetime
import os
import threading
import time

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
    _start_heartbeat()
    return dist.get_rank(), dist.get_world_size()


HEARTBEAT_S = 1.0
_HEARTBEAT: tuple[object, threading.Event] | None = None


def _heartbeat_key(rank: int) -> str:
    return f"moetrain/heartbeat/{rank}"


def _start_heartbeat() -> None:
    global _HEARTBEAT
    stop_heartbeat()
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # a private torch helper: without it, failures just name no rank
        return
    stop = threading.Event()
    key = _heartbeat_key(dist.get_rank())

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                store.add(key, 1)
            except Exception:  # the store is gone (shutdown or the launcher died): stop quietly
                return

    store.add(key, 1)
    threading.Thread(target=beat, name="moetrain-heartbeat", daemon=True).start()
    _HEARTBEAT = (store, stop)


def unresponsive_ranks(watch_s: float = 3 * HEARTBEAT_S) -> list[int] | None:
    """The other ranks whose heartbeat did not advance within `watch_s` seconds (dead or hung),
    or None when that cannot be told (no process group, or the store is unreachable)."""
    if _HEARTBEAT is None or not dist.is_initialized():
        return None
    store = _HEARTBEAT[0]
    me, world = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world) if r != me]
    try:
        before = {r: store.add(_heartbeat_key(r), 0) for r in others}  # add 0: read without blocking
        time.sleep(watch_s)
        after = {r: store.add(_heartbeat_key(r), 0) for r in others}
    except Exception:
        return None
    return [r for r in others if after[r] == before[r]]


def stop_heartbeat() -> None:
    global _HEARTBEAT
    if _HEARTBEAT is not None:
        _HEARTBEAT[1].set()
        _HEARTBEAT = None


def shutdown() -> None:
    """Stop the heartbeat and destroy the default process group (if any)."""
    stop_heartbeat()
    if dist.is_initialized():
        dist.destroy_process_group()


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
