"""`moetrain plan`'s output over a fixed set of presets and layouts, for refactors of the planner
that must not change a number (docs/measurements.md, "Refactor numerics check of the planner").

Each case is planned on H200s; the JSON holds every field `moetrain plan` prints (its JSON line),
the time by part and the per-pipeline-rank peaks and parameters, plus `suggest`'s layouts for
three presets. An error (a layout the checks refuse) is recorded as its message.

    python benchmarks/plan_fingerprint.py --out before.json
    python benchmarks/plan_fingerprint.py --compare before.json     # exit 1 on any difference
    python benchmarks/plan_fingerprint.py --compare before.json --added exposed_comm_s   # a new key

It plans with the moetrain it imports: for another tree's planner, `PYTHONPATH=TREE/src`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moetrain.errors import ConfigError
from moetrain.plan import plan, suggest, to_json
from moetrain.plan.report import Budget
from moetrain.presets import PRESETS, resolve_config

BUDGET = Budget(10**12)
"""The tokens every plan is timed on (its time-to-budget keys)."""

EXTRA = [
    ("sweep-8l-128", 8, ["parallel.ep=8", "parallel.shard_optimizer=true", "parallel.dispatcher=alltoall"]),
    ("sweep-8l-128", 8, ["parallel.ep=8", "parallel.shard_optimizer=true"]),
    ("bench-small32e", 2, ["train.global_batch_size=16", "train.micro_batch_size=2", "parallel.pp=2"]),
    (
        "bench-small32e",
        4,
        [
            "train.global_batch_size=16",
            "train.micro_batch_size=4",
            "parallel.pp=2",
            "parallel.pp_schedule=interleaved-1f1b",
        ],
    ),
    ("bench-tiny64e-l6", 2, ["train.global_batch_size=4", "train.micro_batch_size=4", "parallel.stack=fsdp"]),
    ("bench-8e", 1, ["precision.fp8=rowwise"]),
    ("bench-8e", 1, ["compute.recompute=selective", "compute.recompute_every=2"]),
    ("bench-8e", 1, ["precision.dtype=fp32"]),
    ("tiny", 1, []),
    ("tiny", 4, ["parallel.pp=2", "parallel.ep=2"]),
    (
        "ref-ultra-128e",
        512,
        ["parallel.ep=8", "parallel.pp=8", "parallel.shard_optimizer=true", "compute.recompute=full"],
    ),
    ("bench-8e", 1, ["parallel.capacity_factor=1.25"]),
    ("sweep-8l-32", 8, ["parallel.ep=8", "parallel.capacity_factor=1.25"]),
    ("bench-8e", 1, ["precision.fp8=mxfp8"]),
]


def cases() -> list[tuple[str, int, list[str]]]:
    out = []
    for name, make in PRESETS.items():
        out.append((name, 8, []))
        out.append((name, 8, ["parallel.ep=8"] if make().model.moe.num_experts % 8 == 0 else []))
    return out + EXTRA


def fingerprint() -> list[dict]:
    out = []
    for name, gpus, overrides in cases():
        batch = []
        if gpus > 1 and not any("batch" in o for o in overrides) and name != "ref-ultra-128e":
            batch = [f"train.global_batch_size={gpus * 4}", f"train.micro_batch_size={gpus}"]
        try:
            p = plan(resolve_config(name, overrides + batch), gpus, "h200")
        except ConfigError as e:
            out.append({"case": [name, gpus, overrides], "error": str(e)})
            continue
        record = to_json(p, name, gpus, "h200", [], BUDGET)
        record.update(time_s=p.time_s, peaks=p.peak_gib_per_pipeline_rank, params=p.params_per_pipeline_rank)
        out.append({"case": [name, gpus, overrides], "plan": record})
    for name in ("sweep-8l-128", "bench-8e", "ref-small-64e"):
        found = suggest(resolve_config(name), 8, "h200")
        out.append({"suggest": name, "plans": [to_json(s, name, 8, "h200", [], BUDGET) for s in found]})
    return out


def _without(entry: dict, keys: list[str]) -> dict:
    """`entry` with `keys` taken out of its plan (or its suggested plans); a plan without one of
    them fails: the key was meant to be added."""

    def strip(record: dict) -> dict:
        missing = [k for k in keys if k not in record]
        if missing:
            raise SystemExit(f"--added names {', '.join(missing)}, which {entry.get('case') or entry['suggest']} lacks")
        return {k: v for k, v in record.items() if k not in keys}

    if "plan" in entry:
        return {**entry, "plan": strip(entry["plan"])}
    if "plans" in entry:
        return {**entry, "plans": [strip(r) for r in entry["plans"]]}
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--compare")
    parser.add_argument(
        "--added",
        default="",
        metavar="KEY,…",
        help="with --compare: keys the tree under test adds to each plan, left out of the comparison "
        "(every plan must have them)",
    )
    args = parser.parse_args()
    result = fingerprint()
    text = json.dumps(result, indent=0, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text)
    print(f"{len(result)} plans")
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        added = [k for k in args.added.split(",") if k]
        if added:
            result = [_without(entry, added) for entry in result]
        differ = [a.get("case") or a.get("suggest") for a, b in zip(result, before) if a != b]
        if differ or len(result) != len(before):
            print(f"DIFFERENT: {differ or 'the number of plans'}", file=sys.stderr)
            return 1
        print(
            "same: every plan field for field" + (f" but the added {', '.join(added)}" if added else ""),
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
