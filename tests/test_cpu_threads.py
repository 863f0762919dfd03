"""`moetrain train` on the CPU as one process, without OMP_NUM_THREADS, takes as many intra-op
threads as the cores it may use that other processes leave idle (src/moetrain/train/runtime.py
`cpu_threads`): beside a process that keeps a core busy it takes one fewer, and says so."""

import os
import subprocess
import sys
import time

import pytest
from conftest import tiny_overrides

from moetrain.train.runtime import _idle_and_total, cpu_threads


def test_cores_kept_busy_by_other_processes_are_counted():
    cores = sorted(os.sched_getaffinity(0))
    before, after = _idle_and_total(cores), None
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        after = _idle_and_total(cores)
        threads, may_use, others = cpu_threads()
    finally:
        busy.kill()
        busy.wait()
    assert after[1] > before[1] and may_use == len(cores)
    assert others >= 0.7, others  # the busy loop's core (and whatever else runs here)
    assert 1 <= threads <= max(1, len(cores) - 1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to leave to a busy process")
def test_train_beside_a_busy_core_takes_fewer_threads_and_says_so(real_text_dir, tmp_path):
    flags = [f"--{o}" for o in tiny_overrides(real_text_dir, tmp_path / "run", "train.steps=1", "train.eval_every=0")]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        run = subprocess.run(
            [sys.executable, "-m", "moetrain", "train", "tiny", *flags], env=env, capture_output=True, text=True
        )
    finally:
        busy.kill()
        busy.wait()
    assert run.returncode == 0, run.stderr[-1000:]
    assert "intra-op CPU thread" in run.stderr and "OMP_NUM_THREADS=N" in run.stderr, run.stderr[-1000:]
    explicit = subprocess.run(
        [sys.executable, "-m", "moetrain", "train", "tiny", *flags, "--run-dir", str(tmp_path / "run2")],
        env={**env, "OMP_NUM_THREADS": "2"},
        capture_output=True,
        text=True,
    )
    assert explicit.returncode == 0 and "intra-op CPU thread" not in explicit.stderr, explicit.stderr[-1000:]
