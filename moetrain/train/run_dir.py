"""`RunDir`: what a run keeps on disk, and the rules for starting, resuming and finishing it.

    RUN_DIR/config.yaml       the resolved config (rank 0, at start)
    RUN_DIR/tokenizer.json    the data's tokenizer, for eval / generate / export
    RUN_DIR/metrics.jsonl     one record per logged step (moetrain/train/metrics.py)
    RUN_DIR/summary.json      the run's summary, rewritten at the end of every `fit`
    RUN_DIR/checkpoints/      step-N checkpoints (moetrain/train/checkpoint.py)

Only rank 0 writes here, except checkpoints (every rank writes its shards).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from moetrain.errors import ConfigError
from moetrain.train import checkpoint as ckpt
from moetrain.train.metrics import read_metrics

STALE_RECORDS = ("metrics.jsonl", "summary.json", "wandb_id.txt")
"""What a fresh start removes: records of an earlier run in the same directory."""


class RunDir:
    def __init__(self, path: str | Path, main: bool):
        self.path = Path(path)
        self.main = main
        """Rank 0: the one rank that writes records."""
        if main:
            _ensure_writable(self.path)

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        return ckpt.list_checkpoints(self.path)

    def last_checkpoint(self) -> str | None:
        found = self.checkpoints()
        return str(found[-1][1]) if found else None

    def partial_checkpoints(self) -> list[Path]:
        """Checkpoints interrupted while being written (never loaded)."""
        return sorted(ckpt.checkpoints_dir(self.path).glob(".step-*.tmp"))

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


def _ensure_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"Run directory '{run_dir}' is not writable ({e.strerror}): pass --run-dir to a directory you can write."
        ) from None
