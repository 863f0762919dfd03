"""What a run prints on stderr (rank 0, not under --quiet): the start-up header (once the run is
built and nothing can refuse it any more, so a user mistake stays one paragraph), then one line
per logged step, or a progress bar on a terminal (docs/architecture.md, "Counting and FLOPs"):

    run dir   : runs/tiny-2 (runs/tiny holds an earlier run)
    layout    : 4 ranks: dp2·ep2·pp2 ddp nosync(cf 1.25 + spill 0.125)
    device    : cpu; precision fp32
    step  10/300  loss 8.2803  lr 3.00e-04  2,612 tok/s  1176 ms/step  rss 0.61 GiB  ETA 5m41s
"""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path
from typing import Any

import torch

from moetrain.model import fp8_choice
from moetrain.model.config import Fp8
from moetrain.parallel.dims import ParallelDims
from moetrain.train.config import CudaGraphs, RunConfig
from moetrain.train.engine import autocast_dtype
from moetrain.train.metrics import MetricsSink


def format_duration(seconds: float) -> str:
    """45s, 12m05s, 1h02m, 27h00m: two units at most, rounded to the smaller one."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    m = round(seconds / 60)
    return f"{m // 60}h{m % 60:02d}m"


class StepTimer:
    """Seconds per step over the last `windows` logged windows (a window: the steps between two
    logged ones). The first window of a `fit` (compilation, warm-up) counts only until another
    one is measured."""

    def __init__(self, windows: int = 5):
        self.first: tuple[float, int] | None = None
        self.recent: deque[tuple[float, int]] = deque(maxlen=windows)

    def add(self, seconds: float, steps: int) -> None:
        if self.first is None and not self.recent:
            self.first = (seconds, steps)
        else:
            self.recent.append((seconds, steps))

    def seconds_per_step(self) -> float | None:
        windows = self.recent or ([self.first] if self.first else [])
        steps = sum(n for _, n in windows)
        return sum(s for s, _ in windows) / steps if steps else None


def step_fields(record: dict[str, Any], ms_per_step: float | None, eta_s: float | None, mem_label: str) -> str:
    """The step line after its step counter (docs/architecture.md, "Counting and FLOPs")."""
    fields = [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}", f"{record['tokens_per_sec']:,.0f} tok/s"]
    if ms_per_step is not None:
        fields.append(f"{ms_per_step:.0f} ms/step" if ms_per_step >= 100 else f"{ms_per_step:.1f} ms/step")
    if record.get("mfu") is not None:
        fields.append(f"MFU {100 * record['mfu']:.1f}%")
    if record.get("peak_mem_gib") is not None:
        fields.append(f"{mem_label} {record['peak_mem_gib']:.2f} GiB")
    if eta_s is not None:
        fields.append(f"ETA {format_duration(eta_s)}")
    if record.get("val_loss") is not None:
        fields.append(f"val_loss {record['val_loss']:.4f}")
    if record.get("dropped_token_frac"):  # never silent: the sync-free dispatcher's capacity overflowed
        fields.append(f"dropped {100 * record['dropped_token_frac']:.2f}% of expert assignments")
    return "  ".join(fields)


class ConsoleSink(MetricsSink):
    """The logged records' `step_fields` after step `start` of `total`: a tqdm bar (without tqdm's
    own estimate, which counts evaluation in) on a terminal, else a line per logged step."""

    def __init__(self, start: int, total: int, quiet: bool = False, device_type: str = "cpu"):
        self.quiet, self.total = quiet, total
        self.mem_label = "mem" if device_type == "cuda" else "rss"
        self.timer = StepTimer()
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=start,
                unit="step",
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            )
        self.last = start

    def update(self, step: int, record: dict[str, Any] | None, window: tuple[float, int] | None = None) -> None:
        """After step `step`; on logged steps its `record` and the `window` (seconds, steps)
        the record's rates cover."""
        ms_per_step = eta_s = None
        if window is not None and window[1] > 0:
            self.timer.add(*window)
            ms_per_step = 1000 * window[0] / window[1]
            if step < self.total:  # the timer holds a window now
                eta_s = self.timer.seconds_per_step() * (self.total - step)
        if self.bar is not None:
            self.bar.update(step - self.last)
            if record is not None:
                self.bar.set_postfix_str(step_fields(record, ms_per_step, eta_s, self.mem_label))
        elif record is not None and not self.quiet:
            width = len(str(self.total))
            print(
                f"step {step:>{width}}/{self.total}  {step_fields(record, ms_per_step, eta_s, self.mem_label)}",
                file=sys.stderr,
                flush=True,
            )
        self.last = step

    def step_done(self, step: int) -> None:
        self.update(step, None)

    def write(self, record: dict[str, Any], window: tuple[float, int]) -> None:
        self.update(record["step"], record, window)

    def close(self, failed: bool = False) -> None:
        if self.bar is not None:
            self.bar.close()


