"""AdamW against Muon on real text, each at its tuned learning rate: train PRESET once per
(optimizer, lr), pick each optimizer's lr by its final validation loss, and plot the two best
runs' curves side by side.

    python benchmarks/optimizer_sweep.py tiny --out runs/sweep-tiny \\
        --adamw 1e-3 3e-3 6e-3 --muon 3e-3 6e-3 1.2e-2 [--steps 300] [--jobs 1] [-- --train.device=cpu …]

Each run is `moetrain train PRESET --run-dir OUT/OPT-LR --optim.name=OPT --optim.lr=LR` plus the
overrides after `--` (its own directory: an interrupted sweep re-runs only the runs without a
summary.json). `--jobs N` runs N at once (on one GPU: small models side by side; the losses do
not depend on it, the seconds do). Prints one JSON line per run (optimizer, lr, final validation and training loss,
seconds) and a last line with each optimizer's best; writes OUT/curves.png (moetrain.train.plot's
`plot_compare`: training and validation loss by step) and OUT/sweep.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

from moetrain.train.metrics import read_metrics
from moetrain.train.plot import plot_compare


def run(preset: str, out: Path, name: str, lr: float, steps: int, extra: list[str]) -> dict:
    run_dir = out / f"{name}-{lr:g}"
    start = time.time()
    if not (run_dir / "summary.json").exists():
        cmd = [sys.executable, "-m", "moetrain", "train", preset, "--run-dir", str(run_dir), "--steps", str(steps)]
        cmd += [f"--optim.name={name}", f"--optim.lr={lr}", "--train.plot=false", "--quiet", *extra]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{name} at lr {lr:g} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = read_metrics(run_dir / "metrics.jsonl")
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return {
        "optimizer": name,
        "lr": lr,
        "run_dir": str(run_dir),
        "final_val_loss": val[-1] if val else None,
        "final_train_loss": records[-1]["lm_loss"],
        "steps": records[-1]["step"],
        "seconds": round(time.time() - start, 1),
    }


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--adamw", type=float, nargs="+", required=True, help="AdamW's learning rates")
    parser.add_argument("--muon", type=float, nargs="+", required=True, help="Muon's learning rates")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [(name, lr) for name, lrs in (("adamw", args.adamw), ("muon", args.muon)) for lr in lrs]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = [pool.submit(run, args.preset, out, name, lr, args.steps, extra) for name, lr in todo]
        for future in concurrent.futures.as_completed(futures):
            print(json.dumps(future.result()), flush=True)
    results = [f.result() for f in futures]
    best = {}
    for name in ("adamw", "muon"):
        mine = [r for r in results if r["optimizer"] == name and r["final_val_loss"] is not None]
        best[name] = min(mine, key=lambda r: r["final_val_loss"])
        lrs = sorted(r["lr"] for r in mine)
        best[name]["lr_at_edge_of_sweep"] = best[name]["lr"] in (lrs[0], lrs[-1])
    plot = plot_compare([best["adamw"]["run_dir"], best["muon"]["run_dir"]], out / "curves.png")
    summary = {"preset": args.preset, "steps": args.steps, "best": best, "plot": str(plot), "extra": extra}
    (out / "sweep.json").write_text(json.dumps({"runs": results, **summary}, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
