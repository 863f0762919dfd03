"""Config files cannot crash the command line: whatever a YAML file holds — bytes that are not
UTF-8, a key twice, a key that is not a name, a list where a preset's name goes, a section that is
a number, nesting no config has, nothing at all — `moetrain config FILE` (and so `train`,
`bench`, `plan`) exits 2 with one paragraph naming the file (and the key or line), never a
traceback, never a hang. The named cases first, then random YAML trees and random bytes."""

import datetime
import os
import random
import signal
import string
import sys

import pytest
import yaml

from moetrain.cli import main
from moetrain.config import walk_fields
from moetrain.presets import preset


def run_config(capsys, path) -> tuple[int, str]:
    """`moetrain config PATH` in this process, with a 20 s alarm (a hang fails the test)."""
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail(f"moetrain config {path} hung"))
    signal.alarm(20)
    try:
        rc = main(["config", str(path)])
    finally:
        signal.alarm(0)
    err = capsys.readouterr().err
    return rc, err


def refused(capsys, path, *words) -> str:
    rc, err = run_config(capsys, path)
    assert rc == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert str(path) in err, err
    for word in words:
        assert word in err, (word, err)
    return err


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("not-utf8.yaml", b"\xff\xfe\x00preset: tiny\n", ["not UTF-8", "0xff", "save it as UTF-8"]),
        ("latin1.yaml", "preset: tiny\ntrain:\n  run_dir: caf\xe9\n".encode("latin-1"), ["not UTF-8", "line 3"]),
        ("preset-list.yaml", b"preset: [tiny]\n", ["'preset'", "list ['tiny']", "preset: tiny"]),
        ("preset-number.yaml", b"preset: 5\n", ["'preset'", "int 5"]),
        ("preset-unknown.yaml", b"preset: tinyy\n", ["'tinyy'", "Presets: tiny"]),
        (
            "twice.yaml",
            b"train:\n  steps: 3\nmodel:\n  d_model: 64\ntrain:\n  steps: 4\n",
            ["'train'", "lines 1 and 5"],
        ),
        ("twice-nested.yaml", b"train:\n  steps: 3\n  seed: 1\n  steps: 4\n", ["'train.steps'", "lines 2 and 4"]),
        ("empty.yaml", b"", ["is empty", "preset: tiny"]),
        ("comments.yaml", b"# a comment\n\n# another\n", ["is empty"]),
        ("top-list.yaml", b"- preset\n- tiny\n", ["mapping at its top level", "a list"]),
        ("top-scalar.yaml", b"tiny\n", ["mapping at its top level", "'tiny'"]),
        ("int-key.yaml", b"1: 2\n", ["line 1", "'1'", "not a name"]),
        ("null-key.yaml", b"train:\n  null: 3\n", ["line 2", "under 'train'", "not a name"]),
        ("bool-key.yaml", b"train:\n  yes: 3\n", ["'yes'", "quote it"]),
        ("list-key.yaml", b"? [a, b]\n: 1\n", ["a list", "not a name"]),
        ("bad-date.yaml", b"train:\n  steps: 2020-13-45\n", ["'train.steps'", "2020-13-45", "line 2"]),
        ("section-number.yaml", b"train: 5\n", ["'train.'", "mapping"]),
        ("deep.yaml", ("[" * 3000 + "]" * 3000).encode(), ["too deeply"]),
        ("syntax.yaml", b"preset: tiny\nmodel:\n  d_model: [128\n", ["YAML syntax error", "line"]),
        ("nul.yaml", b"preset: ti\x00ny\n", ["YAML syntax error"]),
        ("invalid.yaml", b"preset: tiny\ntrain:\n  steps: 0\n", ["train.steps"]),
    ],
)
def test_a_bad_config_file_is_one_paragraph_naming_it(capsys, tmp_path, name, content, words):
    path = tmp_path / name
    path.write_bytes(content)
    refused(capsys, path, *words)


