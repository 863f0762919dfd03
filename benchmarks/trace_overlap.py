"""How much of a profiled step's communication is hidden behind compute, from a torch.profiler
chrome trace (the `trace.json` that `--train.profile=true` writes, one per rank).

Per step (the window's totals divided by --steps), in ms of device time:
  span     first kernel start to last kernel end;
  compute  union of the non-NCCL kernels' intervals (any stream);
  nccl     union of the NCCL kernels' intervals, and per collective kind;
  exposed  NCCL time during which no compute kernel runs: what overlap failed to hide;
  idle     span − union of all kernels: the GPU waits for the host (launches, syncs).

Usage: python benchmarks/trace_overlap.py TRACE.json [--steps 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """a − b, both sorted disjoint unions."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def collective_kind(name: str) -> str:
    m = re.search(r"(AllReduce|AllGather|ReduceScatter|SendRecv|AllToAll|Broadcast|Reduce|Send|Recv)", name)
    return m.group(1) if m else "other"


def analyse(trace_path: Path, steps: int) -> dict:
    try:
        trace = json.loads(trace_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"cannot read the chrome trace {trace_path}: {e}")
    kernels = [ev for ev in trace.get("traceEvents", []) if ev.get("cat") == "kernel" and "dur" in ev]
    if not kernels:
        sys.exit(f"{trace_path} holds no GPU kernels: profile a CUDA run (--train.profile=true --device cuda).")
    is_nccl = [ev["name"].lower().startswith("nccl") for ev in kernels]
    iv = [(float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])) for ev in kernels]
    compute = union([t for t, n in zip(iv, is_nccl) if not n])
    nccl = union([t for t, n in zip(iv, is_nccl) if n])
    everything = union(iv)
    span = everything[-1][1] - everything[0][0]
    exposed = minus(nccl, compute)
    per_kind: dict[str, dict[str, float]] = {}
    for ev, t, n in zip(kernels, iv, is_nccl):
        if n:
            k = per_kind.setdefault(collective_kind(ev["name"]), {"kernels": 0, "busy": []})
            k["kernels"] += 1
            k["busy"].append(t)
    ms = 1e-3 / steps  # trace times are in µs
    kinds = {}
    for k, v in sorted(per_kind.items()):
        u = union(v["busy"])
        kinds[k] = {
            "kernels_per_step": v["kernels"] / steps,
            "ms": round(length(u) * ms, 2),
            "exposed_ms": round(length(minus(u, compute)) * ms, 2),
        }
    return {
        "trace": str(trace_path),
        "steps": steps,
        "span_ms": round(span * ms, 2),
        "compute_ms": round(length(compute) * ms, 2),
        "nccl_ms": round(length(nccl) * ms, 2),
        "exposed_nccl_ms": round(length(exposed) * ms, 2),
        "idle_ms": round((span - length(everything)) * ms, 2),
        "collectives": kinds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=2, help="training steps in the profiled window")
    ap.add_argument("--json", action="store_true", help="one JSON line per trace instead of a table")
    args = ap.parse_args()
    for path in args.traces:
        r = analyse(path, args.steps)
        if args.json:
            print(json.dumps(r))
            continue
        print(
            f"{path}: per step span {r['span_ms']} ms = compute {r['compute_ms']} + exposed NCCL "
            f"{r['exposed_nccl_ms']} + idle {r['idle_ms']} (NCCL busy {r['nccl_ms']} ms)"
        )
        for k, v in r["collectives"].items():
            print(
                f"  {k:14} {v['kernels_per_step']:6.1f} kernels/step  busy {v['ms']:8.2f} ms  "
                f"exposed {v['exposed_ms']:8.2f} ms"
            )


if __name__ == "__main__":
    main()
