"""The CPU's element-wise math, set up on every intra-op thread before its first real use.

torch's CPU wheels compute sqrt, exp and the other element-wise math functions through MKL's
vector math library, split over the intra-op threads from 2,048 elements a thread. A process's
first such call sometimes gives the second thread's share at reduced accuracy (measured on the
2-core development machine, torch 2.13.0+cpu, processes run one at a time: a 5,000-element sqrt
off by up to 3e-4 relative from element 2,500 on in 2 of 16 and 4 of 12 fresh processes, exp in
4 of 16; every later call right): a race in the library's per-thread set-up. So AdamW's first
step on the CPU, and the kernel checks that compare against it, could differ from run to run.
Importing this module makes one call over every thread and drops its result; after it none of
16 processes gave a first sqrt, nor 16 a first exp, off by more than 1e-6
(tests/test_cpu_math.py checks it; docs/reliability.md, "The CPU's math is the same from the
first call").
"""

from __future__ import annotations

import torch

_ELEMENTS_PER_THREAD = 2048
"""What the vector math library's calls hand each intra-op thread at least."""


def warm_vector_math() -> None:
    """One element-wise math call large enough to run on every intra-op thread (its result
    dropped): the library sets each thread up now, not inside a call whose result is kept."""
    if torch.backends.mkl.is_available():
        torch.sqrt(torch.ones(2 * _ELEMENTS_PER_THREAD * torch.get_num_threads()))


warm_vector_math()
