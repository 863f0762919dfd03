"""`--rehearse N [--rank R]` for `moetrain bench` and `moetrain train`: what a rehearsal measures
of one rank of an N-GPU run, and how it says so.

The rank runs alone with its real shard, kernels, buffers and checkpoint files; its peers are
stand-ins (src/moetrain/parallel/rehearsal.py). Measured on this device: the step without the
stand-ins' own work (`compute_s`), device time by kernel kind, the peak memory while training,
saving and loading, what each collective would move. Not measured: any transfer, any wait for
a peer, the pipeline's bubble: those come from the planner's model (`PEER_PARTS`), and the
projected tokens/s per GPU = measured compute + that model, labelled so
(docs/architecture.md, "Rehearsal").
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from moetrain.errors import ConfigError
from moetrain.parallel.rehearsal import Rehearsal
from moetrain.plan import GPUS, Assumptions, plan, plan_gpu
from moetrain.train.checkpoint_io import ShardRole, load_checkpoint
from moetrain.train.config import RunConfig
from moetrain.train.console import describe_layout
from moetrain.train.metrics import peak_mem_gib
from moetrain.train.trainer import Trainer

NOT_MEASURED = (
    "communication NOT measured: this rank ran alone, its peers stood in for (src/moetrain/parallel/rehearsal.py); "
    "transfers, waits and the pipeline bubble are the planner's model"
)


def resolve(cfg: RunConfig, world: int, rank: int | None) -> Rehearsal:
    """The rehearsal of rank `rank` (default: the one the planner says needs most memory) of a
    `world`-rank run of `cfg`, checked."""
    if world < 2:
        raise ConfigError(f"--rehearse={world}: rehearse a layout of 2 or more ranks (one rank is a plain run).")
    if rank is None:
        rank = plan(cfg, world, "h200").busiest_rank
    if not 0 <= rank < world:
        raise ConfigError(f"--rank={rank}: a rehearsal of {world} ranks has ranks 0 to {world - 1}.")
    return Rehearsal(world=world, rank=rank)


def command(spec: str, world: int, rank: int, flags: list[str]) -> str:
    """The `moetrain bench` line that rehearses `rank` of `spec` on `world` GPUs with `flags`."""
    return " ".join(["moetrain bench", spec, f"--rehearse {world}", f"--rank {rank}", "--device cuda", *flags])


def checkpoint_peaks(trainer: Trainer) -> dict[str, Any]:
    """Save this rank's checkpoint shard now and load it back into the live state, as a resume
    does: each one's peak device memory (GiB; None on CPU, where the peak resident memory cannot
    be reset) and peak host memory (`host_peak`), seconds and the bytes written."""
    device = trainer.device
    cuda = device.type == "cuda"

    def start() -> float:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        host_reset()
        return time.perf_counter()

    def peak() -> float | None:
        if not cuda:
            return None
        torch.cuda.synchronize(device)
        return round(torch.cuda.max_memory_allocated(device) / 2**30, 3)

    t0 = start()
    path = trainer.save()
    trainer.finish_checkpoint()
    save_s, saving, host_saving = time.perf_counter() - t0, peak(), host_peak()
    written = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    own = sum(f.stat().st_size for f in Path(path).glob(f"__{trainer.par.rank}_*.distcp"))
    t0 = start()
    role = ShardRole.of(trainer.par)
    load_checkpoint(path, trainer.engine.checkpoint_state(), rank=trainer.par.rank, rehearsal=role.rehearsal)
    trainer.engine.checkpoint_loaded()
    load_s, loading, host_loading = time.perf_counter() - t0, peak(), host_peak()
    return {
        "saving_gib": saving,
        "loading_gib": loading,
        "host_saving_gib": host_saving,
        "host_loading_gib": host_loading,
        "save_s": round(save_s, 2),
        "load_s": round(load_s, 2),
        "checkpoint": str(path),
        "shard_bytes": own,
        "checkpoint_bytes": written,
        "note": "shard_bytes: this rank's own files; checkpoint_bytes also counts what it wrote for its stand-in peers",
    }


def host_reset() -> None:
    """Restart the process's peak resident memory count (Linux: /proc/self/clear_refs; elsewhere
    nothing, and `host_peak` is None)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def host_peak() -> float | None:
    """The process's peak resident host memory since `host_reset` (GiB; None where unknown)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 2**20, 3)
    return None


def record(
    trainer: Trainer,
    *,
    step_s: float,
    stand_in_s: float,
    training_gib: float,
    kinds: dict[str, float] | None,
    checkpoint: dict[str, Any] | None,
    collectives: dict[str, dict[str, float]],
) -> dict[str, Any]:
    """The `rehearsal` entry of a bench JSON line (see the module docstring)."""
    cfg, dims, rank = trainer.cfg, trainer.par.dims, trainer.par.rank
    compute_s = step_s - stand_in_s
    out: dict[str, Any] = {
        "world": dims.world_size,
        "rank": rank,
        "layout": describe_layout(dims),
        "communication": NOT_MEASURED,
        "step_s_with_stand_ins": round(step_s, 4),
        "stand_in_s": round(stand_in_s, 4),
        "compute_s": round(compute_s, 4),
        "kinds_ms_per_step": kinds,
        "peak_gib": {
            "training": round(training_gib, 3),
            "saving": checkpoint and checkpoint["saving_gib"],
            "loading": checkpoint and checkpoint["loading_gib"],
        },
        "checkpoint": checkpoint,
        "collectives_per_step": collectives,
    }
    device = trainer.device
    if device.type != "cuda":  # no planner's GPU to compare with
        out["planner"] = out["projected"] = None
        return out
    gpu = plan_gpu(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
    p = plan(cfg, dims.world_size, gpu)
    pp_rank = trainer.par.index("pp")  # memory: this rank's pipeline rank; time: the busiest one's
    tokens = trainer.engine.tokens_per_step / dims.world_size  # this GPU's share of a step
    peers = {k: round(v, 4) for k, v in p.peers_s.items() if v}
    projected_s = compute_s + sum(peers.values())
    out["planner"] = {
        "gpu": gpu,
        "rank": p.busiest_rank,
        "compute_s": round(p.compute_s, 4),
        "pipeline_rank": pp_rank,
        "peak_gib": p.peak_gib_per_pipeline_rank[pp_rank],
        "save_peak_gib": p.save_peak_gib_per_pipeline_rank[pp_rank],
        "load_peak_gib": p.load_peak_gib_per_pipeline_rank[pp_rank],
        "tokens_per_sec_per_device": round(p.tokens_per_sec_per_device, 1),
    }
    measured = {"compute": compute_s, "peak": training_gib}
    planned = {"compute": p.compute_s, "peak": out["planner"]["peak_gib"]}
    if checkpoint is not None and checkpoint["saving_gib"] is not None:
        measured |= {"save_peak": checkpoint["saving_gib"], "load_peak": checkpoint["loading_gib"]}
        planned |= {"save_peak": out["planner"]["save_peak_gib"], "load_peak": out["planner"]["load_peak_gib"]}
    out["measured_over_planned"] = {k: round(measured[k] / planned[k], 3) for k in measured if planned[k]}
    assume, spec = Assumptions(), GPUS[gpu]
    out["projected"] = {
        "basis": "measured compute_s + the planner's modelled communication and pipeline bubble (peers_s)",
        "step_s": round(projected_s, 4),
        "tokens_per_sec_per_device": round(tokens / projected_s, 1),
        "peers_s": peers,
        "constants": {
            **{k: getattr(assume, k) for k in ("link_eff", "overlap_slowdown", "dp_tail", "fsdp_overlap")},
            **{k: getattr(spec, k) for k in ("nvlink_bytes_s", "network_bytes_s", "gpus_per_node")},
        },
    }
    return out


def train_record(trainer: Trainer) -> dict[str, Any]:
    """`moetrain train --rehearse`'s entry in the final JSON line, after `fit`: the training
    peak, then this rank's checkpoint saved and loaded back (`checkpoint_peaks`)."""
    training = round(peak_mem_gib(trainer.device), 3)  # CUDA's allocator peak; on CPU the peak RSS
    saved = checkpoint_peaks(trainer)
    return {
        "world": trainer.par.dims.world_size,
        "rank": trainer.par.rank,
        "layout": describe_layout(trainer.par.dims),
        "communication": NOT_MEASURED,
        "peak_gib": {"training": training, "saving": saved["saving_gib"], "loading": saved["loading_gib"]},
        "checkpoint": saved,
    }
