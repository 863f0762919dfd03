"""Weights & Biases as an optional metrics sink: logging.wandb=true (`pip install 'moetrain[wandb]'`).

Rank 0's `WandbSink` logs every numeric scalar of each metrics.jsonl record at the record's step,
with the resolved run configuration as the W&B run config. The W&B run id is kept in
RUN_DIR/wandb_id.txt, so a run continued with --resume continues the same W&B run (the steps it
logs again keep their first values: W&B ignores a step below one it has seen).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from moetrain.errors import ConfigError, install_hint
from moetrain.train.metrics import MetricsSink, scalars

ID_FILE = "wandb_id.txt"


def require_wandb() -> None:
    """Raise ConfigError when logging.wandb=true cannot be honoured: wandb is not importable."""
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"logging.wandb=true but the wandb package cannot be imported ({e}). Install the optional "
            f"extra with {install_hint('wandb')}, or set logging.wandb=false."
        ) from None


def run_id(run_dir: Path, resumed: bool) -> str:
    """The W&B run id of this run directory: the stored one when resuming, a new one otherwise."""
    path = run_dir / ID_FILE
    if resumed and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    new = secrets.token_hex(4)  # W&B ids: short, lowercase, alphanumeric
    path.write_text(new + "\n")
    return new


class WandbSink(MetricsSink):
    """One W&B run that receives the logged records' `scalars`; `close` finishes it."""

    def __init__(self, run_dir: Path, config: dict[str, Any], *, project: str, name: str | None, resumed: bool):
        import wandb

        try:
            self.run = wandb.init(
                project=project,
                name=name or run_dir.resolve().name,
                id=run_id(run_dir, resumed),
                resume="allow" if resumed else None,
                config=config,
                dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
            )
        except wandb.errors.Error as e:
            raise ConfigError(
                f"logging.wandb=true but W&B could not start a run ({e}). Log in (wandb login, or set "
                "WANDB_API_KEY), log offline with WANDB_MODE=offline, or set logging.wandb=false."
            ) from None

    def write(self, record: dict[str, Any], window: tuple[float, int]) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
