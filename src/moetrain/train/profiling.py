"""Where a step's time and memory go: torch.profiler over a window of training steps, and (on
CUDA) an allocator memory snapshot of the same window.

Switched on by `logging.profile=true` (for `train` and `bench`). After `logging.profile_wait` steps
(compilation and allocator warm-up stay outside), `logging.profile_steps` steps are recorded into
OUT_DIR (RUN_DIR/profile for `train`):
  - trace.json: the chrome trace (open in https://ui.perfetto.dev or chrome://tracing): every
    operator and kernel on a timeline, CPU and GPU;
  - ops.txt: the operators sorted by total device time (CPU time on CPU), self and total;
  - kinds.json (CUDA only): device milliseconds per step by kind of kernel (dense GEMM, grouped
    GEMM, attention, AdamW, communication, everything else; `kernel_kinds`), the table
    docs/benchmarks.md keeps; in a rehearsal the stand-in collectives' copies and scales
    (src/moetrain/parallel/rehearsal.py) are taken out of their kinds and listed apart;
  - memory_snapshot.pickle (CUDA only): every allocation of the window with its stack, for
    https://pytorch.org/memory_viz (what is alive at the peak, and who allocated it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule


class StepProfiler:
    """Call `step()` after every training step; the window closes itself."""

    def __init__(
        self,
        out_dir: str | Path,
        wait: int,
        steps: int,
        device: torch.device,
        quiet: bool = False,
        kinds_only: bool = False,
    ):
        """`kinds_only`: write kinds.json alone (no trace, op table or memory snapshot)."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.cuda = device.type == "cuda"
        self.wait, self.steps, self.quiet = wait, steps, quiet
        self.kinds_only = kinds_only
        self.kinds: dict | None = None
        """kinds.json's content, once written."""
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
        if self.cuda and not self.kinds_only:
            torch.cuda.memory._dump_snapshot(str(self.out_dir / "memory_snapshot.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        if not self.quiet:
            print(
                f"profile of steps {self.wait + 1}-{self.wait + self.steps} written to {self.out_dir}", file=sys.stderr
            )

    def _start_memory(self) -> None:
        if self.cuda and not self.kinds_only:
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    def _write_trace(self, prof) -> None:
        averages = prof.key_averages()
        if not self.kinds_only:
            prof.export_chrome_trace(str(self.out_dir / "trace.json"))
            sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            table = averages.table(sort_by=sort_by, row_limit=80, max_name_column_width=60)
            (self.out_dir / "ops.txt").write_text(
                f"torch.profiler, {self.steps} training steps after {self.wait}; sorted by {sort_by}\n{table}\n"
            )
        if self.cuda:
            stand_ins = stand_in_kernels(prof.events())
            self.kinds = {
                "steps": self.steps,
                "ms_per_step": kernel_kinds(averages, self.steps, stand_ins),
                "everything_else_top_ms": top_kernels(averages, self.steps, "everything else", stand_ins),
            }
            (self.out_dir / "kinds.json").write_text(json.dumps(self.kinds) + "\n")


KERNEL_KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("AdamW", ("adamw", "adam")),
    ("grouped GEMM", ("groupproblemshape", "grouped")),
    ("dense GEMM", ("nvjet", "gemm", "xmma", "cutlass", "cublas")),
)
"""Kernel-name fragments (lower case) of each kind, tried in this order: NCCL's kernels first;
grouped GEMMs before dense ones, whose fragments their CUTLASS names also hold
(`GroupProblemShape` marks torch's grouped kernels; FP8 `_scaled_mm` runs as nvjet,
`_scaled_grouped_mm` as CUTLASS grouped)."""

STAND_INS = "stand-in transfers (excluded)"
"""The kinds' entry for a rehearsal's stand-in collectives (not in "total")."""


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((k for k, parts in KERNEL_KINDS if any(p in name for p in parts)), "everything else")


def stand_in_kernels(events) -> dict[str, float]:
    """Device microseconds per kernel name launched inside a rehearsal's stand-in collectives
    (their `rehearsal:OP` profiler ranges, src/moetrain/parallel/rehearsal.py), from the profiler's
    events (`prof.events()`); {} outside a rehearsal."""
    out: dict[str, float] = {}
    seen: set[int] = set()

    def walk(event) -> None:
        if id(event) in seen:
            return
        seen.add(id(event))
        for kernel in event.kernels:
            out[kernel.name] = out.get(kernel.name, 0.0) + kernel.duration
        for child in event.cpu_children:
            walk(child)

    for event in events:
        if event.device_type == torch.autograd.DeviceType.CPU and event.name.startswith("rehearsal:"):
            walk(event)
    return out


def _kernels(averages):
    """The kernels among the profiler's averaged device events, not the operators that launched
    them, nor the GPU timeline's ranges (ProfilerStep#N, Inductor's "## Call CompiledFxGraph …")."""
    for event in averages:
        is_range = getattr(event, "is_user_annotation", False) or event.key.startswith(("## ", "ProfilerStep"))
        if event.device_type == torch.autograd.DeviceType.CUDA and not is_range:
            yield event


def top_kernels(averages, steps: int, kind: str, stand_ins: dict[str, float] | None = None, n: int = 30):
    """The `n` kernels of `kind` that take most device time: {name (120 characters): ms per step}."""
    times: dict[str, float] = {}
    for event in _kernels(averages):
        if kind_of(event.key) != kind:
            continue
        us = event.self_device_time_total - (stand_ins or {}).get(event.key, 0.0)
        times[event.key[:120]] = times.get(event.key[:120], 0.0) + us / 1000 / steps
    top = sorted(times.items(), key=lambda item: -item[1])[:n]
    return {name: round(ms, 2) for name, ms in top}


def kernel_kinds(averages, steps: int, stand_ins: dict[str, float] | None = None) -> dict[str, float]:
    """Device milliseconds per step of every kernel kind in `KERNEL_KINDS`, "everything else"
    and "total" (`_kernels`). `stand_ins` (kernel name → microseconds, `stand_in_kernels`) are
    taken out of their kinds and of the total and given as `STAND_INS`."""
    out = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["everything else"], 0.0)
    for event in _kernels(averages):
        out[kind_of(event.key)] += event.self_device_time_total / 1000 / steps
    excluded = 0.0
    for name, us in (stand_ins or {}).items():
        out[kind_of(name)] -= us / 1000 / steps
        excluded += us / 1000 / steps
    out["total"] = sum(out.values())
    if stand_ins:
        out[STAND_INS] = excluded
    return {k: round(v, 2) for k, v in out.items()}
