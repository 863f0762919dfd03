"""What is alive at the peak: read an allocator snapshot (`moetrain bench ... --train.profile=true`
writes RUN_DIR/profile-ROUTING/memory_snapshot.pickle) and print the blocks alive at the moment the
allocated bytes peaked within the recorded window, grouped by the moetrain source line that made
them (else the first Python frame), largest first.

    python benchmarks/memory_peak.py /tmp/prof-bench-8e/profile-learned/memory_snapshot.pickle

Blocks allocated before the window (parameters, optimizer state) carry no allocation event; they
are reported as one line, "allocated before the window", from the snapshot's segments.
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict


def where(frames: list[dict]) -> str:
    for f in frames:
        if "/moetrain/" in f.get("filename", ""):
            # the last one: a clone named moetrain holds src/moetrain/
            return f"{f['filename'].rsplit('/moetrain/', 1)[1]}:{f['line']} {f['name']}"
    for f in frames:
        if f.get("filename", "").endswith(".py"):
            return f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
    return frames[0]["name"] if frames else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with open(args.snapshot, "rb") as f:
        snap = pickle.load(f)
    trace = next(t for t in snap["device_traces"] if t)
    live: dict[int, tuple[int, str]] = {}
    current = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    freed_unknown = 0  # frees of blocks allocated before the window
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], where(event.get("frames", [])))
            current += event["size"]
            if current - freed_unknown > peak:  # allocated now, less what "before" has lost
                peak, peak_live = current - freed_unknown, dict(live)
        elif action == "free_completed":
            block = live.pop(event["addr"], None)
            if block is None:
                freed_unknown += event["size"]
            else:
                current -= block[0]
    active_now = sum(b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    before = active_now - current + freed_unknown  # alive before the window (some freed in it)
    groups: dict[str, int] = defaultdict(int)
    for size, site in peak_live.values():
        groups[site] += size
    gib = 2**30
    print(
        f"peak within the window: {(before + peak) / gib:.2f} GiB allocated; allocated before the window "
        f"{before / gib:.2f} GiB, of which {freed_unknown / gib:.2f} GiB were freed in it"
    )
    for site, size in sorted(groups.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{size / gib:8.2f} GiB  {site}")


if __name__ == "__main__":
    main()
