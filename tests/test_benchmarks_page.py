"""docs/benchmarks.md is a reference page rendered from benchmarks/results/*.jsonl: the page
matches its records, every record names its date, machine, commit, command and kind, every
results file is on the page, and the page stays within 450 lines."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("render_tables", ROOT / "benchmarks" / "render_tables.py")
render_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render_tables)


def test_the_page_is_its_records_rendered():
    page = render_tables.PAGE.read_text()
    assert render_tables.rendered(page) == page, "run python benchmarks/render_tables.py"


def test_every_results_file_is_a_table_on_the_page_and_the_page_is_short():
    page = render_tables.PAGE.read_text()
    tables = set(re.findall(r"<!-- table ([\w-]+) -->", page))
    assert tables == {p.stem for p in render_tables.RESULTS.glob("*.jsonl")}
    assert len(page.splitlines()) <= 450


def test_a_record_without_its_provenance_is_refused(tmp_path, monkeypatch):
    (tmp_path / "t.jsonl").write_text(
        '{"cells": {"a": "1"}, "date": "2026-12-06", "gpu": "H100", "kind": "measured"}\n'
    )
    monkeypatch.setattr(render_tables, "RESULTS", tmp_path)
    with pytest.raises(ValueError, match="commit, command"):
        render_tables.render("t")
