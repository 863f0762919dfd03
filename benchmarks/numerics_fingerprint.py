"""Bit-for-bit numerics fingerprint of short CPU training runs, for refactors that must not change
numerics (docs/measurements.md, "Numerics fingerprint").

Each case trains for `--steps` optimizer steps (fixed seed, fp32 on CPU, metrics every step) in a
fresh run directory, one process or several under torchrun (gloo), then prints one JSON line: the
per-step `lm_loss` and `grad_norm` exactly as metrics.jsonl holds them (Python floats, exact
repr), and a SHA-256 over every tensor of the final checkpoint (model weights, router biases,
AdamW moments), read back with torch's own DCP converter so that no moetrain code is involved in
the hashing.

    python benchmarks/numerics_fingerprint.py --out before.jsonl            # every case
    python benchmarks/numerics_fingerprint.py --cases tiny --compare before.jsonl

`--compare` exits 1 and names the first difference when a case's fingerprint differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "default"
SMALL = [
    "model.d_model=64",
    "model.n_layers=3",
    "model.moe.expert_hidden=32",
    "data.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
]

# name: (ranks, overrides)
CASES: dict[str, tuple[int, list[str]]] = {
    "tiny": (1, []),
    "small-accum-selective": (1, SMALL + ["train.recompute=selective"]),
    "small-sigmoid-bias-random": (
        1,
        SMALL
        + [
            "model.moe.gating=sigmoid",
            "model.moe.bias_update_rate=0.001",
            "model.moe.routing=random",
            "model.moe.shared_hidden=32",
        ],
    ),
    "small-docmask-full": (1, SMALL + ["data.document_masking=true", "train.recompute=full", "schedule.kind=wsd"]),
    "small-accum-deferred": (1, SMALL + ["train.defer_expert_weight_grad=true"]),
    "dp2-ep2-nosync": (2, SMALL + ["parallel.ep=2"]),
    "dp2-ep2-overlap2-selective": (
        2,
        SMALL + ["parallel.ep=2", "parallel.overlap_chunks=2", "train.recompute=selective"],
    ),
    "dp2-ep2-alltoall-sharded": (
        2,
        SMALL + ["parallel.ep=2", "parallel.dispatcher=alltoall", "parallel.shard_optimizer=true"],
    ),
    "dp2-fsdp": (2, SMALL + ["parallel.stack=fsdp"]),
    "pp2-1f1b": (2, SMALL + ["parallel.pp=2"]),
    "pp2-dp2-ep2-interleaved-sharded": (
        4,
        SMALL
        + [
            "parallel.pp=2",
            "parallel.ep=2",
            "parallel.shard_optimizer=true",
            "parallel.pp_schedule=interleaved-1f1b",
            "model.n_layers=4",
        ],
    ),
}


def run_case(name: str, steps: int, work: Path) -> dict:
    ranks, overrides = CASES[name]
    run_dir = work / name
    args = [
        "train",
        "tiny",
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--seed",
        "0",
        "--quiet",
        f"--data.sources=[{DATA}]",
        "--train.device=cpu",
        "--train.precision=fp32",
        "--train.log_every=1",
        "--train.eval_every=0",
        "--train.save_every=0",
        "--train.plot=false",
        "--train.tensorboard=false",
        *[f"--{o}" for o in overrides],
    ]
    if ranks == 1:
        cmd = [sys.executable, "-m", "moetrain", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={ranks}",
            "--standalone",
            "-m",
            "moetrain",
            *args,
        ]
    # The package of the tree this script belongs to, not whichever moetrain is installed: a base
    # commit is fingerprinted by running its own copy of the script.
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"case {name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    torch_file = work / f"{name}.pt"
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step-{steps}"), str(torch_file))
    state = torch.load(torch_file, weights_only=True)
    digest = hashlib.sha256()
    flat = _flatten(state)
    for key in sorted(flat):
        t = flat[key].contiguous()
        digest.update(key.encode())
        digest.update(t.numpy().tobytes() if t.ndim else t.reshape(1).numpy().tobytes())
    return {
        "case": name,
        "ranks": ranks,
        "steps": steps,
        "lm_loss": [r["lm_loss"] for r in records],
        "grad_norm": [r["grad_norm"] for r in records],
        "tensors": len(flat),
        "sha256": digest.hexdigest(),
        "torch": torch.__version__,
    }


def _flatten(state, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from: {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", help="write the JSON lines here too")
    parser.add_argument("--compare", help="a file of JSON lines from an earlier run: exit 1 on any difference")
    args = parser.parse_args()
    if not (DATA / "meta.json").is_file():
        raise SystemExit(f"{DATA} is missing: run `make data` first.")
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    before = {}
    if args.compare:
        before = {r["case"]: r for r in map(json.loads, Path(args.compare).read_text().splitlines())}
    lines, failed = [], False
    with tempfile.TemporaryDirectory(prefix="moetrain-fingerprint-") as tmp:
        for name in names:
            result = run_case(name, args.steps, Path(tmp))
            line = json.dumps(result)
            lines.append(line)
            print(line, flush=True)
            if name in before:
                old = before[name]
                differs = [key for key in ("lm_loss", "grad_norm", "sha256") if old[key] != result[key]]
                for key in differs:
                    print(f"DIFFERENT: {name}.{key}: before {old[key]!r} now {result[key]!r}", file=sys.stderr)
                failed = failed or bool(differs)
                if not differs:
                    print(f"same: {name} (loss, grad norm and every tensor bit for bit)", file=sys.stderr)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
