"""Upcycling against training the MoE from scratch, on the CPU and the embedded corpus: a dense
`tiny` (every block a SwiGLU of the experts' hidden size) trained STEPS steps, upcycled
(`moetrain upcycle`) and trained STEPS more; the upcycled config trained 2 × STEPS steps from
scratch. The validation curves by training step (the upcycled run's steps counted on from the
dense run's) go to OUT/upcycle.png, the evaluations to OUT/curves.json.

    python benchmarks/upcycle_curve.py --out runs/upcycle --steps 300 --data data/default

The continuation trains with seed 1 (its batches in another order than the dense run's: its
first STEPS steps do not see the dense run's batches again in the same order).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def moetrain(*argv: str) -> None:
    print("moetrain", " ".join(argv), file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "moetrain", *argv], check=True)


def evaluations(run_dir: Path, offset: int = 0) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"] + offset, r["val_loss"]) for r in rows if r.get("val_loss") is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--data", default="data/default")
    args = ap.parse_args()
    out, steps = args.out, args.steps
    common = ["--train.device=cpu", f"--data.sources=[{args.data}]", "--train.eval_every=50", "--quiet"]
    common += ["--logging.plot=false", "--checkpoint.keep_last=1"]
    moetrain("train", "tiny", "--model.num_dense_layers=4", "--model.dense_hidden=128", f"--train.steps={steps}",
             f"--run-dir={out / 'dense'}", *common)  # fmt: skip
    moetrain("upcycle", str(out / "dense"), str(out / "moe-step0"), "--model.num_dense_layers=1")
    config = str(out / "moe-step0" / "config.yaml")
    moetrain("train", config, f"--checkpoint.init_from={out / 'moe-step0'}", f"--train.steps={steps}",
             "--train.seed=1", f"--run-dir={out / 'upcycled'}", *common)  # fmt: skip
    moetrain("train", config, f"--train.steps={2 * steps}", f"--run-dir={out / 'scratch'}", *common)
    curves = {
        "dense": evaluations(out / "dense"),
        "upcycled": evaluations(out / "upcycled", offset=steps),
        "MoE from scratch": evaluations(out / "scratch"),
    }
    (out / "curves.json").write_text(json.dumps(curves, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in curves.items():
        ax.plot(*zip(*points), marker="o", markersize=3, label=name)
    ax.axvline(steps, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("training step (the upcycled run's counted on from the dense run's)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"tiny on the CPU: dense {steps} steps, upcycled, {steps} more; MoE from scratch {2 * steps}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "upcycle.png", dpi=120)
    print(json.dumps({name: points[-1] for name, points in curves.items()}))


if __name__ == "__main__":
    main()
