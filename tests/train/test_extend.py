"""A run resumed with another train.steps (issue 32, item 1): by default the learning-rate
schedule stays the one the run planned and the steps past its end run at its final rate;
`--train.extend=replan` plans it over the new count. The resume says which, with the rates, and
a second extension still follows the first plan. Through the command line, as typed."""

import json
import subprocess
import sys

import pytest
from conftest import tiny_overrides

from moetrain.optim.schedule import lr_at
from moetrain.presets import resolve_config
from moetrain.train.metrics import read_metrics


def train(data_dir, run_dir, steps: int, *extra: str, resume: bool = True) -> subprocess.CompletedProcess:
    flags = [f"--{o}" for o in tiny_overrides(data_dir, run_dir, "train.eval_every=0", *extra)]
    argv = [sys.executable, "-m", "moetrain", "train", "tiny", *flags, "--steps", str(steps), "--device", "cpu"]
    argv += ["--resume"] if resume else []
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def lrs(run_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(run_dir / "metrics.jsonl")}


@pytest.mark.parametrize("extend", ["keep", "replan"])
def test_moetrain_train_resume_with_more_steps_follows_the_schedule_it_says(real_text_dir, tmp_path, extend):
    run = tmp_path / "run"
    train(real_text_dir, run, 12, resume=False)
    flags = [] if extend == "keep" else ["train.extend=replan"]
    out = train(real_text_dir, run, 20, *flags, "checkpoint.save_every=4")
    schedule = resolve_config("tiny", tiny_overrides(real_text_dir, run)).schedule
    peak = resolve_config("tiny", tiny_overrides(real_text_dir, run)).optim.lr
    planned = 12 if extend == "keep" else 20
    got = lrs(run)
    assert sorted(got) == list(range(1, 21))
    for step in range(13, 21):  # metrics.jsonl's step s used the rate of optimizer step s - 1
        assert got[step] == pytest.approx(lr_at(step - 1, planned, peak, schedule), rel=1e-9), step
    verb = "stays" if extend == "keep" else "is planned again"
    assert f"--resume from step 12: train.steps=20, the run planned 12: the schedule {verb}" in out.stderr
    if extend == "keep":  # past the plan's end: its final rate; a second extension keeps the first plan
        assert got[20] == pytest.approx(lr_at(11, 12, peak, schedule))
        train(real_text_dir, run, 24)
        assert lrs(run)[24] == pytest.approx(lr_at(23, 12, peak, schedule))
    else:  # the rate jumps back up at the resumed step, as the message says
        assert got[13] > got[12]


def test_a_resume_without_a_changed_step_count_says_nothing_about_the_schedule(real_text_dir, tmp_path):
    run = tmp_path / "run"
    train(real_text_dir, run, 12, "checkpoint.save_every=6", resume=False)
    (run / "checkpoints" / "step-12").rename(tmp_path / "step-12")
    out = train(real_text_dir, run, 12, "checkpoint.save_every=6")
    assert "train.steps" not in out.stderr and "resumed from" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 12


def test_a_run_that_ends_inside_its_warm_up_says_so_and_keeps_its_last_rate_when_extended(real_text_dir, tmp_path):
    """4 steps with a warm-up of 10: the start-up says the rate never leaves the warm-up; resumed
    to 6 steps (train.extend=keep), steps 5 and 6 run at the rate of step 4, not at a rate that
    goes on rising, and the message names step 5 as the first step run."""
    run = tmp_path / "run"
    warmup = "schedule.warmup_steps=10"
    out = train(real_text_dir, run, 4, warmup, resume=False)
    assert "the schedule's 4 steps end inside its warm-up of 10 (schedule.warmup_steps)" in out.stderr
    out = train(real_text_dir, run, 6, warmup)
    cfg = resolve_config("tiny", tiny_overrides(real_text_dir, run, warmup))
    last = lr_at(3, 4, cfg.optim.lr, cfg.schedule)
    assert last == pytest.approx(0.4 * cfg.optim.lr)
    got = lrs(run)
    assert got[4] == got[5] == got[6] == pytest.approx(last, rel=1e-9)
    assert (
        "--resume from step 4: train.steps=6, the run planned 4: "
        "the schedule stays the one planned over 4 steps (train.extend=keep): "
        f"step 5 runs at {last:.3g}" in out.stderr
    )
