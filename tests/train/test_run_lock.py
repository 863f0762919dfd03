"""One live run owns a run directory: a second training on it is refused before it touches
anything, naming the live run; a killed run does not keep it; under torchrun every rank of the
refused launch stops with the same message."""

import errno
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_overrides

from moetrain.train import run_lock
from moetrain.train.metrics import read_metrics
from moetrain.train.run_dir import RunDir
from moetrain.train.trainer import Trainer


def launch(data_dir, run_dir, *extra, resume=False, world=1, cwd=None):
    flags = [f"--{o}" for o in tiny_overrides(data_dir, run_dir, "train.eval_every=0", *extra)]
    cmd = ["-m", "moetrain", "train", "tiny", *flags, "--quiet", *(["--resume"] if resume else [])]
    if world > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", *cmd]
        cmd.append(f"--parallel.dp={world}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
        start_new_session=True,
    )  # fmt: skip


def wait_for(predicate, proc, timeout=180.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first run made no progress"
        time.sleep(0.05)


def kill(proc):
    """SIGKILL the launch and, under torchrun, its workers (each in a session of its own)."""
    workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == proc.pid]
    for pid in [proc.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _parent(proc_dir):
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def steps_logged(run_dir):
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] if (run_dir / "metrics.jsonl").is_file() else []


def test_a_second_run_is_refused_while_the_first_lives_and_takes_over_after_kill_9(real_text_dir, tmp_path):
    run = tmp_path / "run"
    first = launch(real_text_dir, run, "train.steps=100000", "checkpoint.save_every=2")
    try:
        wait_for(lambda: (run / "checkpoints" / "step-2" / "COMPLETE").is_file(), first)
        second = launch(real_text_dir, run, "train.steps=100000", "checkpoint.save_every=2", resume=True)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err[-3000:]
        assert f"pid {first.pid} on host {socket.gethostname()}" in err and "--run-dir" in err, err
        assert "Traceback" not in err and "kill" in err, err
        assert first.poll() is None  # the live run goes on, its log one run's
        wait_for(lambda: len(steps_logged(run)) >= 8, first)
        logged = steps_logged(run)
        assert logged == list(range(1, len(logged) + 1))
        saved = json.loads((run / "run.lock").read_text())
        assert saved["pid"] == first.pid and "moetrain train tiny" in saved["command"]
    finally:
        kill(first)
    newest = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*[0-9]"))
    third = launch(real_text_dir, run, f"train.steps={newest + 2}", "checkpoint.save_every=2", resume=True)
    _, err = third.communicate(timeout=180)
    assert third.returncode == 0, err[-3000:]
    assert steps_logged(run)[-2:] == [newest + 1, newest + 2]


def test_resume_without_run_dir_is_refused_and_a_fresh_run_takes_the_next_name(real_text_dir, tmp_path):
    first = launch(real_text_dir, "null", "train.steps=100000", cwd=tmp_path)
    try:
        wait_for(lambda: len(steps_logged(tmp_path / "runs" / "tiny")) >= 2, first)
        resumed = launch(real_text_dir, "null", "train.steps=4", resume=True, cwd=tmp_path)
        _, err = resumed.communicate(timeout=120)
        assert resumed.returncode == 2 and "runs/tiny' is in use by a live run" in err, err[-3000:]
        fresh = launch(real_text_dir, "null", "train.steps=2", cwd=tmp_path)
        _, err = fresh.communicate(timeout=120)
        assert fresh.returncode == 0, err[-3000:]
        assert steps_logged(tmp_path / "runs" / "tiny-2") == [1, 2]
        assert (tmp_path / "runs" / "tiny-2" / "run.lock").read_text() == ""  # ended: it names nobody
    finally:
        kill(first)


def test_under_torchrun_every_rank_of_the_second_launch_stops_with_the_owner(real_text_dir, tmp_path):
    run = tmp_path / "run"
    first = launch(real_text_dir, run, "train.steps=100000", world=2)
    try:
        wait_for(lambda: len(steps_logged(run)) >= 2, first)
        owner = json.loads((run / "run.lock").read_text())
        second = launch(real_text_dir, run, "train.steps=100000", world=2, resume=True)
        _, err = second.communicate(timeout=180)
        assert second.returncode != 0
        # one refusal per rank; torchrun's threads that copy the ranks' output may interleave them
        assert err.count("error: Run directory") == 2 and f"pid {owner['pid']} on host" in err, err[-3000:]
        assert "a collective failed" not in err, err[-3000:]  # rank 1 is told, not left waiting on rank 0
        assert first.poll() is None
    finally:
        kill(first)


@pytest.mark.parametrize("no_flock", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_without_flock_the_run_goes_on_and_says_so(tmp_path, monkeypatch, capsys, no_flock):
    def refuse(fd, op):
        raise OSError(no_flock, os.strerror(no_flock))

    monkeypatch.setattr(run_lock.fcntl, "flock", refuse)
    run_lock.acquire(tmp_path)
    assert "has no flock" in capsys.readouterr().err
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    run_lock.release(tmp_path)
    assert tmp_path.resolve() not in run_lock._held


def test_a_run_refused_at_start_up_removes_what_taking_its_directory_created(tiny_cfg, tmp_path):
    missing_data = ["data.sources=[/nonexistent/data]"]
    with pytest.raises(Exception, match="nonexistent"):
        Trainer(tiny_cfg(tmp_path / "new" / "run", *missing_data), quiet=True)
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    with pytest.raises(Exception, match="nonexistent"):
        Trainer(tiny_cfg(tmp_path / "old", *missing_data), quiet=True)
    assert list((tmp_path / "old").iterdir()) == []


def test_one_process_takes_a_directory_it_holds_again(tmp_path):
    """A second `RunDir` on a directory this process holds counts a holder; the lock goes with the
    last one, released or collected."""
    key = (tmp_path / "run").resolve()
    first = RunDir(tmp_path / "run", main=True)
    second = RunDir(tmp_path / "run", main=True)
    assert json.loads((tmp_path / "run" / "run.lock").read_text())["pid"] == os.getpid()
    second.abandon()  # made nothing: the first still holds the directory
    assert (tmp_path / "run" / "run.lock").is_file() and key in run_lock._held
    first.abandon()
    assert not (tmp_path / "run").exists() and key not in run_lock._held
    third = RunDir(tmp_path / "run", main=True)
    assert key in run_lock._held
    del third  # a Trainer let go of in a notebook: its directory is free again
    gc.collect()
    assert key not in run_lock._held and (tmp_path / "run" / "run.lock").read_text() == ""
