"""Step metrics: throughput, FLOPs/MFU, memory and real expert load, and the sinks they are written to
(metrics.jsonl, TensorBoard; W&B in src/moetrain/train/wandb_sink.py, the console in console.py).

The metrics.jsonl contract (one JSON object per logged step; keys never renamed):
  step, loss, lm_loss, lb_loss, z_loss, lr, grad_norm, tokens_per_sec, tokens_per_sec_per_device,
  tflops_per_device, mfu, peak_mem_gib, expert_load_max_over_mean, dropped_token_frac,
  unused_experts, and val_loss on evaluation steps.
- loss: the optimized objective, lm_loss + Σ_layers (lb_weight·lb + z_weight·z)
  (+ model.mtp_loss_weight · mtp_loss with multi-token prediction).
- lb_loss / z_loss: unweighted, averaged over MoE layers and micro-batches (lb = 1 is balanced).
- tokens_per_sec: tokens of all ranks per second of wall time, averaged since the last log.
- tflops_per_device: flops_per_token × tokens_per_sec_per_device (Olmo-core's formula);
  mfu: that over the device's dense BF16 peak; null on CPU and unknown GPUs.
- peak_mem_gib: torch.cuda.max_memory_allocated on GPU, the process's peak RSS on CPU; with
  compute.cuda_graphs=step, plus the graph's memory the allocator does not count.
- expert_load_max_over_mean: worst MoE layer's max/mean tokens per expert over the step.
- expert_load_by_layer (extra): that ratio of each MoE layer, in layer order.
- ep_load_max_over_mean (extra): the same per expert-parallel rank (the experts a rank holds
  summed); 1.0 without expert parallelism.
- unused_experts: experts (summed over MoE layers) that received no token in the step.
- dropped_token_frac: dropped / all routed assignments, over the global batch (0 when dropless).
- mtp_loss (extra, with model.mtp_depth > 0): the multi-token prediction modules' cross-entropy,
  averaged over the depths and micro-batches (src/moetrain/model/mtp.py); lm_loss stays the next token's.
- skipped_steps (extra): updates skipped so far by the step guard (non-finite or spiking loss or
  gradient norm; src/moetrain/train/guard.py).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from moetrain.errors import DataError, install_hint


def routing_metrics(layer_stats: list[dict[str, torch.Tensor]], ep: int = 1) -> dict[str, float]:
    """Reduce per-MoE-layer step statistics to the logged scalars, in the record's order (one host sync)."""
    lb, z, load_max, rank_max, dropped_frac, unused, *by_layer = 0.0, 0.0, 1.0, 1.0, 0.0, 0  # no MoE layer
    if layer_stats:
        counts_LE = torch.stack([s["tokens_per_expert"] for s in layer_stats]).float()
        lb = torch.stack([s["lb_loss"] for s in layer_stats]).mean()
        z = torch.stack([s["z_loss"] for s in layer_stats]).mean()
        dropped = torch.stack([s["dropped"] for s in layer_stats]).sum().float()
        load_L = counts_LE.max(dim=1).values / counts_LE.mean(dim=1).clamp(min=1e-9)
        # Experts are laid out contiguously over expert-parallel ranks: E/ep per rank.
        per_rank_LR = counts_LE.view(counts_LE.shape[0], ep, -1).sum(dim=2)
        rank_ratio = (per_rank_LR.max(dim=1).values / per_rank_LR.mean(dim=1).clamp(min=1e-9)).max()
        unused = (counts_LE == 0).sum()
        routed = counts_LE.sum()  # every assignment the routers made, dropped ones included
        values = torch.stack([lb, z, load_L.max(), rank_ratio, dropped / routed.clamp(min=1), unused.float()])
        lb, z, load_max, rank_max, dropped_frac, unused, *by_layer = torch.cat([values, load_L]).tolist()
    return {
        "lb_loss": lb,
        "z_loss": z,
        "expert_load_max_over_mean": load_max,
        "expert_load_by_layer": [round(v, 4) for v in by_layer],
        "ep_load_max_over_mean": rank_max,
        "dropped_token_frac": dropped_frac,
        "unused_experts": int(unused),
    }


def peak_mem_gib(device: torch.device, graph_bytes: int = 0) -> float:
    """The peak (module docstring); `graph_bytes`: a CUDA graph's memory the allocator does not
    count as allocated (`TrainEngine.graph_memory_bytes`), added."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) + graph_bytes) / 2**30
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class MetricsSink:
    """One place the logged records go. Rank 0's `MetricsLogger` (src/moetrain/train/callbacks.py)
    hands each record to every sink of its list, in order, and closes them in reverse order."""

    def step_done(self, step: int) -> None:
        """After a step that wrote no record."""

    def write(self, record: dict[str, Any], window: tuple[float, int]) -> None:
        """One record; `window`: the (seconds, steps) its rates cover."""

    def close(self, failed: bool = False) -> None:
        """At the end of `fit`; `failed`: the run ended with an error."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numeric values but its step (what TensorBoard and W&B plot against it)."""
    return {
        key: value
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class JsonlSink(MetricsSink):
    """Appends each record to `path` (RUN_DIR/metrics.jsonl) as one JSON line."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, record: dict[str, Any], window: tuple[float, int]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class TensorBoardSink(MetricsSink):
    """Each record's `scalars` as TensorBoard events in RUN_DIR/tb (logging.tensorboard)."""

    def __init__(self, writer: Any):
        self.tb = writer

    @classmethod
    def open(cls, run_dir: Path, resumed_at: int | None = None) -> TensorBoardSink | None:
        """The sink writing to `run_dir`/tb; None, with a note, without the tensorboard package
        (an optional dependency). A run resumed at step `resumed_at` drops the earlier events of the
        steps it trains again, as metrics.jsonl drops their records."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print(
                f"note: tensorboard is not installed; skipping RUN_DIR/tb events ({install_hint('tensorboard')}, "
                "or set logging.tensorboard=false)",
                file=sys.stderr,
            )
            return None
        purge = None if resumed_at is None else resumed_at + 1
        return cls(SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=purge))

    def write(self, record: dict[str, Any], window: tuple[float, int]) -> None:
        for key, value in scalars(record).items():
            self.tb.add_scalar(key, value, record["step"])

    def close(self, failed: bool = False) -> None:
        self.tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl. A process killed while appending can leave a truncated
    last line: it is skipped (the step is logged again after a resume). Any other line that is
    not a step's record is a `DataError` naming it."""
    if not path.is_file():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and "step" in record:
            records.append(record)
        elif n < lines[-1][0]:
            raise DataError(
                f"{path}, line {n}: not a step's record (a JSON object with a step): delete the line, or move the "
                "file away to start the records anew."
            )
    return records
