"""Small things a new user reads (issue 57, item 9): parameter counts in a unit that shows them,
sampling flags that do nothing said so, only the flags a command takes in its help, the
validation loss at step 0 in every plot, and a run directory's note that names what --resume
will continue."""

import json

import pytest
import torch

from moetrain.cli import main


def test_presets_show_small_models_in_millions(capsys):
    assert main(["presets"]) == 0
    rows = {line.split()[0]: line.split()[1:3] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["tiny"][0].endswith("M") and float(rows["tiny"][0][:-1]) > 1  # 3.67M, not 0.004B
    assert rows["ref-tiny-64e"] == ["12.912B", "1.587B"]


def test_top_k_without_a_temperature_is_said_to_do_nothing(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "none"), "--prompt", "x", "--top-k", "5"]) == 2  # no checkpoint there
    err = capsys.readouterr().err
    assert "with --temperature 0 (the default) generation is greedy" in err
    assert main(["generate", str(tmp_path / "none"), "--prompt", "x", "--top-k", "5", "--temperature", "1"]) == 2
    assert "greedy" not in capsys.readouterr().err


def test_config_help_lists_only_the_flags_config_takes(capsys):
    with pytest.raises(SystemExit):
        main(["config", "--help"])
    text = capsys.readouterr().out.split("Any config key")[0]  # the flags, before the keys' reference
    assert "--steps" in text and "--resume" not in text and "--rehearse" not in text and "--quiet" not in text
    assert main(["config", "tiny", "--resume"]) == 2
    assert "Unknown option '--resume'" in capsys.readouterr().err


def test_every_plot_starts_at_the_step_0_validation_loss(tmp_path):
    from moetrain.train.plot import _val_points

    (tmp_path / "summary.json").write_text(json.dumps({"initial_val_loss": 9.0}))
    records = [{"step": 5, "val_loss": 6.0}, {"step": 10}, {"step": 15, "val_loss": 5.0}]
    assert _val_points(tmp_path, records) == [(0, 9.0), (5, 6.0), (15, 5.0)]
    (tmp_path / "summary.json").unlink()
    assert _val_points(tmp_path, records) == [(5, 6.0), (15, 5.0)]


def test_a_run_that_has_logged_no_step_is_not_plotted_as_an_empty_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl' holds no step yet" in err and "Traceback" not in err, err
    assert not (tmp_path / "loss-compare.png").exists()


def test_a_fresh_runs_note_names_the_directory_resume_would_need(tmp_path):
    from moetrain.train.run_dir import default_run_dir

    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "metrics.jsonl").write_text("")
    path, why = default_run_dir("tiny", resume=False, root=tmp_path)
    assert path == tmp_path / "tiny-2"
    assert why == f"{tmp_path / 'tiny'} holds an earlier run: continue it with --resume --run-dir {tmp_path / 'tiny'}"
    (tmp_path / "imported" / "checkpoints").mkdir(parents=True)  # import-hf's: weights, no run to resume
    (tmp_path / "imported" / "config.yaml").write_text("")
    path, why = default_run_dir("imported", resume=False, root=tmp_path)
    assert (path, why) == (tmp_path / "imported-2", f"{tmp_path / 'imported'} is taken (config.yaml, checkpoints)")


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--device", "tpu"], "is not a device"),
        pytest.param(
            ["--device", "cuda:0"],
            "no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
        (["--temperature", "1e-320"], "overflow"),
        (["--seed", str(2**70)], "--seed"),
        (["--prompt", "caf\udce9"], "--prompt is not UTF-8"),
    ],
)
def test_generate_refuses_what_it_cannot_run_in_one_paragraph(tmp_path, capsys, flags, words):
    args = ["generate", str(tmp_path / "none"), "--prompt", "x", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and "does not exist" not in err, err


def test_a_text_file_that_is_a_directory_is_named_as_one(tmp_path):
    from moetrain.errors import DataError
    from moetrain.inference import text_loss

    class Tokenizer:
        def token_to_id(self, token):
            return 0

    with pytest.raises(DataError, match="is a directory: pass text or .jsonl files"):
        text_loss(None, None, Tokenizer(), [str(tmp_path)])


def test_eval_reads_a_text_file_as_prepare_data_does(tmp_path, monkeypatch):
    """`eval --text`: bytes that are not UTF-8 (a gzip file, say) are refused naming the file, not
    evaluated as replacement characters; "\\r\\n" stays as prepare-data keeps it, so the text of a
    file and its prepared tokens are the same ids."""
    import gzip
    from types import SimpleNamespace

    import moetrain.inference as inference
    from moetrain.errors import DataError

    encoded = []

    class Tokenizer:
        def token_to_id(self, token):
            return 0

        def encode(self, text):
            encoded.append(text)
            return SimpleNamespace(ids=[1, 2])

    monkeypatch.setattr(inference, "windows_loss", lambda model, cfg, ids_N, **_: {"tokens": len(ids_N)})
    (tmp_path / "crlf.txt").write_bytes(b"one\r\ntwo\r\n")
    inference.text_loss(None, None, Tokenizer(), [str(tmp_path / "crlf.txt")])
    assert encoded == ["one\r\ntwo\r\n"]
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"hello"))
    with pytest.raises(DataError, match="a.txt.gz' is not UTF-8"):
        inference.text_loss(None, None, Tokenizer(), [str(tmp_path / "a.txt.gz")])


def test_a_synthetic_runs_checkpoint_is_named_as_one_not_told_to_get_a_tokenizer(tmp_path, capsys):
    """eval, generate and export-hf of a data.synthetic=true run said "copy the model's own
    tokenizer.json into it", which such a run never had."""
    small = ["--model.d_model=64", "--model.vocab_size=512", "--data.seq_len=32", "--train.global_batch_size=2"]
    small += ["--train.micro_batch_size=2", "--train.eval_every=0", "--logging.plot=false", "--device", "cpu"]
    run = tmp_path / "run"
    assert (
        main(["train", "tiny", "--steps", "1", "--data.synthetic=true", "--run-dir", str(run), "--quiet", *small]) == 0
    )
    capsys.readouterr()
    for command in (["generate", str(run), "--prompt", "x"], ["export-hf", str(run), str(tmp_path / "hf")]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "is of a run on synthetic tokens (data.synthetic=true)" in err and "copy" not in err, err
