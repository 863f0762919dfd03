"""Whether `make train`'s intra-op threads oversubscribe a busy CPU (issue 57, item 9).

Trains `tiny` for --steps steps with torch's default intra-op threads and with one thread, each
alone and each beside a competitor: a process that keeps one core busy (a Python loop), or as
many torch threads busy as the machine has cores (a matmul loop). Prints the training
tokens/s (the mean of metrics.jsonl's `tokens_per_sec` over the steps after the first
--skip) of each pairing, one JSON line per run.

    OMP_NUM_THREADS= python benchmarks/probes/threads_probe.py --steps 40 --data data/default
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMPETITORS = {
    "alone": None,
    "one busy core": "while True: pass",
    "a torch matmul on every core": (
        "import torch\na = torch.randn(512, 512)\nwhile True: a @ a"  # torch's default threads: one per core
    ),
}


def train(threads: int | None, steps: int, data: str, skip: int) -> float:
    """Training tokens/s of `moetrain train tiny` with `threads` intra-op threads (None: torch's
    default)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" or v}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as run:
        subprocess.run(
            [sys.executable, "-m", "moetrain", "train", "tiny", "--steps", str(steps), "--device", "cpu",
             "--eval-every", "0", "--run-dir", run, f"--data.sources=[{data}]", "--train.log_every=1",
             "--train.save_final=false", "--train.plot=false", "--train.tensorboard=false", "--quiet"],
            env=env, check=True, capture_output=True,
        )  # fmt: skip
        records = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_sec"] for r in records if r["step"] > skip]
    return sum(rates) / len(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=10, help="steps left out of the mean (start-up)")
    ap.add_argument("--data", default="data/default")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    for name, code in COMPETITORS.items():
        for threads in (None, 1):
            quiet = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}  # torch's defaults
            competitor = subprocess.Popen([sys.executable, "-c", code], env=quiet) if code else None
            try:
                time.sleep(2 if code else 0)  # the competitor at full speed first
                rate = train(threads, args.steps, args.data, args.skip)
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()
            label = f"default ({cores} cores)" if threads is None else "1"
            print(json.dumps({"beside": name, "threads": label, "tokens_per_sec": round(rate)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
