"""`RunDir`: what a run keeps on disk, and the rules for starting, resuming and finishing it;
where its checkpoints are, which of them count, and how many are kept.

    RUN_DIR/config.yaml       the resolved config (rank 0, at start)
    RUN_DIR/tokenizer.json    the data's tokenizer, for eval / generate / export
    RUN_DIR/metrics.jsonl     one record per logged step (src/moetrain/train/metrics.py)
    RUN_DIR/summary.json      step 0's validation loss once evaluated; the run's summary at the end of every `fit`
    RUN_DIR/checkpoints/      step-N checkpoints (their contents: src/moetrain/train/checkpoint_io.py)
    RUN_DIR/run.lock          held by the live run's rank 0 (src/moetrain/train/run_lock.py)

Only rank 0 writes here, except checkpoints (every rank writes its shards). Rank 0 takes the
directory (`RunDir(...)`) before anything reads or changes it; a run refused later in start-up
gives it back (`abandon`), leaving no empty directory behind. A checkpoint step-N counts once it
holds COMPLETE, written last before .step-N.tmp is renamed (`publish`).
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
from moetrain.errors import CheckpointError, ConfigError, file_kind
from moetrain.train import run_lock
from moetrain.train.checkpoint_index import diagnose
from moetrain.train.metrics import read_metrics

STALE_RECORDS = ("metrics.jsonl", "summary.json", "wandb_id.txt")
"""What a fresh start removes: records of an earlier run in the same directory."""


FIX = "Pass --run-dir a directory you can write"


class RunDir:
    def __init__(self, path: str | Path, main: bool, checkpoint_bytes: int = 0, checkpoint_detail: str = ""):
        """Check (rank 0) that the run can write at `path` and that a checkpoint of
        `checkpoint_bytes` fits (`checkpoint_detail`: why that many), then take the directory."""
        self.path = Path(path)
        self.metrics_file = self.path / "metrics.jsonl"
        self.config_file = self.path / "config.yaml"
        self.main = main
        """Rank 0: the one rank that writes records."""
        self._made: list[Path] = []
        """What taking the directory created (its missing parents, itself, run.lock), outermost first."""
        self._release: weakref.finalize | None = None
        """Gives this object's hold on the lock back, once: at `release`, or when it is collected."""
        if main:
            check_directory(self.path, "Run directory", FIX)
            # A run would write its records over a checkpoint's, or among a run's checkpoints.
            step = (self.path / COMPLETE).is_file()
            if step or (self.path.name == "checkpoints" and list_checkpoints(self.path.parent)):
                what, run, weights = (
                    ("a checkpoint", self.path.parent.parent, self.path)
                    if step
                    else ("a run's checkpoints directory", self.path.parent, self.path.parent)
                )
                raise ConfigError(
                    f"Run directory '{self.path}' is {what}, not a run: continue its run with --resume --run-dir "
                    f"{run}, or start a new one from its weights with --checkpoint.init_from={weights} --run-dir NEW."
                )
            if (self.path / "config.json").is_file() and not self.config_file.is_file():  # over its tokenizer.json
                raise ConfigError(
                    f"Run directory '{self.path}' is a Hugging Face model, not a run: train from it with `moetrain "
                    f"import-hf {self.path} OUT_DIR`, then --checkpoint.init_from=OUT_DIR --run-dir NEW."
                )
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
        lock = self.path / run_lock.LOCK_FILE
        self._made = [p for p in (*reversed(self.path.parents), self.path, lock) if not p.exists()]
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
        """Give the directory back after a refusal at start-up, removing what taking it created."""
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

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        return list_checkpoints(self.path)

    def last_checkpoint(self, at_most: int | None = None) -> str | None:
        """The newest complete checkpoint (of a step ≤ `at_most`, if given), or None."""
        found = [(step, path) for step, path in self.checkpoints() if at_most is None or step <= at_most]
        return str(found[-1][1]) if found else None

    def partial_checkpoints(self) -> list[Path]:
        """Checkpoints interrupted while being written (never loaded)."""
        return sorted(checkpoints_dir(self.path).glob(".step-*.tmp"))

    def move_aside(self, checkpoint: Path) -> Path | None:
        """Rename a damaged checkpoint step-N to step-N.damaged (rank 0), out of `--resume`'s and
        retention's sight; the new path, or None (other ranks, or moved already)."""
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
        """After resuming from step `step`: the records past it go (they will be logged again)."""
        if self.main:
            kept = [r for r in read_metrics(self.metrics_file) if r["step"] <= step]
            self.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write_config(self, config_yaml: str, tokenizer_file: Path | None) -> None:
        if self.main:
            self.config_file.write_text(config_yaml)
            if tokenizer_file is not None and tokenizer_file.is_file():
                shutil.copyfile(tokenizer_file, self.path / "tokenizer.json")

    def read_summary(self) -> dict[str, Any]:
        return read_summary(self.path)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """summary.json, whole or not at all (a temporary file renamed into place)."""
        if self.main:
            tmp = self.path / ".summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=1))
            os.replace(tmp, self.path / "summary.json")


