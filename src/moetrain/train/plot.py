"""RUN_DIR/loss.png: training and validation loss, and throughput, against steps."""

from __future__ import annotations

import sys
from pathlib import Path

from moetrain.errors import install_hint, require
from moetrain.train.metrics import read_metrics
from moetrain.train.run_dir import read_summary

IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".webp", ".eps", ".tif", ".tiff")
"""What `plot_compare` writes in the format its name says (any other name gets a PNG)."""


def is_image_name(path: str | Path) -> bool:
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


def plot_run(run_dir: str | Path) -> Path | None:
    """Draw the run's metrics.jsonl; returns the PNG path (None, with a note on stderr, when
    matplotlib is missing: the run itself is not at fault)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed, so no loss.png; {install_hint('matplotlib')}", file=sys.stderr)
        return None
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        return None
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(steps, [r["loss"] for r in records], label="train loss")
    ax_loss.plot(steps, [r["lm_loss"] for r in records], label="train lm_loss", alpha=0.6)
    val = _val_points(run_dir, records)
    if val:
        ax_loss.plot(*zip(*val), "o-", label="val loss")
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title=run_dir.name)
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_tput.plot(steps, [r["tokens_per_sec"] for r in records])
    ax_tput.set(xlabel="step", ylabel="tokens/s (all devices)", ylim=(0, None))
    ax_tput.grid(alpha=0.3)
    fig.tight_layout()
    out = run_dir / "loss.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _val_points(run_dir: Path, records: list[dict]) -> list[tuple[int, float]]:
    """(step, validation loss) of a run: step 0's from summary.json (evaluated before training),
    then the logged ones."""
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    initial = read_summary(run_dir).get("initial_val_loss")
    return ([(0, initial)] if initial is not None else []) + val


def plot_compare(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Loss curves (train lm_loss and val loss) of several runs in one PNG (or the image format
    `out`'s suffix names), to compare layouts or settings. Needs matplotlib."""
    matplotlib = require("matplotlib", "moetrain plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run_dir in map(Path, run_dirs):
        records = read_metrics(run_dir / "metrics.jsonl")
        if not records:
            continue
        line = ax.plot(
            [r["step"] for r in records], [r["lm_loss"] for r in records], label=f"{run_dir.name} train", alpha=0.8
        )[0]
        val = _val_points(run_dir, records)
        if val:
            ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{run_dir.name} val")
    ax.set(xlabel="step", ylabel="loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, format=out.suffix[1:].lower() if is_image_name(out) else "png")
    plt.close(fig)
    return out
