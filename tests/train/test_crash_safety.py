"""Nothing completed is lost: a run killed with SIGKILL at random moments (one of them while a
checkpoint is being written) and resumed each time ends bit for bit where an uninterrupted run
ends; SIGTERM stops after the current step with a checkpoint and exit code 0."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import tiny_overrides

from moetrain.train.metrics import read_metrics

STEPS = 14


def overrides(data_dir, run_dir, *extra):
    return [
        f"--{o}"
        for o in tiny_overrides(
            data_dir,
            run_dir,
            f"train.steps={STEPS}",
            "checkpoint.save_every=2",
            "train.eval_every=0",
            "checkpoint.keep_last=2",
            *extra,
        )
    ]


def start(data_dir, run_dir, resume=False, world=1, extra=()):
    cmd = [sys.executable, "-m", "moetrain", "train", "tiny", *overrides(data_dir, run_dir, *extra), "--quiet"]
    if resume:
        cmd.append("--resume")
    if world > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            "-m",
            "moetrain",
            *cmd[3:],
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )


def wait_for(predicate, proc, timeout=120.0):
    """Poll until `predicate()` or the process ends; True if the predicate held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return predicate()
        time.sleep(0.002)
    raise TimeoutError("the training process made no progress")


def kill(proc):
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: torchrun's workers too
    proc.wait()


def saving(run_dir):
    ckpts = run_dir / "checkpoints"
    return ckpts.is_dir() and any(p.name.endswith(".tmp") for p in ckpts.iterdir())


def logged(run_dir):
    """Steps in metrics.jsonl; 0 while there is none (a resume with no complete checkpoint
    deletes the stale one before it starts over)."""
    path = run_dir / "metrics.jsonl"
    try:
        return len(read_metrics(path))
    except FileNotFoundError:
        return 0


def run_with_kills(data_dir, run_dir, kills, seed, world=1, extra=()):
    rng = random.Random(seed)
    done = 0
    while True:
        proc = start(data_dir, run_dir, resume=done > 0, world=world, extra=extra)
        if done == kills:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            return
        if done == 0:
            hit = wait_for(lambda: saving(run_dir), proc)  # inside a checkpoint write
        else:
            target = logged(run_dir) + rng.randint(1, 3)
            hit = wait_for(lambda target=target: logged(run_dir) >= target, proc)
            time.sleep(rng.uniform(0, 0.08))  # somewhere inside the next step (or its save)
        if proc.poll() is not None:
            out, err = proc.communicate()
            assert proc.returncode == 0, err[-3000:]
            pytest.fail(f"the run finished before kill {done + 1} could land (hit={hit})")
        kill(proc)
        done += 1