def test_not_a_regular_file_is_named_for_what_it_is(capsys, tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    refused(capsys, fifo, "a FIFO (named pipe)", "not a regular file")
    refused(capsys, tmp_path, "a directory")
    refused(capsys, "/dev/null", "a character device")


def test_a_merge_key_and_an_alias_are_read(capsys, tmp_path):
    """YAML's own reuse (`<<:` merging a mapping in, an alias) is not a duplicate: the file is
    read, the keys written after the merge win."""
    from moetrain.presets import resolve_config

    path = tmp_path / "merge.yaml"
    path.write_text("preset: tiny\ntrain:\n  <<: {steps: 7, seed: 3}\n  seed: 4\n")
    rc, err = run_config(capsys, path)
    assert rc == 0, err
    cfg = resolve_config(str(path))
    assert (cfg.train.steps, cfg.train.seed) == (7, 4)


def test_a_utf8_file_with_a_byte_order_mark_is_read(capsys, tmp_path):
    path = tmp_path / "bom.yaml"
    path.write_bytes(b"\xef\xbb\xbfpreset: tiny\ntrain:\n  steps: 5\n")
    rc, err = run_config(capsys, path)
    assert rc == 0, err


# ---- random inputs -----------------------------------------------------------------------------

LEAVES = [info.dotted for info in walk_fields(type(preset("tiny")))]


def junk(rng: random.Random, depth: int = 0):
    """A random YAML value: any scalar type YAML builds, or a list or mapping of them."""
    kind = rng.randrange(12 if depth < 3 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1, 7, 2**40, 2**70, -(2**100)])
    if kind == 3:
        return rng.choice([0.0, -2.5, 1e-3, 1e300, float("inf"), float("nan")])
    if kind == 4:
        return "".join(rng.choice(string.printable) for _ in range(rng.randrange(0, 20)))
    if kind == 5:
        return rng.choice(["tiny", "cpu", "cuda", "adamw", "muon", "softmax", "fsdp", "[]", "{}", "1e-3", "yes"])
    if kind == 6:
        return datetime.date(2020, 1, 2)
    if kind == 7:
        return b"\x00\x01"
    if kind == 8:
        return "x" * rng.choice([1, 1000, 100_000])
    if kind == 9:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if kind == 10:
        return {
            rng.choice(["a", "steps", "train", "moe", "1"]): junk(rng, depth + 1) for _ in range(rng.randrange(0, 3))
        }
    return {rng.choice([1, None, True, 2.5]): junk(rng, depth + 1)}


def random_tree(rng: random.Random) -> dict:
    """A config-shaped mapping: a preset (or a wrong one), some real dotted keys set to junk or to
    plausible values, sometimes an unknown key or a junk section."""
    tree: dict = {}
    if rng.random() < 0.7:
        tree["preset"] = rng.choice(["tiny", "tiny", "bench-8e", junk(rng)])
    for _ in range(rng.randrange(0, 5)):
        dotted = rng.choice(LEAVES).split(".")
        node = tree
        for part in dotted[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else node
        node[dotted[-1]] = junk(rng) if rng.random() < 0.7 else rng.choice([1, 2, 0.5, "cpu", [1, 2]])
    if rng.random() < 0.2:
        tree[rng.choice(["train", "model", "bogus", "data"])] = junk(rng)
    return tree


def check_random(capsys, path) -> None:
    rc, err = run_config(capsys, path)
    capsys.readouterr()
    assert rc in (0, 2), (rc, err)
    assert "Traceback" not in err, err
    if rc == 2:
        assert err.startswith("error: ") and str(path) in err, err


def test_random_yaml_trees_never_crash_the_command_line(capsys, tmp_path):
    rng = random.Random(0)
    for i in range(300):
        path = tmp_path / f"tree{i}.yaml"
        text = yaml.safe_dump(random_tree(rng), allow_unicode=rng.random() < 0.5)
        if rng.random() < 0.2:  # the same section written twice, as a hand-edited file would
            text += text.splitlines()[0] + "\n" if text.strip() else ""
        path.write_text(text)
        check_random(capsys, path)


def test_random_bytes_never_crash_the_command_line(capsys, tmp_path):
    rng = random.Random(1)
    alphabet = (string.printable + "[]{}:-?&*!|>'\"%@`#,\t\n").encode() + bytes(range(0x80, 0x100, 7))
    for i in range(300):
        path = tmp_path / f"bytes{i}.yaml"
        n = rng.randrange(0, 200)
        if i % 3 == 0:
            data = bytes(rng.randrange(256) for _ in range(n))
        else:
            data = bytes(rng.choice(alphabet) for _ in range(n))
        path.write_bytes(data)
        check_random(capsys, path)


def test_the_property_tests_would_see_a_crash(capsys, tmp_path, monkeypatch):
    """The random tests' check fails on a traceback: a loader that raises a plain TypeError is
    caught by `check_random` (the command line lets a bug's traceback through)."""
    import moetrain.presets

    def broken(path):
        raise TypeError("unhashable type: 'list'")

    monkeypatch.setattr(moetrain.presets, "load_yaml", broken)
    path = tmp_path / "any.yaml"
    path.write_text("preset: tiny\n")
    with pytest.raises((AssertionError, TypeError)):
        check_random(capsys, path)


def moetrain(*args: str):
    import subprocess

    return subprocess.run([sys.executable, "-m", "moetrain", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["config", "train", "plan"])
def test_moetrain_command_of_a_yaml_with_a_key_twice_or_not_utf8_exits_2_naming_it(tmp_path, command):
    """As a user types it: `moetrain train run.yaml` on a hand-edited file with `train:` twice,
    and on one saved as Latin-1: one paragraph each, the file and the lines or byte named."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("preset: tiny\ntrain:\n  steps: 3\ntrain:\n  steps: 4\n")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("preset: tiny\ntrain:\n  run_dir: caf\xe9\n".encode("latin-1"))
    extra = ["--gpus", "1"] if command == "plan" else []
    for path, words in ((twice, ["'train' appears twice", "lines 2 and 4"]), (latin, ["not UTF-8", "line 3"])):
        out = moetrain(command, str(path), *extra)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert str(path) in out.stderr and all(w in out.stderr for w in words), out.stderr
