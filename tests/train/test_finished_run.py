"""`--resume` of a run that reached its last step says so and changes nothing."""

import json

import pytest
from conftest import tiny_overrides

from moetrain.cli import main


def snapshot(path):
    """Every file of the run but run.lock, which names whichever process holds the directory now."""
    files = [p for p in path.rglob("*") if p.is_file() and p.name != "run.lock"]
    return {str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def train(data_dir, run, *extra):
    args = ["train", "tiny", *[f"--{o}" for o in tiny_overrides(data_dir, run, "train.steps=2", *extra)], "--quiet"]
    return main(args)


def test_resuming_a_finished_run_reports_it_and_changes_nothing(real_text_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(real_text_dir, run) == 0
    finished = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert finished["final_val_loss"] is not None
    before = snapshot(run)
    assert train(real_text_dir, run) == 2  # without --resume: refused, as before (it holds checkpoints)
    capsys.readouterr()

    args = ["train", "tiny", *[f"--{o}" for o in tiny_overrides(real_text_dir, run, "train.steps=2")], "--quiet"]
    assert main([*args, "--resume"]) == 0
    out, err = capsys.readouterr()
    assert "already finished at step 2" in err and "nothing changed" in err, err
    assert json.loads(out.strip().splitlines()[-1]) == finished  # the same summary, final_val_loss kept
    assert snapshot(run) == before  # not a byte nor a timestamp changed


def test_a_finished_run_killed_before_its_summary_gets_one(real_text_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(real_text_dir, run) == 0
    finished = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (run / "summary.json").unlink()  # killed between the last checkpoint and the summary
    args = ["train", "tiny", *[f"--{o}" for o in tiny_overrides(real_text_dir, run, "train.steps=2")], "--quiet"]
    assert main([*args, "--resume"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["final_val_loss"] == finished["final_val_loss"] is not None
    assert json.loads((run / "summary.json").read_text()) == summary


def test_a_torn_summary_stops_neither_a_resume_nor_a_plot(real_text_dir, tmp_path, capsys):
    """summary.json cut short (a disk that filled while it was written) reads as none: `--resume`
    and `plot` go on instead of ending in json's traceback; it is written whole again (a temporary
    file renamed into place)."""
    run = tmp_path / "run"
    assert train(real_text_dir, run) == 0
    whole = (run / "summary.json").read_bytes()
    (run / "summary.json").write_bytes(whole[: len(whole) // 2])
    capsys.readouterr()
    assert main(["plot", str(run), "--out", str(tmp_path / "loss.png")]) == 0, capsys.readouterr().err
    args = ["train", "tiny", *[f"--{o}" for o in tiny_overrides(real_text_dir, run, "train.steps=4")], "--quiet"]
    assert main([*args, "--resume"]) == 0, capsys.readouterr().err
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert [p.name for p in run.iterdir() if "summary" in p.name] == ["summary.json"]


def test_a_run_killed_after_step_0_keeps_its_step_0_loss_and_a_resume_measures_no_other(
    real_text_dir, tmp_path, capsys
):
    """Step 0's validation loss is in summary.json as soon as it is measured, so a run killed
    before its end keeps it; a resume that finds none does not measure the resumed weights and
    call them step 0's."""
    from moetrain.presets import resolve_config
    from moetrain.train.trainer import Trainer

    run = tmp_path / "run"
    trainer = Trainer(resolve_config("tiny", tiny_overrides(real_text_dir, run, "train.steps=2", "train.eval_every=2")))

    def killed():
        raise KeyboardInterrupt

    trainer.train_step = killed
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    first = json.loads((run / "summary.json").read_text())["initial_val_loss"]
    trainer.run.release()
    assert train(real_text_dir, run, "train.eval_every=2") == 0  # from step 0 again: nothing was saved
    args = ["train", "tiny", *[f"--{o}" for o in tiny_overrides(real_text_dir, run, "train.steps=4")], "--quiet"]
    assert main([*args, "--train.eval_every=2", "--resume"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["initial_val_loss"] == first
    (run / "summary.json").unlink()
    assert main([*args, "--train.eval_every=2", "--train.steps=6", "--resume"]) == 0
    assert "initial_val_loss" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