def kill_rank_1_after_step_4(proc, run_dir, timeout, hung):
    """Once step-4 is checkpointed and step 5 logged, SIGKILL the second torchrun worker; wait for
    the launcher to end. Returns (its stderr, seconds from the kill to the end)."""
    wait_for(lambda: (run_dir / "checkpoints" / "step-4" / "COMPLETE").is_file() and logged(run_dir) >= 5, proc)
    workers = children(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    started = time.monotonic()
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        pytest.fail(hung)
    return err, time.monotonic() - started


def assert_same_steps(reference, run):
    """Every step logged once, with the uninterrupted run's loss and gradient norm bit for bit."""
    want, got = read_metrics(reference / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        assert (a["lm_loss"], a["grad_norm"]) == (b["lm_loss"], b["grad_norm"]), a["step"]


@pytest.fixture(scope="module")
def reference(real_text_dir, tmp_path_factory):
    """Factory: `reference(world)` starts (once per module) the uninterrupted run at `world`
    ranks and returns a function that waits for it and gives its run directory. The tests that
    compare against it share it (read only; the async-checkpoint case's reference is the plain
    run too: background writes change nothing in what is computed). One process leaves a core
    free, so a test may start it, then run its own processes beside it."""
    runs = {}

    def get(world):
        if world not in runs:
            run_dir = tmp_path_factory.mktemp(f"reference-world{world}") / "reference"
            runs[world] = [start(real_text_dir, run_dir, world=world), run_dir, None]

        def wait():
            entry = runs[world]
            if entry[2] is None:
                _, err = entry[0].communicate(timeout=300)
                entry[2] = (entry[0].returncode, err[-3000:])
            assert entry[2][0] == 0, entry[2][1]
            return entry[1]

        return wait

    yield get
    for proc, _, _ in runs.values():
        if proc.poll() is None:
            kill(proc)


def final_state(run_dir):
    from moetrain.inference import load_for_inference

    model, _, _ = load_for_inference(run_dir)
    return model.state_dict()


@pytest.mark.parametrize("world, kills, extra", [(1, 6, ()), (2, 3, ()), (1, 4, ("checkpoint.async_save=true",))])
def test_sigkill_at_random_moments_then_resume_is_bit_exact(real_text_dir, reference, tmp_path, world, kills, extra):
    """Synchronous checkpoints in one process and with two ranks; background (async) writes."""
    wait_for_reference, killed = reference(world), tmp_path / "killed"
    if world > 1:  # two ranks already take both cores; one process runs beside the kills
        wait_for_reference()

    run_with_kills(real_text_dir, killed, kills=kills, seed=world + len(extra), world=world, extra=extra)
    reference = wait_for_reference()

    want, got = read_metrics(reference / "metrics.jsonl"), read_metrics(killed / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        for key in ("loss", "lm_loss", "grad_norm", "lb_loss", "z_loss", "lr", "expert_load_max_over_mean"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    ref_state, state = final_state(reference), final_state(killed)
    for key, value in ref_state.items():
        assert torch.equal(value, state[key]), key
    # No partial checkpoint is left visible, and retention kept the newest two.
    names = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert names == [f"step-{STEPS - 2}", f"step-{STEPS}"], names


def children(pid):
    """Direct child processes of `pid` (torchrun's workers), from /proc."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


@pytest.mark.parametrize("world", [1, 2])
def test_sigterm_saves_and_exits_cleanly_then_resume_finishes(real_text_dir, tmp_path, world):
    """One process, or two ranks under torchrun each sent SIGTERM (as a cluster scheduler does):
    the step finishes, every rank saves, the exit code is 0, and --resume finishes the run."""
    run_dir = tmp_path / "run"
    proc = start(real_text_dir, run_dir, world=world)
    wait_for(lambda: logged(run_dir) >= 3, proc)
    for pid in children(proc.pid) if world > 1 else [proc.pid]:
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    stopped = summary["stopped_at_step"]
    assert 3 <= stopped < STEPS
    assert f"stopped by SIGTERM after step {stopped}" in err and "--resume" in err
    assert (run_dir / "checkpoints" / f"step-{stopped}" / "COMPLETE").is_file()

    proc = start(real_text_dir, run_dir, resume=True, world=world)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    # finished now: neither the final line nor summary.json keeps the earlier stop
    assert "stopped_at_step" not in json.loads(out.strip().splitlines()[-1])
    assert "stopped_at_step" not in json.loads((run_dir / "summary.json").read_text())


def test_a_killed_rank_makes_the_other_fail_fast_and_resume_is_bit_exact(real_text_dir, reference, tmp_path):
    """One of two torchrun ranks is SIGKILLed mid-run: the other fails at once with one line
    (its peer is gone) instead of waiting out a collective timeout; `--resume` then continues
    from the last checkpoint and ends exactly where an uninterrupted run ends."""
    reference, run = reference(2)(), tmp_path / "run"

    proc = start(real_text_dir, run, world=2)
    err, seconds = kill_rank_1_after_step_4(proc, run, timeout=120, hung="the surviving rank hung after its peer died")
    assert proc.returncode != 0 and seconds < 60
    assert "error: rank 0: a collective failed because rank 1 is gone" in err, err[-3000:]

    proc = start(real_text_dir, run, resume=True, world=2)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert_same_steps(reference, run)


def test_a_rank_killed_under_torchrun_max_restarts_resumes_bit_exact(real_text_dir, reference, tmp_path):
    """torchrun --max-restarts=1 with --resume: one of two ranks is SIGKILLed mid-run; the other
    fails fast naming it, torchrun restarts both, they resume from the last checkpoint and the run
    ends exactly where an uninterrupted one does."""
    reference, run = reference(2)(), tmp_path / "run"

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.2",
        "-m",
        "moetrain",
        "train",
        "tiny",
        *overrides(real_text_dir, run),
        "--quiet",
        "--resume",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    err, seconds = kill_rank_1_after_step_4(proc, run, timeout=300, hung="the restarted run did not finish")
    assert proc.returncode == 0, err[-5000:]
    assert seconds < 150  # no collective timeout was waited out
    assert "error: rank 0: a collective failed because rank 1 is gone" in err, err[-3000:]
    assert_same_steps(reference, run)
