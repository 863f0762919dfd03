"""Every citation of a docs page's section by name (`docs/benchmarks.md, "Rehearsed"`) names a
heading that page has (a `#` heading or a paragraph's bold title; its text or its start), and
every package file cited by path (`src/moetrain/model/moe.py`) exists, in the code, the tests, the
scripts and the docs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A page name inside a string literal ("README.md") is a file name, not a citation.
CITATION = re.compile(r"(?<![\"'])((?:docs/)?[\w-]+\.md)[,:]?\s*\(?[\"“]([^\"”]{2,120})[\"”]")
SOURCES = ["src", "tests", "benchmarks", "scripts", "docs"]
# A path that starts at the package folder, with or without src/ (not runs/…/moetrain/…).
PACKAGE_FILE = re.compile(r"(?<![\w./-])((?:src/)?moetrain/[\w/.-]*\.py)\b")


def headings(page: Path) -> list[str]:
    lines = page.read_text().splitlines()
    bold = [m.group(1) for line in lines if (m := re.match(r"\*\*([^*]+)\*\*", line))]
    return [line.lstrip("#").strip() for line in lines if line.startswith("#")] + bold


def files() -> list[Path]:
    found = [ROOT / "README.md"] + [
        p for d in SOURCES for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".sh")
    ]
    found.remove(Path(__file__).resolve())
    return found


def citations() -> list[tuple[str, str, str]]:
    found = []
    for path in files():
        text = path.read_text()
        for m in CITATION.finditer(text):
            page, name = m.group(1), " ".join(m.group(2).split())
            found.append((str(path.relative_to(ROOT)), page, name))
    return found


def _page(page: str) -> Path | None:
    for candidate in (ROOT / page, ROOT / "docs" / page):
        if candidate.is_file():
            return candidate
    return None


def test_every_cited_section_exists():
    bad = []
    for where, page, name in citations():
        path = _page(page)
        if path is None:
            continue  # another project's file (shared/anchor/README.md, …)
        if not any(h.startswith(name) for h in headings(path)):
            bad.append(f"{where}: {page}, {name!r}")
    assert not bad, "sections that do not exist:\n" + "\n".join(bad)


def test_citations_are_found():
    names = {(page, name) for _, page, name in citations()}
    assert ("docs/benchmarks.md", "Rehearsed") in names
    assert len(names) > 10


def test_every_cited_package_file_exists():
    cited = {
        (str(path.relative_to(ROOT)), m.group(1)) for path in files() for m in PACKAGE_FILE.finditer(path.read_text())
    }
    assert len(cited) > 50
    bad = sorted(f"{where}: {name}" for where, name in cited if not (ROOT / name).is_file())
    assert not bad, "package files cited that do not exist (the package is under src/):\n" + "\n".join(bad)
