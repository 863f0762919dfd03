"""The fixed-seed CPU losses, pinned to a named commit (tests/train/numerics_pin.json).

A numerics fingerprint compared only with the commit before cannot see a drift that comes one
commit at a time. This test runs the pin's command (the embedded corpus prepared as `make train`
prepares it, then 20 steps of `tiny`) and compares every step's `lm_loss` and `grad_norm` with
the pinned values bit for bit. The pin changes only in a commit that says why (its `why` names
the change that moved it). CPU kernels round differently across torch versions and vector
instruction sets, so the comparison needs the pin's torch and CPU capability; elsewhere it skips,
saying which differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PIN = Path(__file__).with_name("numerics_pin.json")


def test_fixed_seed_cpu_losses_equal_the_pinned_commits(tmp_path):
    pin = json.loads(PIN.read_text())
    here = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if any(here[k] != pin[k] for k in here):
        pytest.skip(f"the pin was taken with torch {pin['torch']} on {pin['cpu_capability']}; this is {here}")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    data, run = tmp_path / "data", tmp_path / "run"
    prepare = [sys.executable, "-m", "moetrain", "prepare-data", "--default-corpus", "--out", str(data)]
    subprocess.run(prepare, env=env, check=True, capture_output=True, timeout=300)
    train = [sys.executable, "-m", "moetrain", *pin["argv"], "--run-dir", str(run), f"--data.sources=[{data}]"]
    done = subprocess.run(train, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    got = {"lm_loss": [r["lm_loss"] for r in records], "grad_norm": [r["grad_norm"] for r in records]}
    for key, values in got.items():
        first = next((i + 1 for i, (a, b) in enumerate(zip(values, pin[key])) if a != b), len(values) + 1)
        assert values == pin[key], (
            f"{key} differs from the pin of {pin['commit']} from step {first} on; if the change is meant, update "
            f"{PIN.name} in a commit that says why. Now: {values}"
        )
