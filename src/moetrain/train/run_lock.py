"""One live run owns a run directory: RUN_DIR/run.lock.

A run's rank 0 holds an exclusive flock(2) on run.lock for as long as its process lives; the
kernel drops it however the process ends (kill -9 included), so a dead run never keeps its
directory. A second run is refused with the owner the file names (host, pid, start time,
command). The file stays after the run: removing it could let two runs each lock a different
file of that name. Without flock (Lustre noflock, some NFS) the run says so and goes on
unguarded. A process that holds the directory already (a test building a `Trainer` again) only
counts one more holder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from moetrain.errors import ConfigError

LOCK_FILE = "run.lock"

_held: dict[Path, list[int]] = {}
"""Run directories (resolved) this process holds: [the lock file's descriptor, holders]."""

_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def acquire(run_dir: Path) -> None:
    """Take `run_dir` for this process, or raise `ConfigError` naming the live run that holds it.
    Each `acquire` is matched by one `release`."""
    key = run_dir.resolve()
    if key in _held:
        _held[key][1] += 1
        return
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        message = _in_use(run_dir, fd)
        os.close(fd)
        raise ConfigError(message) from None
    except OSError as e:
        if e.errno not in _NO_FLOCK:
            os.close(fd)
            raise
        print(
            f"note: {run_dir}'s file system has no flock, so nothing keeps a second run out of it while this one runs.",
            file=sys.stderr,
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(_me()) + "\n").encode(), 0)
    _held[key] = [fd, 1]


def release(run_dir: Path) -> None:
    """One holder gives `run_dir` up; with the last, the lock goes (its file stays, emptied)."""
    key = run_dir.resolve()
    if key in _held:
        _held[key][1] -= 1
        if _held[key][1] == 0:
            fd = _held.pop(key)[0]
            os.ftruncate(fd, 0)
            os.close(fd)


def _me() -> dict[str, Any]:
    command = shlex.join(["moetrain" if sys.argv[0].endswith("__main__.py") else sys.argv[0], *sys.argv[1:]])
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command if len(command) <= 300 else command[:299] + "…",
    }


def _in_use(run_dir: Path, fd: int) -> str:
    """The refusal, naming the owner that the held lock file `fd` names."""
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:  # being written, or not ours
        owner = {}
    owner = owner if isinstance(owner, dict) else {}
    pid, host = owner.get("pid"), owner.get("host")
    who = (
        f"pid {pid} on host {host}, since {owner.get('started', '?')} ({owner.get('command', '?')})"
        if pid is not None
        else "a process that has just taken it"
    )
    stop = f"stop it (kill {pid} on {host}: a run saves a checkpoint and ends on SIGTERM)" if pid else "stop it"
    return (
        f"Run directory '{run_dir}' is in use by a live run: {who}. Two runs writing one directory would mix their "
        f"checkpoints and metrics, so this one stops before touching it. Wait for that run to end, {stop}, or pass "
        "another --run-dir."
    )