def describe_layout(dims: ParallelDims) -> str:
    """`4 ranks: dp2·ep2·pp2 ddp nosync(cf 1.25 + spill 0.125) sharded-optimizer` (`ParallelDims.describe`)."""
    return f"{dims.world_size} rank{'s' if dims.world_size > 1 else ''}: {dims.describe()}"


def describe_precision(cfg: RunConfig, device: torch.device, world_size: int = 1) -> str:
    """fp32; bf16 autocast (fp32 weights); bf16 weights (fp32 masters); then the FP8 recipe, and
    the speed switches (compute.cuda_graphs as a run of `world_size` ranks resolves it)."""
    amp = autocast_dtype(cfg.precision.dtype, device)
    if amp is None:
        text = "fp32"
    elif cfg.optim.resolved_bf16_weights(cfg.parallel, amp, device):
        text = "bf16 weights (fp32 masters in the optimizer)"
    else:
        text = "bf16 autocast (fp32 weights)"
    if cfg.precision.fp8 == Fp8.rowwise:
        rows, select = cfg.rows_per_micro_batch, cfg.precision.fp8_select
        text += f", fp8 rowwise on {fp8_choice.describe(cfg.model, rows, select)}"
        text += "; and the LM head (precision.fp8_lm_head)" if cfg.fp8_lm_head else ""
        any_fp8 = cfg.fp8_lm_head or fp8_choice.chosen_products(cfg.model, rows, select)
        text += "; fast accumulation in backward too" if cfg.fp8_fast_backward and any_fp8 else ""
    elif cfg.precision.fp8 != Fp8.none:
        text += f", fp8 {cfg.precision.fp8} matrix products"
    if cfg.defers_expert_weight_grads:
        text += "; expert weight gradients once per step (compute.defer_expert_weight_grad)"
    graphs, why = cfg.cuda_graphs_choice(world_size, device)
    if graphs == CudaGraphs.step:
        text += "; the training step replayed from a CUDA graph after 3 eager steps (compute.cuda_graphs"
        text += f"=auto: {why})" if why else ")"
    elif why and device.type == "cuda":  # elsewhere auto has nothing to choose
        text += f"; no CUDA graph (compute.cuda_graphs=auto: {why})"
    return text


def header(
    cfg: RunConfig,
    dims: ParallelDims,
    device: torch.device,
    run_dir: Path,
    note: str = "",
    rehearsed_rank: int | None = None,
) -> str:
    """The start-up lines (module docstring); `note` says why the run directory is that one;
    `rehearsed_rank`: this process is that rank of a rehearsal (`rehearsal_notice`)."""
    lines = [
        f"run dir   : {run_dir}" + (f" ({note})" if note else ""),
        f"layout    : {describe_layout(dims)}",
        f"device    : {device}; precision {describe_precision(cfg, device, dims.world_size)}",
    ]
    if rehearsed_rank is not None:
        lines.append(f"REHEARSAL : {rehearsal_notice(dims, rehearsed_rank)}")
    return "\n".join(lines)


def rehearsal_notice(dims: ParallelDims, rank: int) -> str:
    """What a rehearsal is and is not, in one line (the console header's and bench's)."""
    return (
        f"rank {rank} of {dims.world_size} runs alone on this device; its {dims.world_size - 1} peers are stand-ins "
        "(src/moetrain/parallel/rehearsal.py): compute, memory and this rank's checkpoint files are real, "
        "communication is NOT measured"
    )
