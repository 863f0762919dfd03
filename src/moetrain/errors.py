"""User-facing errors.

A `ConfigError` (or any `MoetrainError`) means the user asked for something we cannot do: the
command line prints its message as one paragraph and exits non-zero, without a traceback
(unless `--debug`). Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import stat
from pathlib import Path
from types import ModuleType


def file_kind(path: Path) -> str:
    """What a path that is not a regular file is, for a message: "a directory", "a FIFO (named
    pipe)", "a character device (like /dev/null)", "a link to nothing"…"""
    try:
        mode = path.stat().st_mode
    except OSError:
        return "a link to nothing" if path.is_symlink() else "not there"
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device (like /dev/null)"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


class MoetrainError(Exception):
    """A mistake the user can fix. The message names the file/field/value and the fix."""


class ConfigError(MoetrainError):
    """A configuration value, key or file that is wrong."""


class DataError(MoetrainError):
    """A data file that is missing, empty, truncated or inconsistent with its metadata."""


class CheckpointError(MoetrainError):
    """A checkpoint that is missing, incomplete or does not match the model."""


class MissingDependency(MoetrainError):
    """An optional package the command needs is not installed (`require`)."""


EXTRAS = {
    "safetensors": "hf",
    "transformers": "hf",
    "matplotlib": "viz",
    "tensorboard": "viz",
    "wandb": "wandb",
    "pyarrow": "data",
}
"""Optional packages → the pyproject extra that installs them."""


def install_hint(package: str) -> str:
    extra = EXTRAS[package]
    return (
        f"pip install 'moetrain[{extra}]' (in a checkout: .venv/bin/pip install -e '.[{extra}]', or "
        "`source .venv/bin/activate` first)"
    )


def require(module: str, purpose: str) -> ModuleType:
    """Import `module` (dotted; its top-level package must be in `EXTRAS`) or raise
    MissingDependency naming what needs it and the install line."""
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(
            f"{purpose} needs the optional package '{package}', which cannot be imported here ({e}). "
            f"Install it with {install_hint(package)}."
        ) from None
