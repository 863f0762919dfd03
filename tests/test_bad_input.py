"""Every bad input the reliability contract lists (issue 5) exits 2 with one paragraph that names
the file, field or value — and no traceback — and loses nothing."""

import errno
import json
import shutil

import pytest
from conftest import tiny_overrides

from moetrain.cli import main


def fails(capsys, args, *words):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    return err


def train_args(data_dir, run_dir, *extra):
    return ["train", "tiny", *[f"--{o}" for o in tiny_overrides(data_dir, run_dir, "train.steps=2", *extra)], "--quiet"]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["--model.moe.bogus=1"], ["model.moe.bogus"]),
        (["--train.steps=many"], ["train.steps", "many"]),
        (["--train.steps=0"], ["train.steps=0"]),
        (["--model.d_model=-8"], ["model.d_model"]),
        (["--model.moe.top_k=9"], ["top_k=9", "num_experts=8"]),
        (["--model.n_heads=3"], ["d_model", "n_heads=3"]),
        (["--model.n_kv_heads=3"], ["n_heads=4", "n_kv_heads=3"]),
        (["--parallel.pp=2"], ["parallel.pp=2", "micro-batches"]),
        (["--parallel.pp=2", "--train.micro_batch_size=2"], ["parallel.pp=2", "world size 1"]),
        (["--parallel.ep=3"], ["parallel.ep=3"]),
        (["--parallel.ep=2", "--model.num_dense_layers=4"], ["parallel.ep=2", "model.num_dense_layers=4"]),
        (["--parallel.peer_timeout_s=0"], ["parallel.peer_timeout_s=0", "seconds"]),
    ],
)
def test_config_mistakes(capsys, tmp_path, overrides, words):
    fails(capsys, ["train", "tiny", "--run-dir", str(tmp_path / "run"), *overrides], *words)


