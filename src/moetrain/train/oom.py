"""Out of memory on the GPU: one paragraph instead of a CUDA traceback.

`Trainer.fit` raises `OutOfMemory` for a step's `torch.OutOfMemoryError`: the step, what torch
tried to allocate, the peak and the device's capacity, and (`moetrain train`, from the planner
above this package: src/moetrain/memory_advice.py) the fastest layout that fits, as flags.
"""

from __future__ import annotations

import re

import torch

from moetrain.destinations import format_bytes
from moetrain.errors import MoetrainError


class OutOfMemory(MoetrainError):
    """A training step ran out of device memory."""

    def __init__(
        self,
        *,
        step: int,
        first: bool,
        device: torch.device,
        last_checkpoint: str | None,
        error: BaseException,
    ):
        self.step, self.first, self.last_checkpoint, self.torch_message = step, first, last_checkpoint, str(error)
        self.peak, self.capacity, self.device_name = device_memory(device)
        self.advice: str | None = None
        """What fits instead (one or more sentences), when the caller knows: `moetrain train` asks
        the planner."""
        super().__init__(step)

    def __str__(self) -> str:
        if self.peak is not None and self.capacity is not None:
            memory = (
                f"the peak of allocated memory was {format_bytes(self.peak)} of the device's "
                f"{format_bytes(self.capacity)}"
            )
        else:
            memory = f"peak and capacity are measured on CUDA devices only, not on {self.device_name}"
        if not self.first:
            when = "after earlier steps succeeded"
        elif self.step > 1:
            when = f"the first step since resuming at step {self.step - 1}"
        else:
            when = "the first step of this run"
        kept = (
            f"the last good checkpoint, {self.last_checkpoint}, is intact: continue from it with --resume and the "
            "new settings"
            if self.last_checkpoint
            else "no checkpoint was written yet"
        )
        advice = self.advice or (
            "`moetrain plan CONFIG --gpus N` predicts the memory of this config and lists layouts that fit "
            "(recompute, a smaller micro-batch, the sharded optimizer)"
        )
        tried = _tried_to_allocate(self.torch_message)
        return (
            f"Out of memory on {self.device_name} in step {self.step} ({when}{tried}): {memory}. {advice}. "
            f"Training stopped; {kept}."
        )


def device_memory(device: torch.device) -> tuple[int | None, int | None, str]:
    """(peak allocated bytes, the device's total bytes, its name); None where not tracked."""
    if device.type != "cuda":
        return None, None, device.type
    props = torch.cuda.get_device_properties(device)
    return torch.cuda.max_memory_allocated(device), props.total_memory, props.name


def _tried_to_allocate(text: str) -> str:
    """The clause ", when it tried to allocate 2.00 GiB" from torch's message (empty without one)."""
    m = re.search(r"Tried to allocate ([\d.]+ ?[KMGT]?i?B)", text)
    return f", when it tried to allocate {m.group(1)}" if m else ""
