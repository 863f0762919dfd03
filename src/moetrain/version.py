"""Which code a figure or an export came from: moetrain's version and the commit of the checkout."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def code_version() -> str:
    """The commit a figure was measured with: $MOETRAIN_COMMIT when set (for a copy of the tree
    whose git history is not its own, e.g. on a lent GPU machine), else the checkout's HEAD (short
    hash, "-dirty" when tracked files differ from it), else "unknown"."""
    if os.environ.get("MOETRAIN_COMMIT"):
        return os.environ["MOETRAIN_COMMIT"]
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True)
        return done.stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if dirty else head or "unknown"
