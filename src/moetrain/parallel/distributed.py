"""Process-group set-up from the environment torchrun provides (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK): NCCL on GPUs, gloo on CPU. A plain `python -m moetrain train` (no
torchrun) runs as a world of one without any process group.

Every rank also keeps a heartbeat in the rendezvous store (a counter it increments once a second
from a background thread). When a collective fails because a peer is gone, the survivors name it
(`unresponsive_ranks()`: the ranks whose counter stood still). A dead or hung peer that makes no
collective fail (NCCL may just wait): each rank's thread also watches its successor in a ring (so
the store sees O(world) reads a second) and, when that counter has stood still for
`peer_timeout_s`, prints an error naming it and ends the process; the launcher then stops the
others. A rank that finishes normally marks itself done first. Under torchrun the store is the
launcher's, which outlives the workers.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import pickle
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from moetrain.errors import ConfigError
from moetrain.parallel import rehearsal as rehearsals
from moetrain.parallel.rehearsal import Rehearsal


def world_size_from_env() -> int:
    return launch_int("WORLD_SIZE", "1", 1)


def launch_int(name: str, default: str, low: int, high: int | None = None) -> int:
    """The launch variable `name` (default `default`) as an integer in [low, high), else one
    paragraph naming it: set by hand or by a wrapper, a wrong one would hang or crash the start."""
    text = os.environ.get(name, default)
    value = int(text) if text.strip().isdigit() else None
    if value is None or value < low or (high is not None and value >= high):
        within = f"from {low} to {high - 1}" if high is not None else f"≥ {low}"
        raise ConfigError(
            f"{name}={text!r} is not an integer {within}"
            f"{' (RANK counts the WORLD_SIZE ranks from 0)' if name == 'RANK' else ''}: start the ranks with "
            "torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT, or unset them for one process."
        )
    return value


DEFAULT_PORT = 29500

# Launchers that start every rank themselves, without torchrun: (world size, rank, local rank).
_LAUNCHERS = {
    "srun (SLURM)": ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
    "mpirun (Open MPI)": ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "mpirun (MPICH / Intel MPI)": ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"),
}


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("gpu-[003-007,010],cpu1" → "gpu-003")."""
    first = nodelist.split(",")[0]
    if "[" not in first:  # a plain host name
        return first
    prefix, ranges = first.split("[", 1)  # a bracketed range: its first number, padding kept
    return prefix + ranges.split("-")[0].rstrip("]")


