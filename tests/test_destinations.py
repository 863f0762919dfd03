"""Every command that writes checks its destination before it writes anything: a file where a
directory belongs, files it would replace (--force where replacing is legitimate), no write
permission, too little free disk for what it is about to write. One paragraph, exit 2, nothing
created. (tests/test_bad_input.py has train's run directory under a file.)"""

import collections
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import tiny_overrides

from moetrain import destinations
from moetrain.cli import main
from moetrain.train import run_dir


def fails(capsys, args, *words):
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1, err
    for word in words:
        assert str(word) in err, (word, err)
    return err


def succeeds(capsys, args):
    assert main([str(a) for a in args]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def train_args(data_dir, run_dir, *extra):
    return ["train", "tiny", *[f"--{o}" for o in tiny_overrides(data_dir, run_dir, "train.steps=2", *extra)], "--quiet"]


@pytest.fixture
def read_only(monkeypatch):
    """Make directories unwritable: chmod, and for root (whom chmod does not stop) `os.access`
    answering as it would for anyone else."""
    locked = []
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and any(os.path.abspath(path) == str(p) for p in locked):
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(destinations.os, "access", access)

    def lock(path):
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o555)
        locked.append(path.absolute())
        return path

    yield lock
    for path in locked:
        path.chmod(0o755)


@pytest.fixture
def small_disk(monkeypatch):
    """A filesystem with `free` bytes left (shutil.disk_usage as the checks see it)."""

    def set_free(free):
        usage = collections.namedtuple("usage", "total used free")
        monkeypatch.setattr(destinations.shutil, "disk_usage", lambda path: usage(10 * free, 9 * free, free))

    return set_free


