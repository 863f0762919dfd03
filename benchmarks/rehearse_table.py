"""The table of `moetrain bench --rehearse` lines (benchmarks/rehearse.sh): per row the rehearsed
figures beside the planner's, as docs/benchmarks.md keeps them. Rehearsed: one rank run alone,
communication not measured; projected = measured compute + the planner's communication model.

    python benchmarks/rehearse_table.py out/rehearse.jsonl
"""

from __future__ import annotations

import json
import sys


def rows(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("rehearsal"):
                    out.append(record)
    return out


def main(path: str) -> None:
    header = (
        "| preset | layout (rank) | compute s: rehearsed / planner | peak GiB: rehearsed / planner | save peak | "
        "load peak | stand-ins s | projected tok/s/GPU | planner tok/s/GPU |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows(path):
        h, p, x = r["rehearsal"], r["rehearsal"]["planner"] or {}, r["rehearsal"]["projected"] or {}
        peaks = h["peak_gib"]

        def pair(measured, planned) -> str:
            if measured is None or not planned:
                return f"{measured} / {planned}"
            return f"{measured:.3g} / {planned:.3g} ({100 * (measured / planned - 1):+.1f}%)"

        flags = f"micro-batch {r['batch']['micro_batch_size']}" + (", compiled" if r["compile"] else "")
        print(
            f"| {r['preset']} | {h['layout']} ({h['rank']}) {flags} | {pair(h['compute_s'], p.get('compute_s'))} | "
            f"{pair(peaks['training'], p.get('peak_gib'))} | {pair(peaks['saving'], p.get('save_peak_gib'))} | "
            f"{pair(peaks['loading'], p.get('load_peak_gib'))} | {h['stand_in_s']:.4f} | "
            f"{x.get('tokens_per_sec_per_device', 0):,.0f} | {p.get('tokens_per_sec_per_device', 0):,.0f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
