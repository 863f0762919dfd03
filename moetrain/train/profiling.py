"""Where a step's time and memory go: torch.profiler over a window of training steps, and (on
CUDA) an allocator memory snapshot of the same window.

Switched on by `train.profile=true` (for `train` and `bench`). After `train.profile_wait` steps
(compilation and allocator warm-up stay outside), `train.profile_steps` steps are recorded into
OUT_DIR (RUN_DIR/profile for `train`):
  - trace.json: the chrome trace (open in https://ui.perfetto.dev or chrome://tracing): every
    operator and kernel on a timeline, CPU and GPU;
  - ops.txt: the operators sorted by total device time (CPU time on CPU), self and total;
  - memory_snapshot.pickle (CUDA only): every allocation of the window with its stack, for
    https://pytorch.org/memory_viz (what is alive at the peak, and who allocated it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule


class StepProfiler:
    """Call `step()` after every training step; the window closes itself."""

    def __init__(self, out_dir: str | Path, wait: int, steps: int, device: torch.device, quiet: bool = False):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.cuda = device.type == "cuda"
        self.wait, self.steps, self.quiet = wait, steps, quiet
        self.seen = 0
        self.done = False
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=max(wait - 1, 0), warmup=1 if wait > 0 else 0, active=steps, repeat=1),
            on_trace_ready=self._write_trace,
            record_shapes=True,
        )
        self.prof.start()
        if wait == 0:
            self._start_memory()

    def step(self) -> None:
        if self.done:
            return
        self.seen += 1
        if self.seen == self.wait:
            self._start_memory()
        self.prof.step()
        if self.seen >= self.wait + self.steps:
            self.close()

    def close(self) -> None:
        if self.done:
            return
        self.done = True
        self.prof.stop()
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.out_dir / "memory_snapshot.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        if not self.quiet:
            print(
                f"profile of steps {self.wait + 1}-{self.wait + self.steps} written to {self.out_dir}", file=sys.stderr
            )

    def _start_memory(self) -> None:
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    def _write_trace(self, prof) -> None:
        prof.export_chrome_trace(str(self.out_dir / "trace.json"))
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=60)
        (self.out_dir / "ops.txt").write_text(
            f"torch.profiler, {self.steps} training steps after {self.wait}; sorted by {sort_by}\n{table}\n"
        )