@pytest.fixture(scope="module")
def trained(real_text_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("dest") / "run"
    assert main(train_args(real_text_dir, run)) == 0
    return run


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    pytest.importorskip("safetensors")
    out = tmp_path_factory.mktemp("dest-hf") / "hf"
    assert main(["export-hf", str(trained), str(out), "--dtype", "float32"]) == 0
    return out


# ---- train ------------------------------------------------------------------------------------


def test_train_refuses_a_run_dir_that_is_a_file(capsys, real_text_dir, tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("notes")
    fails(capsys, train_args(real_text_dir, blocker), f"'{blocker}' is not writable: it is a file", "--run-dir")
    assert blocker.read_text() == "notes"


def test_train_refuses_a_checkpoints_path_that_is_a_file_before_training(capsys, real_text_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("notes")
    fails(capsys, train_args(real_text_dir, run), f"'{run / 'checkpoints'}' is not writable: it is a file")
    assert (run / "checkpoints").read_text() == "notes" and not (run / "metrics.jsonl").exists()


def test_train_refuses_a_run_dir_that_is_a_checkpoint(capsys, real_text_dir, trained, exported, tmp_path):
    """`--run-dir RUN/checkpoints/step-N` (eval and generate take one), `RUN/checkpoints`, or an
    export-hf directory: a fresh start, or a resume that found no checkpoint inside, trained into
    it over its config.yaml and tokenizer.json (or among the run's checkpoints)."""
    step = shutil.copytree(trained, tmp_path / "run") / "checkpoints" / "step-2"
    hf = shutil.copytree(exported, tmp_path / "hf")
    run = step.parent.parent
    for where, words in (
        (step, ["is a checkpoint, not a run", f"--run-dir {run}", f"init_from={step}"]),
        (step.parent, ["is a run's checkpoints directory, not a run", f"--run-dir {run}", f"init_from={run} "]),
        (hf, ["is a Hugging Face model, not a run", f"moetrain import-hf {hf} OUT_DIR"]),
    ):
        before = {p.name: p.read_bytes() if p.is_file() else None for p in where.iterdir()}
        for resume in ([], ["--resume"]):
            fails(capsys, [*train_args(real_text_dir, where), *resume], *words)
        assert {p.name: p.read_bytes() if p.is_file() else None for p in where.iterdir()} == before


def test_a_name_too_long_for_the_file_system_is_refused_by_name(capsys, real_text_dir, tmp_path):
    fails(capsys, train_args(real_text_dir, tmp_path / ("x" * 300)), "too long a name", "255 bytes", "--run-dir")


def test_a_deleted_current_directory_is_said_before_torch_loads(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    code = (
        f"import os, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r})\n"
        "from moetrain.cli import main\n"
        "sys.exit(main(['train', 'tiny', '--steps', '1']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "the current directory no longer exists" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "FATAL" not in done.stderr


def test_train_refuses_a_run_dir_it_cannot_write(capsys, real_text_dir, tmp_path, read_only):
    parent = read_only(tmp_path / "locked")
    fails(capsys, train_args(real_text_dir, parent / "run"), parent / "run", "no permission", "--run-dir")
    assert not (parent / "run").exists()


def test_train_refuses_a_disk_without_room_for_a_checkpoint(capsys, real_text_dir, tmp_path, small_disk):
    small_disk(1 << 20)
    run = tmp_path / "run"
    err = fails(capsys, train_args(real_text_dir, run), run, "1.0 MiB free", "a checkpoint of this run", "× 12 bytes")
    assert "--checkpoint.save_every=0" in err and not run.exists()
    # Without checkpoints there is nothing to estimate: the run goes ahead.
    assert main(train_args(real_text_dir, run, "checkpoint.save_every=0", "checkpoint.save_final=false")) == 0


def test_the_checkpoint_estimate_is_what_a_checkpoint_takes(trained):
    from moetrain.model.counting import count_params
    from moetrain.presets import resolve_config
    from moetrain.train.run_dir import estimated_bytes

    cfg = resolve_config("tiny", tiny_overrides("unused", trained))
    estimate = estimated_bytes(count_params(cfg.model).total, 8)
    written = sum(p.stat().st_size for p in (trained / "checkpoints" / "step-2").iterdir())
    assert written <= estimate < 1.5 * written, (written, estimate)


@pytest.mark.parametrize("default_run_dir", [False, True])
def test_a_run_refused_before_training_leaves_no_directory(capsys, tmp_path, monkeypatch, default_run_dir):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "new" / "run"
    args = ["train", "tiny", "--data.sources=[/nowhere/data]", "--quiet"]
    fails(capsys, args if default_run_dir else [*args, "--run-dir", run], "/nowhere/data")
    assert sorted(os.listdir(tmp_path)) == []


# ---- prepare-data -----------------------------------------------------------------------------


def docs(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(4):
        (d / f"{i}.txt").write_text(f"document number {i} " * 20)
    return d


def test_prepare_data_checks_its_out_dir(capsys, tmp_path, read_only):
    d = docs(tmp_path)
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    fails(capsys, ["prepare-data", d, "--out", blocker / "out", "--vocab-size", 300], f"'{blocker}' is a file")
    locked = read_only(tmp_path / "locked")
    fails(capsys, ["prepare-data", d, "--out", locked / "out", "--vocab-size", 300], "no permission", "--out")


def test_prepare_data_replaces_token_files_only_with_force(capsys, tmp_path):
    d, out = docs(tmp_path), tmp_path / "out"
    succeeds(capsys, ["prepare-data", d, "--out", out, "--vocab-size", 300])
    before = (out / "train.bin").read_bytes()
    fails(capsys, ["prepare-data", d, "--out", out, "--vocab-size", 300, "--seed", 1], out, "meta.json", "--force")
    assert (out / "train.bin").read_bytes() == before
    succeeds(capsys, ["prepare-data", d, "--out", out, "--vocab-size", 300, "--force"])
    # Other files beside the output are not in the way.
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README").write_text("mine")
    succeeds(capsys, ["prepare-data", d, "--out", tmp_path / "notes", "--vocab-size", 300])


# ---- export-hf / import-hf --------------------------------------------------------------------


def test_export_hf_checks_its_out_dir(capsys, trained, tmp_path, read_only, small_disk):
    pytest.importorskip("safetensors")
    blocker = tmp_path / "hf"
    blocker.write_text("")
    fails(capsys, ["export-hf", trained, blocker], f"'{blocker}' is not writable: it is a file", "OUT_DIR")
    locked = read_only(tmp_path / "locked")
    fails(capsys, ["export-hf", trained, locked / "hf"], "no permission", "OUT_DIR")
    small_disk(4096)
    fails(capsys, ["export-hf", trained, tmp_path / "new"], "4.0 KiB free", "weights in bfloat16")
    assert not (tmp_path / "new").exists()


def test_export_hf_replaces_an_earlier_export_only_with_force(capsys, trained, tmp_path):
    pytest.importorskip("safetensors")
    out = tmp_path / "hf"
    first = succeeds(capsys, ["export-hf", trained, out, "--dtype", "float32"])
    weights = (out / "model.safetensors").read_bytes()
    fails(capsys, ["export-hf", trained, out], out, "config.json", "model.safetensors", "--force")
    assert (out / "model.safetensors").read_bytes() == weights
    again = succeeds(capsys, ["export-hf", trained, out, "--dtype", "float32", "--force"])
    assert again == first and (out / "model.safetensors").read_bytes() == weights


def test_an_export_killed_over_an_earlier_one_is_no_model_until_it_completes(capsys, trained, tmp_path):
    """kill -9 in the middle of `export-hf --force` over an earlier export: the earlier config.json
    is gone before the first new shard, so the half-written directory is no model (transformers
    and import-hf need config.json, written last, whole); the next export completes it."""
    pytest.importorskip("safetensors")
    out = tmp_path / "hf"
    succeeds(capsys, ["export-hf", trained, out, "--dtype", "float32"])
    killed_after_two_shards = (
        "import os, signal, sys\n"
        "from moetrain.cli import main\n"
        "from moetrain.hf import convert\n"
        "write, done = convert._write_shard, []\n"
        "def writing(*a, **k):\n"
        "    write(*a, **k)\n"
        "    done.append(1)\n"
        "    if len(done) == 2: os.kill(os.getpid(), signal.SIGKILL)\n"
        "convert._write_shard = writing\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["export-hf", str(trained), str(out), "--force", "--max-shard-size", "64KB"]
    done = subprocess.run([sys.executable, "-c", killed_after_two_shards, *argv], capture_output=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    shards = sorted(p.name for p in out.glob("model-0*.safetensors"))
    assert len(shards) == 2 and not (out / "config.json").exists(), sorted(p.name for p in out.iterdir())
    assert not (out / "model.safetensors").exists()  # the earlier export's weights went with its config
    fails(capsys, ["import-hf", out, tmp_path / "imported"], "has no config.json")
    succeeds(capsys, ["export-hf", trained, out, "--force", "--max-shard-size", "64KB"])
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    succeeds(capsys, ["import-hf", out, tmp_path / "imported"])


def test_import_hf_checks_its_out_dir(capsys, exported, tmp_path, read_only, small_disk):
    blocker = tmp_path / "imported"
    blocker.write_text("")
    fails(capsys, ["import-hf", exported, blocker], f"'{blocker}' is not writable: it is a file")
    locked = read_only(tmp_path / "locked")
    fails(capsys, ["import-hf", exported, locked / "imported"], "no permission", "OUT_DIR")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own\n")
    fails(capsys, ["import-hf", exported, mine], "config.yaml", "--force")
    assert (mine / "config.yaml").read_text() == "my own\n"
    small_disk(1 << 20)
    fails(capsys, ["import-hf", exported, tmp_path / "new"], "1.0 MiB free", "imported checkpoint", "× 4 bytes")
    assert not (tmp_path / "new").exists()


def test_import_hf_refuses_a_model_larger_than_the_machines_memory(capsys, exported, tmp_path, monkeypatch):
    """It builds the whole model in fp32 host memory: past it the kernel killed it without a word
    (upcycle: tests/test_upcycle.py)."""
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16}  # 64 KiB, less than the test model in fp32
    monkeypatch.setattr(run_dir.os, "sysconf", pages.__getitem__)
    words = "is built whole in this machine's memory, in fp32", "more than its 64.0 KiB", "more memory"
    fails(capsys, ["import-hf", exported, tmp_path / "imported"], "The imported checkpoint", *words)
    assert not (tmp_path / "imported").exists()


def test_import_hf_never_replaces_checkpoints_even_with_force(capsys, exported, trained, tmp_path):
    run = shutil.copytree(trained, tmp_path / "run")
    fails(capsys, ["import-hf", exported, run, "--force"], "already holds checkpoints")


# ---- upcycle ----------------------------------------------------------------------------------


def test_upcycle_replaces_a_config_yaml_in_its_out_dir_only_with_force(capsys, trained, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own\n")
    fails(capsys, ["upcycle", trained, mine, "--model.num_dense_layers=1"], "config.yaml", "--force")
    assert (mine / "config.yaml").read_text() == "my own\n"
    # with --force the checks go on: this source (an MoE run) is no dense model to upcycle
    fails(capsys, ["upcycle", trained, mine, "--force", "--model.num_dense_layers=1"], "upcycle a dense model")


# ---- plot -------------------------------------------------------------------------------------


def test_plot_checks_its_out_file(capsys, trained, tmp_path, read_only):
    pytest.importorskip("matplotlib")
    fails(capsys, ["plot", trained, "--out", tmp_path], f"'{tmp_path}' is a directory")
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    fails(capsys, ["plot", trained, "--out", blocker / "a.png"], f"'{blocker}' is not writable: it is a file")
    locked = read_only(tmp_path / "locked")
    fails(capsys, ["plot", trained, "--out", locked / "a.png"], "no permission", "--out")
    notes = tmp_path / "notes.txt"
    notes.write_text("not a plot")
    fails(capsys, ["plot", trained, "--out", notes], notes, "--force")
    assert notes.read_text() == "not a plot"
    succeeds(capsys, ["plot", trained, "--out", notes, "--force"])
    png = tmp_path / "sub" / "curves.png"
    succeeds(capsys, ["plot", trained, "--out", png])  # its directory is made
    succeeds(capsys, ["plot", trained, "--out", png])  # an earlier plot is replaced
