"""Generation with and without the KV cache on CPU: the same greedy tokens, timed
(docs/benchmarks.md, "On the CPU").

Without --checkpoint, trains `tiny` for a few steps at --seq-len into a temporary run directory
(on data/default: `make data`), so that the prompt and every new token fit its context: past the
context the cache is restarted at every step and helps no more (src/moetrain/generation.py). Loads
the checkpoint through the Python API, then times `generate_ids` greedily (no stop at
end-of-text: every run makes exactly --new-tokens tokens), alternating with and without the cache,
and prints one JSON line: the median seconds of each, tokens/s, the speed-up and whether the
tokens were the same.

    python benchmarks/generate_speed.py
    python benchmarks/generate_speed.py --checkpoint runs/tiny --new-tokens 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import moetrain
from moetrain.generation import generate_ids

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "default"
PROMPT = "ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


def train_tiny(run_dir: Path, seq_len: int, steps: int) -> None:
    cmd = [
        sys.executable,
        "-m",
        "moetrain",
        "train",
        "tiny",
        f"--run-dir={run_dir}",
        f"--steps={steps}",
        "--quiet",
        f"--data.sources=[{DATA}]",
        f"--data.seq_len={seq_len}",
        "--train.global_batch_size=4",
        "--train.micro_batch_size=4",
        "--train.device=cpu",
        "--train.precision=fp32",
        "--train.eval_every=0",
        f"--train.save_every={steps}",
        "--train.plot=false",
        "--train.tensorboard=false",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training failed ({done.returncode}):\n{done.stderr[-3000:]}")


def timed(lm, prompt_ids: list[int], new_tokens: int, kv_cache: bool) -> tuple[float, list[int]]:
    start = time.perf_counter()
    ids = generate_ids(lm.model, prompt_ids, new_tokens, max_context=lm.max_context, kv_cache=kv_cache)
    return time.perf_counter() - start, ids


def measure(checkpoint: Path, new_tokens: int, repeats: int) -> dict:
    lm = moetrain.load(checkpoint)
    prompt_ids = lm.encode(PROMPT)
    if len(prompt_ids) + new_tokens > lm.max_context:
        print(
            f"note: {len(prompt_ids)} + {new_tokens} tokens pass the context of {lm.max_context}: "
            "past it the cache helps no more",
            file=sys.stderr,
        )
    timed(lm, prompt_ids, 8, True), timed(lm, prompt_ids, 8, False)  # warm-up
    seconds: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    for _ in range(repeats):
        for kv_cache in (True, False):
            s, tokens[kv_cache] = timed(lm, prompt_ids, new_tokens, kv_cache)
            seconds[kv_cache].append(s)
    cached, recomputed = statistics.median(seconds[True]), statistics.median(seconds[False])
    return {
        "checkpoint": str(lm.checkpoint),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": new_tokens,
        "max_context": lm.max_context,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kv_cache_s": round(cached, 4),
        "no_cache_s": round(recomputed, 4),
        "kv_cache_tokens_per_s": round(new_tokens / cached, 1),
        "no_cache_tokens_per_s": round(new_tokens / recomputed, 1),
        "speedup": round(recomputed / cached, 2),
        "same_tokens": tokens[True] == tokens[False],
        "kv_cache_runs_s": [round(s, 4) for s in seconds[True]],
        "no_cache_runs_s": [round(s, 4) for s in seconds[False]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a run or step-N directory (default: train tiny in a temporary one)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each; the median is reported")
    parser.add_argument("--seq-len", type=int, default=512, help="without --checkpoint: the context trained")
    parser.add_argument("--steps", type=int, default=5, help="without --checkpoint: the steps trained")
    args = parser.parse_args()
    if args.checkpoint:
        print(json.dumps(measure(Path(args.checkpoint), args.new_tokens, args.repeats)))
        return 0
    if not (DATA / "meta.json").is_file():
        raise SystemExit(f"{DATA} is missing: run `make data` first, or pass --checkpoint.")
    with tempfile.TemporaryDirectory(prefix="moetrain-generate-speed-") as tmp:
        train_tiny(Path(tmp) / "run", args.seq_len, args.steps)
        print(json.dumps(measure(Path(tmp) / "run", args.new_tokens, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
