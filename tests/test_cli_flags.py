"""Flags and names as a user types them (issue 32, item 4): no prefix of a flag is taken for the
flag (`--step 10` is not `--steps 10`), a mistyped command or preset gets the nearest name, one
data path without brackets is one source, and a relative path that is not there says where it
was looked for. Each through the command line, in a subprocess."""

import subprocess
import sys

import pytest
import yaml
from conftest import tiny_overrides


def moetrain(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moetrain", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def refused(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    for word in words:
        assert word in out.stderr, (word, out.stderr)


def test_moetrain_train_tiny_step_10_is_not_taken_as_steps():
    refused(moetrain("train", "tiny", "--step", "10", "--device", "cpu"), "Unknown option '--step'", "--steps?")


def test_moetrain_prepare_data_vocab_is_not_taken_as_vocab_size(tmp_path):
    (tmp_path / "a.txt").write_text("one two three\n")
    out = moetrain("prepare-data", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--vocab", "260")
    assert out.returncode == 2 and "--vocab" in out.stderr and not (tmp_path / "out").exists(), out.stderr


def test_moetrain_trian_suggests_train():
    refused(moetrain("trian"), "unknown command 'trian'", "Did you mean 'train'?")


def test_moetrain_train_tinyy_suggests_tiny():
    refused(moetrain("train", "tinyy"), "'tinyy' is neither a preset", "Did you mean 'tiny'?")
    refused(moetrain("config", "ref-tiny-65e"), "Did you mean 'ref-tiny-64e'?")


def test_moetrain_config_tiny_data_sources_one_path_is_one_source():
    out = moetrain("config", "tiny", "--data.sources=/data/corpus")
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["data"]["sources"] == ["/data/corpus"]


def test_a_relative_path_that_is_not_there_says_where_it_was_looked_for(tmp_path):
    out = moetrain("train", "tiny", "--data.sources=data/nowhere", "--device", "cpu", cwd=tmp_path)
    refused(out, "'data/nowhere' does not exist", f"current directory, {tmp_path}")
    refused(moetrain("train", "runs/mine.yaml", cwd=tmp_path), "'runs/mine.yaml' does not exist", str(tmp_path))


def test_an_empty_run_dir_is_refused_and_the_current_directory_left_alone(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("mine\n")
    (tmp_path / "summary.json").write_text("{}")
    refused(moetrain("train", "tiny", "--run-dir", "", "--steps", "1", cwd=tmp_path), "train.run_dir (--run-dir) is ''")
    assert (tmp_path / "metrics.jsonl").read_text() == "mine\n" and (tmp_path / "summary.json").is_file()


def test_a_run_dir_that_looks_like_yaml_is_the_directory_named(real_text_dir, tmp_path):
    for name in ("run #1", "0123"):
        flags = [f"--{o}" for o in tiny_overrides(real_text_dir, "null", "train.steps=1", "train.eval_every=0")]
        out = moetrain("train", "tiny", *flags, "--run-dir", name, "--quiet", cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert (tmp_path / name / "metrics.jsonl").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0123", "run #1"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        ["presets"],
        ["params", "ref-ultra-256e"],
        ["config", "--help"],
        ["config", "tiny", "--model.n_layers=2"],
        ["config", "tiny", "--train.fp8=rowwise", "--compute.compile=true"],
        ["plan", "--help"],
        ["plan", "tiny", "--gpus", "two"],
        ["plan", "tiny", "--gpus", "2", "--model.n_layer=2"],
    ],
)
def test_help_listings_and_argument_errors_load_no_torch(argv):
    """These answer without importing torch (each command's module is imported when that command
    runs; configs and counts need no torch; plan loads the planner after its arguments are read)."""
    code = (
        f"import sys; from moetrain.cli import main\ntry: main({argv!r})\nexcept SystemExit: pass\n"
        "print('torch loaded' if 'torch' in sys.modules else 'no torch')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("no torch"), (out.stdout, out.stderr[-800:])
    if argv == ["--version"]:
        assert "(torch 2." in out.stdout
    if argv[0] == "plan" and "--help" not in argv:
        assert "two" in out.stderr or "n_layer" in out.stderr


def test_a_reader_that_stops_reading_stdout_is_a_normal_end():
    """`moetrain presets | head -1`: the command ends with exit 0 and nothing on stderr, not as a
    dead rank."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moetrain", "presets"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().startswith("preset")
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == "", err
