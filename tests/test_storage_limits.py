"""A write the storage refuses — here a file-size limit (`ulimit -f`), which fails writes as a full
disk does — ends train, prepare-data and export-hf with one paragraph that says what happened and
what was kept, and keeps it: prepare-data's earlier output, the run's checkpoints, an export that
is no model until complete (docs/reliability.md, "Where commands write")."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

LIMIT = 64 * 1024  # bytes a file may grow to


def _limited(*argv: str, limit: int = LIMIT) -> subprocess.CompletedProcess:
    """`moetrain ARGV` in a child whose files may not grow past `limit` bytes."""

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return subprocess.run(
        [sys.executable, "-m", "moetrain", *argv], preexec_fn=cap, capture_output=True, text=True, timeout=600
    )


def _one_paragraph(done: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert done.returncode == code, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in last, last


def test_prepare_data_over_an_earlier_output_stops_in_one_paragraph_and_keeps_it(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(60):
        (docs / f"d{i}.txt").write_text(f"document {i}: the experts route every token to the top-k. " * 200)
    out = tmp_path / "out"
    first = subprocess.run(
        [sys.executable, "-m", "moetrain", "prepare-data", str(docs), "--out", str(out), "--vocab-size", "512"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert (out / "train.bin").stat().st_size > LIMIT
    again = _limited("prepare-data", str(docs), "--out", str(out), "--vocab-size", "512", "--force", "--seed", "1")
    _one_paragraph(again, 1, "moetrain prepare-data could not write", "ulimit -f allows 64 KiB", "as it was")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_training_past_a_size_limit_says_so(tmp_path, real_text_dir):
    run = tmp_path / "run"
    done = _limited(
        "train", "tiny", "--steps", "2", "--device", "cpu", "--run-dir", str(run), f"--data.sources=[{real_text_dir}]",
        "--model.vocab_size=512", "--quiet", limit=1 << 20,
    )  # fmt: skip
    _one_paragraph(done, 2, "Writing checkpoint step-2", "ulimit -f allows 1,024 KiB", "--resume")
    assert not list((run / "checkpoints").glob("step-*"))


def test_export_past_a_size_limit_says_so_and_is_no_model(tmp_path, real_text_dir):
    pytest.importorskip("safetensors")
    run = tmp_path / "run"
    trained = subprocess.run(
        [sys.executable, "-m", "moetrain", "train", "tiny", "--steps", "1", "--device", "cpu", "--run-dir", str(run),
         f"--data.sources=[{real_text_dir}]", "--model.vocab_size=512", "--quiet"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    out = tmp_path / "hf"
    done = _limited("export-hf", str(run), str(out))
    words = "moetrain export-hf could not write", "ulimit -f allows 64 KiB", "config.json is written last"
    _one_paragraph(done, 1, *words)
    assert not (out / "config.json").exists()
