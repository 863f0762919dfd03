"""The package's docstrings and comments say what the code is, not when or in which session,
call, issue or commit it came to be (that is git's), and name Olmo-core as Olmo-core."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "moetrain"

HISTORY = [
    (re.compile(r"\b[Ss]ession \d+|\bthis session\b|\blast session\b"), "a session"),
    (re.compile(r"\b[Cc]all \d+\b"), "a device call"),
    (re.compile(r"\b[Ii]ssue \d+\b"), "an issue number"),
    (re.compile(r"\b20\d\d-\d\d-\d\d\b"), "a date"),
    (re.compile(r"\bthe anchor\b|\banchor's\b", re.IGNORECASE), "'the anchor' (say Olmo-core)"),
]
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")


def _commit_like(word: str) -> bool:
    """A 7-40 character hex word with letters and digits that is not a number (2250e12 is)."""
    if not (re.search(r"[a-f]", word) and re.search(r"\d", word)):
        return False
    try:
        float(word)
    except ValueError:
        return True
    return False


def _findings(text: str) -> list[str]:
    found = [what for pattern, what in HISTORY if pattern.search(text)]
    found += [f"a commit ({w})" for w in HEX.findall(text) if _commit_like(w)]
    return found


def test_the_package_carries_no_history_references():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for what in _findings(line):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {what}: {line.strip()[:100]}")
    assert not bad, "\n".join(bad)


def test_the_check_catches_each_kind():
    assert _findings("measured in session 25 (call 4, issue 16) on 2026-12-02 at commit 9286d53")
    assert len(_findings("measured in session 25 (call 4, issue 16) on 2026-12-02 at commit 9286d53")) == 5
    assert _findings("the anchor's formula") and _findings("The anchor runner")
    assert not _findings("B300 peak 2250e12 FLOP/s; an interactive session or a script; 0xdeadbeef")
