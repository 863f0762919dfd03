"""What `moetrain plan` suggests for a run that ran out of device memory, as the flags to pass.

`moetrain train` asks this when a step raises `OutOfMemory` (src/moetrain/train/oom.py) and adds the
answer to the message: the planner's predicted peak for the config as it ran, and the fastest
layout of the ddp stack that fits (`moetrain.plan.suggest`: recompute, fewer sequences per
micro-batch with more accumulation, the sharded optimizer, ep/pp), as command-line flags; where
none fits, the fewest GPUs of the kind on which one does (`moetrain.plan.fewest_gpus`).
"""

from __future__ import annotations

import dataclasses

from moetrain.plan import MAX_GPUS, fewest_gpus, plan, suggest
from moetrain.train.config import RunConfig


def advice(cfg: RunConfig, world_size: int, gpu: str) -> str:
    """The planner's predicted peak for `cfg` on `world_size` GPUs of kind `gpu`, and the fastest
    layout that fits, as the flags that set it."""
    command = f"`moetrain plan CONFIG --gpus {world_size} --gpu {gpu}`"
    try:
        predicted = plan(cfg, world_size, gpu)
        options = suggest(cfg, world_size, gpu, limit=1)
    except Exception as e:  # noqa: BLE001 (advice only: the error being reported is the OOM)
        return f"{command} lists layouts that fit (it could not plan this config here: {e})"
    text = (
        f"{command} predicts a peak of {predicted.peak_mem_gib_per_device:.1f} GiB per GPU for this config "
        f"({predicted.layout.describe()}; {predicted.gpu.memory_gib:g} GiB usable)"
    ) + _deferral(cfg, world_size, gpu)
    if not options:
        return text + f", and finds no layout that fits {world_size} × {gpu}: " + _more_gpus(cfg, world_size, gpu)
    best = options[0]
    return (
        text + f"; the fastest layout it finds that fits is {best.layout.describe()} (peak "
        f"{best.peak_mem_gib_per_device:.1f} GiB): {' '.join(best.layout.to_flags(cfg))}"
    )


def _deferral(cfg: RunConfig, world_size: int, gpu: str) -> str:
    """With compute.defer_expert_weight_grad on (and several micro-batches): the peak without it."""
    if not cfg.defers_expert_weight_grads:
        return ""
    off = dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, defer_expert_weight_grad=False))
    peak = plan(off, world_size, gpu).peak_mem_gib_per_device
    return f"; {peak:.1f} GiB with --compute.defer_expert_weight_grad=false (it keeps no expert operands)"


def _more_gpus(cfg: RunConfig, world_size: int, gpu: str) -> str:
    """How many GPUs of the kind would hold the run (`fewest_gpus`), or that the model must shrink."""
    more = fewest_gpus(cfg, world_size, gpu)
    if more.plan is None:
        return f"none fits on any count up to {MAX_GPUS} either; shrink the model"
    return (
        f"the fewest {gpu} GPUs on which one fits with headroom are {more.gpus} ({more.plan.layout.describe()}: "
        f"{' '.join(more.plan.layout.to_flags(cfg))}), or shrink the model"
    )
