"""What the command line says about itself (issue 32, item 7): `presets` gives each preset's
purpose and sequence length, `train --help` points to the key reference and --debug,
`--default-corpus`'s help and the README say the same about the corpus, and prepare-data writes
no carriage-return progress into a pipe. The pipe through the command line, in a subprocess; the
help texts in-process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.data.corpus import SUMMARY
from moetrain.presets import PRESETS, PURPOSES

README = Path(__file__).resolve().parents[1] / "README.md"


def _help(capsys, *argv: str) -> str:
    """`moetrain ARGV --help`'s text, its whitespace made single spaces."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_presets_shows_each_purpose_and_sequence_length(capsys):
    assert set(PURPOSES) == set(PRESETS)
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["preset", "total", "active", "seq_len", "purpose"]
    total_ends = {line.index(f[1], len(f[0])) + len(f[1]) for line in lines for f in [line.split()]}
    assert len(total_ends) == 1, lines  # the columns line up under the longest name
    rows = {line.split()[0]: line for line in lines[1:]}
    assert list(rows) == list(PRESETS)
    for name, make in PRESETS.items():
        fields = rows[name].split(maxsplit=4)
        assert int(fields[3]) == make().data.seq_len and fields[4] == PURPOSES[name], rows[name]


def test_train_help_points_to_the_key_reference_and_debug(capsys):
    text = _help(capsys, "train")
    assert "Every key with its type, default and meaning: moetrain config --help." in text
    assert "add --debug for the traceback" in text


def test_default_corpus_help_and_readme_agree(capsys):
    text = _help(capsys, "prepare-data")
    assert f"--default-corpus add the embedded corpus: {SUMMARY}" in text
    assert SUMMARY in " ".join(README.read_text().split())


def test_prepare_data_writes_no_carriage_returns_into_a_pipe(tmp_path):
    """Into pipes (a log, CI): plain progress lines on stderr, nothing but the JSON line on
    stdout — neither tqdm's redraws nor the tokenizer trainer's bar."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"d{i}.txt").write_text(f"document {i}: the experts route every token. " * 40)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moetrain",
            "prepare-data",
            str(docs),
            "--out",
            str(tmp_path / "out"),
            "--vocab-size",
            "300",
        ],
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert b"\r" not in out.stdout + out.stderr, out.stderr
    assert json.loads(out.stdout)["train_documents"] + json.loads(out.stdout)["val_documents"] == 12
    assert out.stdout.decode().count("\n") == 1
    err = out.stderr.decode().splitlines()
    assert err[0] == "training a byte-level BPE of 300 tokens on the training documents", err
    assert err[-1].startswith("tokenizing: 12/12 documents"), err
