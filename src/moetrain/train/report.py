"""`python -m moetrain.train.report RUN_DIR`: where a finished run's outputs are, in words."""

from __future__ import annotations

import sys
from pathlib import Path

from moetrain.train.run_dir import read_summary


def report(run_dir: Path) -> str:
    s = read_summary(run_dir)
    if "steps" not in s:
        return f"{run_dir}: the run has not finished (summary.json holds no final summary)."
    lines = [
        f"run directory : {run_dir}",
        f"checkpoint    : {s.get('checkpoint')}",
        f"metrics       : {s.get('metrics')}",
        f"loss plot     : {s.get('plot') or run_dir / 'loss.png'}",
        f"tensorboard   : tensorboard --logdir {run_dir / 'tb'}",
    ]
    first, last = s.get("initial_val_loss"), s.get("final_val_loss")
    if first and last:
        lines.append(
            f"val loss      : {first:.3f} at step 0 -> {last:.3f} at step {s['steps']} ({last / first:.0%} of step 0)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
