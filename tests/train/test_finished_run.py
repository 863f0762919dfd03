"""`--resume` of a run that reached its last step says so and changes nothing."""

import json

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