def adopt_launcher_env(env: dict[str, str] | None = None) -> None:
    """Ranks started by srun or mpirun without torchrun: without this they would each run as a
    world of one, N independent runs into one run directory. Derive RANK, WORLD_SIZE and
    LOCAL_RANK from the launcher's variables, MASTER_ADDR (SLURM: the node list's first host) and
    MASTER_PORT (29500 + the SLURM job id mod 1000, or 29500), into `env` (os.environ); or refuse
    with the torchrun line when rank 0's address cannot be known. No-op under torchrun or alone."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env or "RANK" in env:
        return  # torchrun (or a user) set the torch variables: they win
    for launcher, (size_key, rank_key, local_key) in _LAUNCHERS.items():
        if int(env.get(size_key, "1") or "1") <= 1 or rank_key not in env:
            continue
        world, rank = env[size_key], env[rank_key]
        addr = env.get("MASTER_ADDR")
        if addr is None and env.get("SLURM_JOB_NODELIST"):
            addr = first_slurm_host(env["SLURM_JOB_NODELIST"])
        if addr is None:
            raise ConfigError(
                f"Started by {launcher} as rank {rank} of {world}, but rank 0's address is unknown: export "
                f"MASTER_ADDR=<rank 0's host> (and MASTER_PORT, default {DEFAULT_PORT}) to every rank, or start "
                "one torchrun per node: torchrun --nnodes=<nodes> --nproc-per-node=<GPUs per node> "
                "--rdzv-backend=c10d --rdzv-endpoint=<first host>:29500 -m moetrain train ..."
            )
        job = env.get("SLURM_JOB_ID", "")
        port = env.get("MASTER_PORT") or str(DEFAULT_PORT + (int(job) % 1000 if job.isdigit() else 0))
        env.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=env.get(local_key, "0"), MASTER_ADDR=addr, MASTER_PORT=port)
        return


def init_distributed(
    device_type: str, timeout_s: float = 600.0, peer_timeout_s: float = 120.0, rehearsal: Rehearsal | None = None
) -> tuple[int, int]:
    """(rank, world size); initializes the default process group when there are several ranks
    and none exists yet (torchrun's variables, or srun's / mpirun's: `adopt_launcher_env`). On
    CUDA each rank takes GPU LOCAL_RANK. With `rehearsal`, this process alone is that rank of
    that world, its peers stood in for (src/moetrain/parallel/rehearsal.py), on the current device."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if rehearsal is not None:
        if world_size_from_env() > 1:
            raise ConfigError(
                f"--rehearse runs one rank alone, but this process is one of WORLD_SIZE={world_size_from_env()} "
                "(torchrun): start it as a plain process."
            )
        rehearsals.init(rehearsal)
        return rehearsal.rank, rehearsal.world
    adopt_launcher_env()
    world = world_size_from_env()
    if world == 1:
        return 0, 1
    if device_type == "cuda":
        torch.cuda.set_device(launch_int("LOCAL_RANK", "0", 0))
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend="nccl" if device_type == "cuda" else "gloo",
        timeout=timeout,
        store=_rendezvous_store(world, timeout),
        rank=launch_int("RANK", "", 0, world),
        world_size=world,
    )
    _start_heartbeat(peer_timeout_s)
    return dist.get_rank(), dist.get_world_size()


