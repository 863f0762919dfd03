#!/usr/bin/env python3
"""Validation curves of several learning runs in one plot, and their evaluations as JSON lines
(benchmarks/learning/README.md).

    python benchmarks/learning/plot_learning.py --out docs/img/X.png --records R.jsonl \
        "LABEL=OUT/olmocore.jsonl" "LABEL=OUT/moetrain-run" "LABEL=RECORDS.jsonl#N" ...

A run is olmocore_learn.py's JSON lines or a moetrain run directory (metrics.jsonl, and
summary.json's initial_val_loss for step 0). --records writes one line per run: its label, its
evaluations {step: val_loss} and its last-100-step mean training loss.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compare_learning import read_jsonl


def curves(path: Path) -> tuple[dict[int, float], list[float]]:
    """(step → validation loss, the training losses in step order) of one run. PATH#N: line N of
    a --records file (its training losses: their last-100-step mean alone)."""
    if "#" in path.name:
        name, line = path.name.rsplit("#", 1)
        record = read_jsonl(path.with_name(name))[int(line)]
        return {int(s): v for s, v in record["val_loss"].items()}, [record["train_loss_last100"]]
    if path.is_dir():  # a moetrain run directory
        records = read_jsonl(path / "metrics.jsonl")
        val = {r["step"]: r["val_loss"] for r in records if r.get("val_loss") is not None}
        summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
        if summary.get("initial_val_loss") is not None:
            val[0] = summary["initial_val_loss"]
        return dict(sorted(val.items())), [r["lm_loss"] for r in records]
    rows = read_jsonl(path)
    val = {r["step"]: r["val_loss"] for r in rows if r.get("kind") == "eval"}
    return dict(sorted(val.items())), [r["lm_loss"] for r in rows if r.get("kind") == "train"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=PATH", help="the last = separates the path")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--records", default=None, help="also write each run's evaluations as JSON lines here")
    parser.add_argument("--title", default="validation loss on the same windows")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    lines = []
    for spec in args.runs:
        label, path = spec.rsplit("=", 1)  # a label may hold "=", a path does not
        val, train = curves(Path(path))
        ax.plot(list(val), list(val.values()), marker="o", label=label)
        tail = train[-100:]
        lines.append({"label": label, "val_loss": val, "train_loss_last100": sum(tail) / len(tail) if tail else None})
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats)")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.set_title(args.title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    if args.records:
        Path(args.records).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
