"""`run_distributed(fn, world_size, *args)`: run `fn(*args)` on `world_size` new CPU processes
joined by a gloo process group (or, with backend="nccl", one GPU each), and return each rank's
result.

Each rank is a fresh process forked from a server that imported torch and the trainer once
(multiprocessing's forkserver: no rank re-imports them, which on two cores took most of a small
layout test's time), with the parent's environment at the call, one torch thread, and a
process-group timeout, so a hung collective fails the test instead of hanging CI; the parent
kills every rank after `timeout_s` in any case.
"""

from __future__ import annotations

import datetime
import os
import queue as queue_module
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetrain.parallel.distributed import shutdown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "moetrain.train.trainer"]
"""What the fork server imports before it forks any rank."""


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, backend: str | None, env: dict
) -> None:
    os.environ.clear()  # the fork server's environment is the one it started with
    os.environ.update(env)
    if backend is not None:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
        )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank)
        if backend is not None:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
        result = fn(*args)
        queue.put((rank, True, result))
    except BaseException:  # report everything, including CheckpointException
        queue.put((rank, False, traceback.format_exc()))
    finally:
        shutdown()


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout_s: float = 240.0, backend: str | None = "gloo"
) -> list[Any]:
    """Results of `fn(*args)` per rank; raises with the failing rank's traceback. `backend="nccl"`
    puts rank r on GPU r; `backend=None` starts the processes without a process group."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, backend, env))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, payload = queue.get(timeout=timeout_s)
            except queue_module.Empty:
                raise RuntimeError(f"distributed test timed out after {timeout_s} s (a hung collective?)") from None
            (results.__setitem__(rank, payload) if ok else errors.append(f"rank {rank}:\n{payload}"))
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed test failed on " + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def run_alone(fn: Callable, *args: Any, timeout_s: float = 240.0) -> Any:
    """`fn(*args)` in one new process with no process group (e.g. a rehearsal, which
    makes its own)."""
    return run_distributed(fn, 1, *args, timeout_s=timeout_s, backend=None)[0]


def call_each(fn: Callable, arg_sets: list[tuple]) -> list[Any]:
    """`[fn(*args) for args in arg_sets]`, in order, on this rank: several runs in one group
    (`run_distributed(call_each, world, fn, [(a,), (b,)])`), which saves a group's start-up per
    run."""
    return [fn(*args) for args in arg_sets]


class NaNGradOnPadding(torch.autograd.Function):
    """Identity on rows; backward writes NaN into the gradient of the rows marked `pad` (a
    dispatcher's padding rows), so a padding row that leaks into a result shows."""

    @staticmethod
    def forward(ctx, x, pad):
        ctx.save_for_backward(pad)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (pad,) = ctx.saved_tensors
        return grad.masked_fill(pad, float("nan")), None
