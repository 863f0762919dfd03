"""docs/benchmarks.md's tables, rendered from the records in benchmarks/results/*.jsonl.

Each line of benchmarks/results/NAME.jsonl is one row: its cells (`cells`, column heading →
text, in the table's column order) and where the figures come from: `date`, `gpu` (the machine),
`commit` (or "tree of <commit> …"), `command`, and `kind` (measured, rehearsed or modelled).
The page holds each table between `<!-- table NAME -->` and `<!-- /table -->`; this script
writes the rows there, a "when" column of date, machine and commit (with the kind where it is not
"measured"), and below the table each distinct command once, numbered as the rows cite it.

    python benchmarks/render_tables.py           # rewrite docs/benchmarks.md's tables
    python benchmarks/render_tables.py --check   # exit 1 if the page differs from its records

A new figure is a new line in a results file (or the line it supersedes, replaced), then a run
of this script; git keeps the history.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"
PROVENANCE = ("date", "gpu", "commit", "command", "kind")
KINDS = ("measured", "rehearsed", "modelled")
BLOCK = re.compile(r"(<!-- table (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def read_records(name: str) -> list[dict]:
    path = RESULTS / f"{name}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, record in enumerate(records, 1):
        missing = [key for key in ("cells", *PROVENANCE) if not record.get(key)]
        if missing or record["kind"] not in KINDS:
            raise ValueError(f"{path}:{i}: needs {', '.join(missing) or 'a kind in ' + str(KINDS)}")
    return records


def render(name: str) -> str:
    records = read_records(name)
    columns = list(records[0]["cells"])
    commands: list[str] = []
    lines = ["| " + " | ".join([*columns, "when"]) + " |", "|" + "---|" * (len(columns) + 1)]
    for record in records:
        if record["command"] not in commands:
            commands.append(record["command"])
        kind = "" if record["kind"] == "measured" else f", **{record['kind']}**"
        when = f"{record['date']}, {record['gpu']}, {record['commit']}{kind} [{commands.index(record['command']) + 1}]"
        lines.append("| " + " | ".join([*(record["cells"].get(c, "") for c in columns), when]) + " |")
    lines.append("")
    lines += [f"[{n}] `{command}`  " for n, command in enumerate(commands, 1)]
    return "\n".join(lines).rstrip() + "\n"


def rendered(page: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("name")) + m.group(4), page)


def main(argv: list[str]) -> int:
    page = PAGE.read_text()
    new = rendered(page)
    if "--check" in argv:
        if new != page:
            print(f"{PAGE} differs from benchmarks/results: run python benchmarks/render_tables.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