def read_summary(run_dir: Path) -> dict[str, Any]:
    """RUN_DIR/summary.json; {} where there is none or it is not a JSON object (damaged)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text(errors="replace"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", run_lock.LOCK_FILE)
"""What makes a directory hold a run (`default_run_dir`): each appears when a run starts or logs."""


def default_run_dir(name: str, resume: bool, root: str | Path = "runs") -> tuple[Path, str]:
    """train.run_dir when it is not set, and why: of root/NAME, root/NAME-2, …, a fresh run takes
    the one after the newest that holds a run (an earlier run is never written into); with
    `resume`, that newest (root/NAME when none does)."""
    root = Path(root)
    pattern = re.compile(rf"{re.escape(name)}-(\d+)")
    numbered = {1: root / name}
    if root.is_dir():
        for path in root.iterdir():
            match = pattern.fullmatch(path.name)
            if match and int(match.group(1)) >= 2:
                numbered[int(match.group(1))] = path
    held = sorted(n for n, path in numbered.items() if any((path / f).exists() for f in RUN_FILES))
    if not held:
        return root / name, f"named after {name}"
    newest = numbered[held[-1]]
    if resume:
        return newest, f"the newest run of {name}"
    why = f"{newest} holds an earlier run: continue it with --resume --run-dir {newest}"
    if not (newest / "metrics.jsonl").exists():  # a weights-only checkpoint (import-hf, upcycle): no run to resume
        why = f"{newest} is taken ({', '.join(f for f in RUN_FILES if (newest / f).exists())})"
    return root / f"{name}-{held[-1] + 1}", why


# ---- checkpoints ------------------------------------------------------------------------------
COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    steps = ((STEP_DIR.match(child.name), child) for child in root.iterdir())
    return sorted((int(m.group(1)), child) for m, child in steps if m and (child / COMPLETE).is_file())


def resolve_checkpoint(path: str | Path) -> Path:
    """A step-N directory, or a run directory (-> its newest complete checkpoint), checked intact."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"Checkpoint path '{path}' does not exist: pass a run directory or its checkpoints/step-N."
        )
    if not path.is_dir():
        raise CheckpointError(
            f"Checkpoint path '{path}' is {'a file' if path.is_file() else file_kind(path)}: pass a run directory or "
            "its checkpoints/step-N (Hugging Face weights: their directory, made a checkpoint by `moetrain import-hf`)."
        )
    if (path / COMPLETE).is_file():
        found = path
    elif STEP_DIR.match(path.name):
        raise CheckpointError(
            f"'{path}' is an incomplete checkpoint (no {COMPLETE} marker: the run was interrupted "
            "while writing it). Use an earlier step or the run directory."
        )
    else:
        complete = list_checkpoints(path)
        if not complete:
            fix = "Train with --save-every N, or point at a step-N directory."
            if (path / "config.json").is_file():
                fix = f"It is a Hugging Face model: make it a checkpoint with `moetrain import-hf {path} OUT_DIR`."
            elif path.name == "checkpoints" and list_checkpoints(path.parent):
                fix = f"Pass the run directory, {path.parent}, or one of its step-N."
            raise CheckpointError(
                f"'{path}' holds no complete checkpoint (looked for {checkpoints_dir(path)}/step-N/{COMPLETE}). {fix}"
            )
        found = complete[-1][1]
    check_intact(found)
    return found


def check_intact(path: Path, damage: str | None = None) -> None:
    """Refuse a damaged checkpoint (`damage`, else what `diagnose` finds), naming the damage and
    the newest intact checkpoint before it."""
    damage = damage or diagnose(path)
    if damage is None:
        return
    m = STEP_DIR.match(path.name)
    earlier = [p for s, p in list_checkpoints(path.parent.parent) if m and s < int(m.group(1))]
    intact = next((p for p in reversed(earlier) if diagnose(p) is None), None)
    instead = (
        f"the newest intact checkpoint before it is {intact}: pass that one"
        if intact
        else "no intact checkpoint precedes it"
    )
    raise CheckpointError(  # from None: load_checkpoint calls it handling DCP's error, which the damage explains
        f"Checkpoint '{path}' is damaged: {damage}. {instead[0].upper()}{instead[1:]} (`moetrain train … --resume` "
        "falls back to it by itself), or restore the files from a copy."
    ) from None


def estimated_bytes(num_params: int, optimizer_bytes_per_param: int = 0) -> int:
    """About what a checkpoint of `num_params` parameters takes on disk: fp32 weights and the
    optimizer's bytes per parameter, plus 1% and 1 MiB for DCP's headers and the small files."""
    return int(num_params * (4 + optimizer_bytes_per_param) * 1.01) + (1 << 20)


def publish(tmp: Path, final: Path, keep_last: int = 0) -> None:
    """Rename the complete checkpoint `tmp` to `final`, its step-N (a re-save of that step is
    replaced), synced to disk; then, with `keep_last` > 0, keep the run's newest `keep_last`."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if keep_last > 0:
        for _, old in list_checkpoints(final.parent.parent)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    """Sync a directory's entries (a file created or renamed in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_weights_destination(out: Path, params: int, what: str) -> None:
    """Refuse `out` for a new weights-only checkpoint (`what`) of `params` parameters: not
    writable, holding checkpoints already, or without room."""
    check_directory(out, "Output directory", "Pass an OUT_DIR you can write")
    if list_checkpoints(out):
        raise ConfigError(f"'{out}' already holds checkpoints: choose an empty directory for {what}.")
    check_free_space(
        out,
        estimated_bytes(params),
        "Output directory",
        f"{what} ({params / 1e6:,.1f}M parameters × 4 bytes, fp32)",
        "Free space or pass an OUT_DIR on another filesystem",
    )