def test_yaml_syntax_error_names_file_and_line(capsys, tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("preset: tiny\nmodel:\n  d_model: [128\n")
    fails(capsys, ["config", str(bad)], str(bad), "line")


def test_missing_data_path(capsys, tmp_path):
    fails(
        capsys,
        ["train", "tiny", "--data.sources=[/nowhere/data]", "--run-dir", str(tmp_path)],
        "/nowhere/data",
        "prepare-data",
    )


def copy_data(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_empty_and_truncated_token_files(capsys, real_text_dir, tmp_path):
    truncated = copy_data(real_text_dir, tmp_path / "truncated")
    data = (truncated / "train.bin").read_bytes()
    (truncated / "train.bin").write_bytes(data[: len(data) // 2 + 1])
    fails(capsys, train_args(truncated, tmp_path / "a"), "train.bin", "truncated")
    empty = copy_data(real_text_dir, tmp_path / "empty")
    (empty / "train.bin").write_bytes(b"")
    fails(capsys, train_args(empty, tmp_path / "b"), "train.bin")


def test_token_ids_beyond_the_vocabulary(capsys, real_text_dir, tmp_path):
    fails(capsys, train_args(real_text_dir, tmp_path / "run", "model.vocab_size=100"), "vocab", "100")


def test_sources_with_different_tokenizers(capsys, real_text_dir, tmp_path):
    other = copy_data(real_text_dir, tmp_path / "other")
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["vocab"]["zzzz-extra"] = 10**6  # another vocabulary
    (other / "tokenizer.json").write_text(json.dumps(tok))
    meta = json.loads((other / "meta.json").read_text())
    meta["tokenizer_sha256"] = "0" * 64
    (other / "meta.json").write_text(json.dumps(meta))
    fails(
        capsys,
        train_args(real_text_dir, tmp_path / "run", f"data.sources=[{real_text_dir}, {other}]"),
        "tokenized differently",
        "--tokenizer",
    )


def test_checkpoint_of_another_shape_and_no_complete_checkpoint(capsys, real_text_dir, tmp_path):
    run = tmp_path / "run"
    assert main(train_args(real_text_dir, run)) == 0
    capsys.readouterr()
    fails(
        capsys,
        [*train_args(real_text_dir, run, "model.moe.expert_hidden=48"), "--resume"],
        "does not fit",
        "config.yaml",
    )
    empty = tmp_path / "nothing"
    empty.mkdir()
    fails(capsys, ["eval", str(empty), "--text", "x.txt"], str(empty), "no complete checkpoint")
    partial = run / "checkpoints" / "step-9"
    partial.mkdir()
    fails(capsys, ["eval", str(partial), "--text", "x.txt"], "incomplete checkpoint")


def test_a_hugging_face_or_a_checkpoints_directory_given_as_a_checkpoint_is_named_with_the_fix(capsys, tmp_path):
    """What users pass instead of a run or step-N directory: a Hugging Face model (import-hf it
    first), its weights file, or the run's checkpoints/ directory (its parent is the run)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    fails(capsys, ["eval", str(hf), "--text", "x.txt"], "Hugging Face model", f"moetrain import-hf {hf} OUT_DIR")
    step = tmp_path / "run" / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("step 2\n")
    fails(capsys, ["generate", str(step.parent), "--prompt", "x"], f"Pass the run directory, {tmp_path / 'run'}")
    weights = hf / "model.safetensors"
    weights.write_bytes(b"")
    fails(capsys, ["export-hf", str(weights), str(tmp_path / "out")], f"'{weights}' is a file", "import-hf")


def test_init_from_a_checkpoint_of_another_tokenizer_of_the_same_size(capsys, real_text_dir, tmp_path):
    """Data tokenized by another tokenizer of the checkpoint's vocabulary size would be read as
    other text: refused, leaving no run directory; the checkpoint's tokenizer written out again in
    another layout is the same tokenizer."""
    run = tmp_path / "run"
    assert main(train_args(real_text_dir, run)) == 0
    tok = json.loads((real_text_dir / "tokenizer.json").read_text())
    same = copy_data(real_text_dir, tmp_path / "same")
    (same / "tokenizer.json").write_text(json.dumps(tok))  # one line instead of indented
    assert main(train_args(same, tmp_path / "on-same", f"checkpoint.init_from={run}")) == 0
    capsys.readouterr()
    vocab = tok["model"]["vocab"]
    a, b = (token for token, id_ in vocab.items() if id_ in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: another tokenizer of the same size
    other = copy_data(real_text_dir, tmp_path / "other")
    (other / "tokenizer.json").write_text(json.dumps(tok))
    on = tmp_path / "on-other"
    fails(capsys, train_args(other, on, f"checkpoint.init_from={run}"), "another tokenizer", "--tokenizer")
    assert not on.exists()


def test_unwritable_run_directory(capsys, real_text_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fails(capsys, train_args(real_text_dir, blocker / "run"), str(blocker / "run"), "--run-dir")


def test_disk_full_while_saving_keeps_the_previous_checkpoint(real_text_dir, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from moetrain.errors import CheckpointError
    from moetrain.presets import resolve_config
    from moetrain.train.run_dir import list_checkpoints
    from moetrain.train.trainer import Trainer

    run = tmp_path / "run"
    trainer = Trainer(
        resolve_config("tiny", tiny_overrides(real_text_dir, run, "train.steps=4", "checkpoint.save_every=2")),
        quiet=True,
    )
    for _ in range(2):
        trainer.train_step()
    first = trainer.save()
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    trainer.train_step()
    trainer.train_step()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(CheckpointError) as e:
        trainer.save()
    assert "the disk is full" in str(e.value) and "step-2" in str(e.value)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-2"]  # no partial left behind
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert list_checkpoints(run)[-1][1] == first


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_second_ctrl_c_while_saving_stays_the_users_interrupt(real_text_dir, tmp_path, monkeypatch, wrapped):
    """Ctrl-C twice: the first asks for a save, the second lands inside it. It is reported as the
    interrupt it is (not as a failed write), whether DCP hands it back wrapped or not, the partial
    checkpoint is dropped, and the earlier one named intact."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from moetrain.presets import resolve_config
    from moetrain.train.trainer import Trainer

    run = tmp_path / "run"
    trainer = Trainer(resolve_config("tiny", tiny_overrides(real_text_dir, run, "train.steps=4")), quiet=True)
    trainer.train_step()
    first = trainer.save()
    trainer.train_step()

    def interrupted(*args, **kwargs):
        if wrapped:  # what DCP's own steps raise when the signal arrives inside them
            raise CheckpointException("save", {0: (KeyboardInterrupt(), None)})
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp, "save", interrupted)
    with pytest.raises(KeyboardInterrupt) as e:
        trainer.save()
    assert (
        str(e.value)
        == f"checkpoint step-2 was being written and is dropped; the newest complete checkpoint, {first}, is intact"
    )
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-1"]


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # would create a file when unpickled


def test_a_tampered_checkpoint_cannot_run_code_when_loaded(capsys, real_text_dir, tmp_path):
    """DCP's index is a pickle: a planted payload is refused, nothing runs, and the error says so."""
    import pickle

    run = tmp_path / "run"
    assert main(train_args(real_text_dir, run)) == 0
    capsys.readouterr()
    marker = tmp_path / "pwned"
    step = run / "checkpoints" / "step-2"
    (step / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    fails(capsys, ["eval", str(run), "--text", str(real_text_dir / "meta.json")], "refused", ".metadata")
    assert not marker.exists()
