"""`RunDir`: what a run keeps on disk, and the rules for starting, resuming and finishing it.

    RUN_DIR/config.yaml       the resolved config (rank 0, at start)
    RUN_DIR/tokenizer.json    the data's tokenizer, for eval / generate / export
    RUN_DIR/metrics.jsonl     one record per logged step (src/moetrain/train/metrics.py)
    RUN_DIR/summary.json      the run's summary, rewritten at the end of every `fit`
    RUN_DIR/checkpoints/      step-N checkpoints (src/moetrain/train/checkpoint.py)
    RUN_DIR/run.lock          held by the live run's rank 0 (src/moetrain/train/run_lock.py)

Only rank 0 writes here, except checkpoints (every rank writes its shards). Rank 0 checks the
directory when the run is built (`RunDir(...)`: a file in its place, permissions, free disk for a
checkpoint), then creates it and takes it (`run_lock.acquire`) before anything reads or changes
what is in it; a run refused later in start-up (a missing data directory, say) gives it back
(`abandon`), removing what it created, so it leaves no empty directory behind.

Without train.run_dir (--run-dir), `default_run_dir` names one after the run: runs/NAME, NAME
being the preset's or the YAML file's, so that a new run never lands in an earlier one's records.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import weakref
from pathlib import Path
from typing import Any

from moetrain.destinations import check_directory, check_free_space
from moetrain.errors import ConfigError
from moetrain.train import checkpoint as ckpt
from moetrain.train import run_lock
from moetrain.train.metrics import read_metrics

STALE_RECORDS = ("metrics.jsonl", "summary.json", "wandb_id.txt")
"""What a fresh start removes: records of an earlier run in the same directory."""


FIX = "Pass --run-dir a directory you can write"


class RunDir:
    def __init__(self, path: str | Path, main: bool, checkpoint_bytes: int = 0, checkpoint_detail: str = ""):
        """Check (rank 0) that the run can write at `path` and, when it saves checkpoints, that
        one of `checkpoint_bytes` fits (`checkpoint_detail` says why that many); then create the
        directory and take it for this run, or refuse with the live run that holds it."""
        self.path = Path(path)
        self.main = main
        """Rank 0: the one rank that writes records."""
        self._made: list[Path] = []
        """What taking the directory created (its missing parents, itself, run.lock), outermost first."""
        self._release: weakref.finalize | None = None
        """Gives this object's hold on the lock back, once: at `release`, or when it is collected."""
        if main:
            check_directory(self.path, "Run directory", FIX)
            if checkpoint_bytes:
                check_directory(self.path / "checkpoints", "The run's checkpoint directory", FIX)
                check_free_space(
                    self.path,
                    checkpoint_bytes,
                    "Run directory",
                    checkpoint_detail or "a checkpoint",
                    "Free space, pass --run-dir on another filesystem, or save no checkpoints "
                    "(--checkpoint.save_every=0 --checkpoint.save_final=false)",
                )
            self._take()

    def _take(self) -> None:
        self._made = [p for p in (*reversed(self.path.parents), self.path) if not p.exists()]
        if not (self.path / run_lock.LOCK_FILE).exists():
            self._made.append(self.path / run_lock.LOCK_FILE)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            run_lock.acquire(self.path)
            self._release = weakref.finalize(self, run_lock.release, self.path)
        except OSError as e:
            self.abandon()
            raise ConfigError(f"Run directory '{self.path}' is not writable ({e.strerror}). {FIX}.") from None
        except ConfigError:
            self._made = []
            raise

    def abandon(self) -> None:
        """Give the directory back after the run was refused at start-up (rank 0), removing what
        taking it created."""
        self.release()
        if self.main:
            for made in reversed(self._made):
                try:
                    made.unlink() if made.name == run_lock.LOCK_FILE else made.rmdir()
                except OSError:  # something else is in it now: it stays
                    break
            self._made = []

    def release(self) -> None:
        """Give the directory up, the run over (run.lock stays, naming nobody)."""
        if self._release is not None:
            self._release()

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        return ckpt.list_checkpoints(self.path)

    def last_checkpoint(self, at_most: int | None = None) -> str | None:
        """The newest complete checkpoint (of a step ≤ `at_most`, if given), or None."""
        found = [(step, path) for step, path in self.checkpoints() if at_most is None or step <= at_most]
        return str(found[-1][1]) if found else None

    def partial_checkpoints(self) -> list[Path]:
        """Checkpoints interrupted while being written (never loaded)."""
        return sorted(ckpt.checkpoints_dir(self.path).glob(".step-*.tmp"))

    def move_aside(self, checkpoint: Path) -> Path | None:
        """Rename a damaged checkpoint step-N to step-N.damaged (rank 0), out of `--resume`'s and
        retention's sight, its files kept for a look; returns the new path (None on other ranks,
        or when another rank or process moved it already)."""
        if not self.main:
            return None
        for i in range(1, 100):
            target = checkpoint.with_name(f"{checkpoint.name}.damaged" + (f"-{i}" if i > 1 else ""))
            if not target.exists():
                try:
                    os.replace(checkpoint, target)
                except FileNotFoundError:
                    return None
                return target
        return None

    def last_val_loss(self, step: int) -> float | None:
        """The last validation loss metrics.jsonl records up to `step`."""
        values = [r["val_loss"] for r in read_metrics(self.metrics_file) if r["step"] <= step and "val_loss" in r]
        return values[-1] if values else None

    def start_fresh(self) -> None:
        """A new run must not mix with an earlier run's records or checkpoints."""
        found = self.checkpoints()
        if found:
            raise ConfigError(
                f"Run directory '{self.path}' already holds checkpoints (newest: step "
                f"{found[-1][0]}). Pass --resume to continue that run, or choose another --run-dir."
            )
        if self.main:
            for stale in STALE_RECORDS:
                (self.path / stale).unlink(missing_ok=True)

    def keep_records_up_to(self, step: int) -> None:
        """After resuming from step `step`: the records past it will be produced again, so they
        go (metrics.jsonl stays a log of one run)."""
        if self.main:
            kept = [r for r in read_metrics(self.metrics_file) if r["step"] <= step]
            self.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write_config(self, config_yaml: str, tokenizer_file: Path | None) -> None:
        if self.main:
            self.config_file.write_text(config_yaml)
            if tokenizer_file is not None and tokenizer_file.is_file():
                shutil.copyfile(tokenizer_file, self.path / "tokenizer.json")

    def read_summary(self) -> dict[str, Any]:
        path = self.path / "summary.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.main:
            (self.path / "summary.json").write_text(json.dumps(summary, indent=1))


RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", run_lock.LOCK_FILE)
"""What makes a directory hold a run (`holds_run`): each appears when a run starts or logs."""


def holds_run(path: Path) -> bool:
    return any((path / name).exists() for name in RUN_FILES)


def default_run_dir(name: str, resume: bool, root: str | Path = "runs") -> tuple[Path, str]:
    """train.run_dir when it is not set, and why (a note for the start-up header).

    root/NAME, root/NAME-2, root/NAME-3, … are the runs of NAME, newest last. A fresh run takes
    root/NAME while none of them holds a run (`holds_run`), else the number after the newest
    (an earlier run is never written into); with `resume`, the newest that holds a run (root/NAME
    when none does)."""
    root = Path(root)
    pattern = re.compile(rf"{re.escape(name)}-(\d+)")
    numbered = {1: root / name}
    if root.is_dir():
        for path in root.iterdir():
            match = pattern.fullmatch(path.name)
            if match and int(match.group(1)) >= 2:
                numbered[int(match.group(1))] = path
    held = sorted(n for n, path in numbered.items() if holds_run(path))
    if not held:
        return root / name, f"named after {name}"
    newest = numbered[held[-1]]
    if resume:
        return newest, f"the newest run of {name}"
    why = f"{newest} holds an earlier run: continue it with --resume --run-dir {newest}"
    return root / f"{name}-{held[-1] + 1}", why
