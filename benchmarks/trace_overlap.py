"""How much of a profiled step's communication is hidden behind compute, from a torch.profiler
chrome trace (the `trace.json` that `--train.profile=true` writes, one per rank).

Per step (the window's totals divided by --steps), in ms of device time:
  span     first kernel start to last kernel end;
  compute  union of the non-NCCL kernels' intervals (any stream);
  nccl     union of the NCCL kernels' intervals, and per collective kind;
  exposed  NCCL time during which no compute kernel runs: what overlap failed to hide;
  idle     span − union of all kernels: the GPU waits for the host (launches, syncs).

With --gaps N, where the idle time is: each gap between kernels is charged to the host operator
that launched the kernel ending it (the innermost CPU op around the runtime or driver call that
the kernel's correlation id names; "?" where the trace has no such call), and the N operators
with the most idle time before their kernels are listed, with their gaps per step.

Usage: python benchmarks/trace_overlap.py TRACE.json [--steps 2] [--json] [--gaps 10]
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


def _launching_ops(events: list[dict]) -> dict[int, str]:
    """Correlation id → the innermost CPU operator around the runtime call that launched it: one
    sweep per host thread over its operators (nested intervals) and its runtime calls."""
    by_thread: dict[object, list[tuple]] = {}
    for ev in events:
        cat, ts = ev.get("cat"), ev.get("ts")
        if cat in ("cpu_op", "user_annotation", "python_function") and "dur" in ev:
            end = float(ts) + float(ev["dur"])
            by_thread.setdefault(ev.get("tid"), []).append((float(ts), 0, -end, ev["name"]))
        elif cat in ("cuda_runtime", "cuda_driver") and ev.get("args", {}).get("correlation") is not None:
            by_thread.setdefault(ev.get("tid"), []).append((float(ts), 1, 0.0, ev["args"]["correlation"]))
    out: dict[int, str] = {}
    for items in by_thread.values():
        open_ops: list[tuple[float, str]] = []  # (end, name), innermost last
        for ts, kind, neg_end, what in sorted(items):  # at one instant: operators (outer first), then calls
            while open_ops and open_ops[-1][0] < ts:
                open_ops.pop()
            if kind == 0:
                open_ops.append((-neg_end, what))
            elif open_ops:
                out[what] = open_ops[-1][1]
    return out


def idle_gaps(kernels: list[dict], events: list[dict], steps: int, top: int) -> list[dict]:
    """The host operators whose kernels the GPU waited for the longest (module docstring)."""
    launcher = _launching_ops(events)
    order = sorted(kernels, key=lambda ev: float(ev["ts"]))
    busy_until = float(order[0]["ts"]) + float(order[0]["dur"])
    charged: dict[str, list[float]] = {}
    for ev in order[1:]:
        start = float(ev["ts"])
        if start > busy_until:
            op = launcher.get(ev.get("args", {}).get("correlation"), "?")
            charged.setdefault(op, []).append(start - busy_until)
        busy_until = max(busy_until, start + float(ev["dur"]))
    ms = 1e-3 / steps
    ranked = sorted(charged.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"op": op, "gaps_per_step": len(g) / steps, "idle_ms": round(sum(g) * ms, 3)} for op, g in ranked]


def analyse(trace_path: Path, steps: int, gaps: int = 0) -> dict:
    try:
        trace = json.loads(trace_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"cannot read the chrome trace {trace_path}: {e}")
    events = trace.get("traceEvents", [])
    kernels = [ev for ev in events if ev.get("cat") == "kernel" and "dur" in ev]
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
    out = {
        "trace": str(trace_path),
        "steps": steps,
        "span_ms": round(span * ms, 2),
        "compute_ms": round(length(compute) * ms, 2),
        "nccl_ms": round(length(nccl) * ms, 2),
        "exposed_nccl_ms": round(length(exposed) * ms, 2),
        "idle_ms": round((span - length(everything)) * ms, 2),
        "collectives": kinds,
    }
    if gaps:
        out["idle_before"] = idle_gaps(kernels, events, steps, gaps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=2, help="training steps in the profiled window")
    ap.add_argument("--json", action="store_true", help="one JSON line per trace instead of a table")
    ap.add_argument("--gaps", type=int, default=0, metavar="N", help="the N host operators most idle time waited for")
    args = ap.parse_args()
    for path in args.traces:
        r = analyse(path, args.steps, args.gaps)
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
        for g in r.get("idle_before", []):
            print(f"  idle {g['idle_ms']:8.3f} ms/step in {g['gaps_per_step']:6.1f} gaps before kernels of {g['op']}")


if __name__ == "__main__":
    main()
