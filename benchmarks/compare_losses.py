"""Compare the per-step training losses of runs against a reference run.

Usage: python benchmarks/compare_losses.py REF_RUN_DIR RUN_DIR... [--rtol 0.02]
Prints one JSON line per run: steps compared, max |Δ lm_loss| and max relative Δ against the
reference, and `within_tol`. Exits 1 if any run is outside the tolerance (or has other steps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moetrain.train.metrics import read_metrics


def losses(run_dir: str) -> dict[int, float]:
    return {r["step"]: r["lm_loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--rtol", type=float, default=0.02, help="largest allowed relative loss difference")
    args = parser.parse_args()
    ref = losses(args.reference)
    ok = True
    for run in args.runs:
        got = losses(run)
        common = sorted(set(ref) & set(got))
        if not common or set(got) != set(ref):
            print(
                json.dumps({"run": run, "error": f"steps differ: reference {sorted(ref)[:3]}…, run {sorted(got)[:3]}…"})
            )
            ok = False
            continue
        abs_d = [abs(got[s] - ref[s]) for s in common]
        rel_d = [d / abs(ref[s]) for d, s in zip(abs_d, common)]
        within = max(rel_d) <= args.rtol
        ok &= within
        print(
            json.dumps(
                {
                    "run": Path(run).name,
                    "reference": Path(args.reference).name,
                    "steps": len(common),
                    "first_loss": got[common[0]],
                    "last_loss": got[common[-1]],
                    "ref_last_loss": ref[common[-1]],
                    "max_abs_diff": max(abs_d),
                    "max_rel_diff": max(rel_d),
                    "rtol": args.rtol,
                    "within_tol": within,
                }
            ),
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