def _rendezvous_store(world: int, timeout: datetime.timedelta) -> dist.Store:
    """The store the ranks meet in: MASTER_ADDR:MASTER_PORT (torchrun's own store, or rank 0's),
    under a prefix per torchrun restart attempt.

    We build it instead of letting `init_process_group` read env://: after a `torchrun
    --max-restarts` restart, ranks joining through env:// can fail to connect ("connectFullMesh
    failed … Connection refused"; torch issue #167288), while a store with our own per-attempt
    prefix reconnects them (measured: docs/reliability.md, docs/benchmarks.md)."""
    missing = [k for k in ("RANK", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world} is set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
            "start several ranks with torchrun (it sets RANK, MASTER_ADDR and MASTER_PORT), or unset WORLD_SIZE."
        )
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    rank, port = launch_int("RANK", "", 0, world), launch_int("MASTER_PORT", "", 1, 65536)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        base = dist.TCPStore(
            addr, port, world, is_master=rank == 0 and not agent_store, timeout=timeout, wait_for_workers=False
        )
    except (RuntimeError, dist.DistError) as e:
        if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
            raise ConfigError(
                f"MASTER_PORT={port} on {addr} is in use (another run or program holds it), so rank 0 cannot meet "
                "its peers there: choose a free port (torchrun --master-port=N or --rdzv-endpoint=HOST:N; or "
                "export MASTER_PORT=N to every rank)."
            ) from None
        raise ConfigError(
            f"rank {rank} could not reach rank 0 at {addr}:{port} within {timeout.total_seconds():.0f} s "
            f"({str(e).strip().splitlines()[0][:200]}). {_who_starts_ranks(world)}"
        ) from None
    store = dist.PrefixStore(f"/moetrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)
    _await_ranks(store, world, rank, timeout.total_seconds(), f"{addr}:{port}")
    return store


def _await_ranks(store: dist.Store, world: int, rank: int, timeout_s: float, where: str) -> None:
    """Every rank counts itself in; rank 0 waits for all `world`, saying every 30 s how many came,
    and lets the others go on; past `timeout_s` each stops, saying how many are missing and who
    starts them."""
    arrived, start, said = store.add("arrived", 1), time.monotonic(), 0.0
    if rank != 0:
        try:
            store.wait(["all_arrived"], datetime.timedelta(seconds=timeout_s))
            return
        except (RuntimeError, dist.DistError):
            arrived = store.add("arrived", 0)
    while rank == 0 and arrived < world and time.monotonic() - start <= timeout_s:
        waited = time.monotonic() - start
        if waited - said >= 30:
            said = waited
            print(f"rank 0: {arrived} of {world} ranks here after {waited:.0f} s, waiting at {where}", file=sys.stderr)
        time.sleep(0.2)
        arrived = store.add("arrived", 0)
    if arrived < world:
        raise ConfigError(
            f"rank {rank}: {arrived} of WORLD_SIZE={world} ranks met at {where} in {time.monotonic() - start:.0f} s "
            f"(parallel.timeout_s): {world - arrived} never came. {_who_starts_ranks(world)}"
        )
    if rank == 0:
        store.set("all_arrived", "1")


def _who_starts_ranks(world: int) -> str:
    """What starts the ranks under the launcher this process was started by, and what a rank
    that never comes usually means there."""
    if "SLURM_NTASKS" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        return (
            f"SLURM_NTASKS={world} asks for {world} ranks, and srun starts one process per task (srun python -m "
            "moetrain …); a plain python inside an allocation or batch script is one process: start it with "
            "srun or torchrun, or unset SLURM_NTASKS to run alone."
        )
    return (
        f"Start all {world} ranks (torchrun --nproc-per-node on each node, the same --rdzv-endpoint everywhere), "
        "and check that every node reaches rank 0's address and port."
    )


HEARTBEAT_S = 1.0
_HEARTBEAT: tuple[object, threading.Event] | None = None


def _heartbeat_key(rank: int) -> str:
    return f"moetrain/heartbeat/{rank}"


def _done_key(rank: int) -> str:
    return f"moetrain/done/{rank}"


def _start_heartbeat(peer_timeout_s: float | None = None) -> None:
    """Tick this rank's counter every HEARTBEAT_S; with `peer_timeout_s`, also watch the next
    rank's counter and end the process if it stands still that long."""
    global _HEARTBEAT
    stop_heartbeat()
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # a private torch helper: without it, failures just name no rank
        return
    stop = threading.Event()
    me, world = dist.get_rank(), dist.get_world_size()
    key, peer = _heartbeat_key(me), (me + 1) % world
    watch = peer_timeout_s is not None and world > 1

    def beat() -> None:
        last_value, last_change = None, time.monotonic()
        while not stop.wait(HEARTBEAT_S):
            try:
                store.add(key, 1)
                if not watch:
                    continue
                value = store.add(_heartbeat_key(peer), 0)  # add 0: read without blocking
                now = time.monotonic()
                if value != last_value:
                    last_value, last_change = value, now
                elif now - last_change > peer_timeout_s and not store.add(_done_key(peer), 0) and not stop.is_set():
                    _peer_lost(me, peer, now - last_change)
            except Exception:  # the store is gone (shutdown or the launcher died): stop quietly
                return

    store.add(key, 1)
    threading.Thread(target=beat, name="moetrain-heartbeat", daemon=True).start()
    _HEARTBEAT = (store, stop)


def _peer_lost(me: int, peer: int, silent_s: float) -> None:
    message = (
        f"error: rank {me}: rank {peer} has shown no sign of life for {silent_s:.0f} s (dead or hung; "
        "parallel.peer_timeout_s); stopping this rank. Completed checkpoints are intact: continue with "
        "--resume (under torchrun, --max-restarts=N with --resume restarts and resumes by itself).\n"
    )
    os.write(2, message.encode())
    os._exit(1)  # from this thread: the main one may be stuck in a collective


def unresponsive_ranks(watch_s: float = 3 * HEARTBEAT_S) -> list[int] | None:
    """The other ranks whose heartbeat did not advance within `watch_s` seconds (dead or hung;
    ranks that finished normally are not named), or None when that cannot be told (no process
    group, or the store is unreachable)."""
    if _HEARTBEAT is None or not dist.is_initialized():
        return None
    store = _HEARTBEAT[0]
    me, world = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(world) if r != me]
    try:
        before = {r: store.add(_heartbeat_key(r), 0) for r in others}  # add 0: read without blocking
        time.sleep(watch_s)
        after = {r: store.add(_heartbeat_key(r), 0) for r in others}
        finished = {r for r in others if store.add(_done_key(r), 0)}  # ended normally: not gone
    except Exception:
        return None
    return [r for r in others if after[r] == before[r] and r not in finished]


