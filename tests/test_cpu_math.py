"""The CPU's vector math gives its first call's results as accurately as any later call's
(src/moetrain/cpu_math.py): without the set-up at import, a fresh process's first sqrt over two
threads came out off by up to 3e-4 in 2 to 4 of every 16 processes on the 2-core machine."""

import subprocess
import sys

import pytest
import torch

FIRST_CALLS = r"""
import sys
import torch
import {module}
assert "moetrain.cpu_math" in sys.modules  # the modules whose CPU math this concerns set it up on import
x = torch.rand(5000, generator=torch.Generator().manual_seed(0)) * 0.01 + 1e-4
first_sqrt, first_exp = torch.sqrt(x), torch.exp(x)
for got, want in ((first_sqrt, x.double().sqrt()), (first_exp, x.double().exp())):
    off = ((got.double() - want).abs() / want).max().item()
    assert off < 1e-6, off
print("ok")
"""


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL: no vector math library")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one intra-op thread: no race")
def test_a_fresh_processs_first_sqrt_and_exp_are_accurate():
    # one process at a time: the race shows where a process's threads have the cores to themselves
    # (without the set-up, 4 of 12 such processes failed here; 0 of 8 run side by side)
    # the first process imports what the optimizers import; the others the set-up alone (a second less each)
    for module in ["moetrain.optim.base"] + ["moetrain.cpu_math"] * 7:
        code = FIRST_CALLS.format(module=module)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert run.stdout.strip() == "ok", run.stderr[-500:]
