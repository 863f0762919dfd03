"""Where a command writes, checked before it writes anything.

Every command that writes (train's run directory, prepare-data's --out, export-hf's and
import-hf's OUT_DIR, plot's --out) checks its destination first with the `check_*` functions, so
that one it cannot use is one paragraph naming the path and the fix instead of a traceback
half-way through the work; `storage_reason` says what a write that failed all the same means.
Nothing here creates anything: a command refused here leaves no directory behind.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import shutil
from collections.abc import Iterable
from pathlib import Path

from moetrain.errors import ConfigError


def nearest_existing(path: Path) -> Path:
    """`path`, or the closest directory above it that exists (absolute)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_directory(path: str | Path, what: str, fix: str) -> None:
    """Refuse a directory that cannot be created or written: a file at `path` or above it, or no
    write permission in the closest existing directory. `what` names it ("Run directory"),
    `fix` says what to do ("pass --run-dir …")."""
    path = Path(path)
    if any(len(os.fsencode(part)) > 255 for part in path.parts) or len(os.fsencode(os.path.abspath(path))) > 4095:
        raise ConfigError(
            f"{what} '{path}' is too long a name for the file system (at most 255 bytes a name, 4,095 a path). {fix}."
        )
    existing = nearest_existing(path)
    if not existing.is_dir():
        where = "it is a file" if existing == Path(os.path.abspath(path)) else f"'{existing}' is a file"
        raise ConfigError(f"{what} '{path}' is not writable: {where}, not a directory. {fix}.")
    if not os.access(existing, os.W_OK | os.X_OK):
        inside = "" if existing == Path(os.path.abspath(path)) else f" (to create it in '{existing}')"
        raise ConfigError(f"{what} '{path}' is not writable: no permission to write there{inside}. {fix}.")


def check_overwrite(path: str | Path, replaced: list[str], what: str, command: str) -> None:
    """Refuse to replace `replaced` (names inside `path`, those that exist) without --force."""
    if not replaced:
        return
    shown = ", ".join(replaced[:4]) + (f" and {len(replaced) - 4} more" if len(replaced) > 4 else "")
    raise ConfigError(
        f"{what} '{path}' is not empty: it holds {shown}, which {command} would replace. Pass --force to "
        "replace them, or choose a new or empty directory."
    )


def existing_entries(path: str | Path, names: Iterable[str], matches=lambda name: False) -> list[str]:
    """The entries of directory `path` among `names` or for which `matches(name)` is true."""
    path, names = Path(path), set(names)
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.name in names or matches(p.name))


def check_free_space(path: str | Path, need_bytes: int, what: str, detail: str, fix: str) -> None:
    """Refuse when the filesystem of `path` has less than `need_bytes` free; `detail` says what
    needs them ("a checkpoint of 1.2B parameters × 12 bytes")."""
    free = shutil.disk_usage(nearest_existing(Path(path))).free
    if free < need_bytes:
        raise ConfigError(
            f"{what} '{path}' is on a filesystem with {format_bytes(free)} free, but {detail} takes about "
            f"{format_bytes(need_bytes)}. {fix}."
        )


def check_file(path: str | Path, what: str, fix: str, *, replaceable, kind: str, force: bool) -> None:
    """An output file: not a directory, its directory writable (`check_directory`), and an
    existing file replaced only when `replaceable(path)` (it is `kind`, the command's kind of
    output) or with --force."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} '{path}' is a directory: pass a file name. {fix}.")
    check_directory(path.parent, f"The directory of {what[0].lower()}{what[1:]}", fix)
    if path.is_file() and not force and not replaceable(path):
        raise ConfigError(
            f"{what} '{path}' exists and is not {kind}: pass --force to replace it, or choose another file name."
        )


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


_STORAGE = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file-size limit (ulimit -f) is reached",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "no permission (a directory made read-only?)",
    errno.EPERM: "not permitted",
    errno.ENOTDIR: "a file stands where a directory belongs",
    errno.ENAMETOOLONG: "the name is too long for the file system",
}


_SHORT_WRITE = (" requested and ", "unexpected pos", "failed writing file")
"""How numpy's `tofile` and torch's serialization say a write stopped short."""


def storage_reason(e: BaseException) -> str | None:
    """What a write's error means for the user when the storage refused it (full, quota, size
    limit, read-only, permission), found in `e` or in the first failure a DCP `CheckpointException`
    carries; None for any other error. numpy's `tofile` and torch's file writer report a short
    write without an errno: a full disk or the size limit."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        e = next(iter(failures.values()))[0]
    code = e.errno if isinstance(e, OSError) else None
    rust = re.search(r"\(os error (\d+)\)", str(e))  # the tokenizers library's (Rust) io errors
    code = int(rust.group(1)) if code is None and rust else code
    short = code is None and isinstance(e, OSError | RuntimeError) and any(s in str(e) for s in _SHORT_WRITE)
    if code not in _STORAGE and not short:
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    what = _STORAGE.get(code, "the write stopped short: the disk is full or the file-size limit is reached")
    if (short or code == errno.EFBIG) and limit != resource.RLIM_INFINITY:
        what += f" (ulimit -f allows {limit // 1024:,} KiB a file: raise it with ulimit -f unlimited)"
    return what