def stop_heartbeat(done: bool = False) -> None:
    """Stop ticking; `done`: first tell the rank watching this one that it finished normally."""
    global _HEARTBEAT
    if _HEARTBEAT is not None:
        store, stop = _HEARTBEAT
        stop.set()
        _HEARTBEAT = None
        if done:
            with contextlib.suppress(Exception):  # the store may be gone already
                store.add(_done_key(dist.get_rank()), 1)


def shutdown() -> None:
    """Mark this rank done, stop the heartbeat, destroy the default process group (if any)."""
    stop_heartbeat(done=True)
    if dist.is_initialized():
        dist.destroy_process_group()


_FROM_RANK_0 = itertools.count()


def from_rank_0(value: Any) -> Any:
    """Rank 0's `value` on every rank (each rank passes its own; only rank 0's is used): through
    the rendezvous store, pickled, so it makes no collective and no tensor operation (a
    rehearsed rank, which has no peers, runs the same operators as the real one). For start-up
    choices and refusals that rank 0 alone can make; every rank calls it in the same order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    store = dist.distributed_c10d._get_default_store()
    key = f"moetrain/from-rank-0/{next(_FROM_RANK_0)}"
    if dist.get_rank() == 0:
        store.set(key, pickle.dumps(value))
        return value
    return pickle.loads(store.get(key))


_ALIKE = itertools.count()


def refuse_unless_alike(settings: dict[str, Any]) -> None:
    """Stop every rank with one message naming the first rank and keys that differ when some
    rank's `settings` (a config's dotted keys, or a command's flags → value) are not rank 0's: ranks
    launched with other flags or config files would meet in mismatched collectives and fail as a dead
    peer, or hang.
    Through the store, as `from_rank_0`; every rank calls it in the same order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    key, verdict = f"moetrain/alike/{next(_ALIKE)}", None
    if rank != 0:
        store.set(f"{key}/{rank}", pickle.dumps(settings))
    else:
        others = {r: pickle.loads(store.get(f"{key}/{r}")) for r in range(1, dist.get_world_size())}
        differ = [r for r, theirs in others.items() if theirs != settings]
        if differ:
            theirs = others[differ[0]]
            keys = [k for k in sorted(settings.keys() | theirs.keys()) if settings.get(k) != theirs.get(k)]
            shown = ", ".join(f"{k}={theirs.get(k)!r} there, {settings.get(k)!r} on rank 0" for k in keys[:3])
            shown += f" and {len(keys) - 3} more keys" if len(keys) > 3 else ""
            verdict = (
                f"rank {differ[0]} was started with other settings than rank 0 ({len(differ)} of "
                f"{len(others)} other ranks differ): {shown}"
                ". Every rank of a run must get the same flags, config file and overrides: check the launch line, "
                "and a config file or variable that differs from rank to rank or node to node."
            )
    verdict = from_rank_0(verdict)
    if verdict:
        raise ConfigError(verdict)


_CPU_GROUP = None


def cpu_group() -> dist.ProcessGroup | None:
    """A process group over all ranks that moves CPU tensors: None (the default group) when that
    is gloo already, else a gloo group created once (collectively: every rank must call this the
    first time). For host-side agreement and background checkpoint writes. A rehearsal's default
    group moves CPU tensors too."""
    global _CPU_GROUP
    if dist.get_backend() in ("gloo", rehearsals.BACKEND):
        return None
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP
