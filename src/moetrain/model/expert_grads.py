"""`DeferredExpertGrads`: the experts' weight gradients computed once per optimizer step
(`compute.defer_expert_weight_grad`; docs/architecture.md, "Memory and speed switches").

Legend: M rows of one micro-batch (expert assignments sorted by expert), R rows of all the
step's micro-batches, K and N the weight gradient's two dims (K the product's reduction dim
forward), E experts.

Why: with gradient accumulation each micro-batch's expert weight gradient is one grouped GEMM
added into the step's fp32 gradient, and with many small experts that addition (the whole fp32
gradient read and written per micro-batch) costs more than the GEMM. Deferred, each expert
product keeps its two operands (x and dy) of every micro-batch but the last, and the step's last
backward lays all their rows out expert by expert (`expert_major`) for one grouped GEMM whose fp32
accumulator sums the micro-batches: the numbers differ by summation order only. The cost is
memory (`held_bytes`; src/moetrain/plan/memory.py counts it). Earlier backward passes give the
weight no gradient at all: its post-accumulate-grad hooks still run, with `.grad` None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator

import torch

Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(dy_MN, x_MK, offsets_E): one micro-batch's operands of an expert weight's gradient."""


class DeferredExpertGrads:
    """What every expert product of one model shares when its weight gradients are deferred
    (module docstring): the step's backward count and the operands kept until its last one."""

    def __init__(self) -> None:
        self.backward_passes = 1
        """Backward passes of the current step; 1 (nothing deferred) until `begin` says more."""
        self._held: dict[Hashable, list[Part]] = {}

    @contextlib.contextmanager
    def step(self, backward_passes: int) -> Iterator[None]:
        """Around a step's `backward_passes` forward and backward passes: `begin`, then `finish`,
        or `reset` if the step raises (out of memory, say: the kept operands are freed)."""
        self.begin(backward_passes)
        try:
            yield
        except BaseException:
            self.reset()
            raise
        self.finish()

    def begin(self, backward_passes: int) -> None:
        """A step of `backward_passes` backward passes starts: count anew."""
        self.reset()
        self.backward_passes = backward_passes

    def reset(self) -> None:
        """Drop what is held and defer nothing (a step that ended early, e.g. out of memory,
        frees the operands it kept)."""
        self._held.clear()
        self.backward_passes = 1

    def weight_grad(
        self, key: Hashable, dy_MN: torch.Tensor, x_MK: torch.Tensor, offsets_E: torch.Tensor, compute: Callable
    ) -> torch.Tensor | None:
        """In an expert product's backward: None (the operands kept) before the step's last pass,
        then `compute(dy, x, offsets)` over every pass's rows, expert by expert."""
        held = self._held.setdefault(key, [])
        held.append((dy_MN, x_MK, offsets_E))
        if len(held) < self.backward_passes:
            return None
        del self._held[key]
        return compute(*expert_major(held))

    def held_bytes(self) -> int:
        """Bytes of the operands kept now (for tests and memory reports)."""
        return sum(t.numel() * t.element_size() for parts in self._held.values() for p in parts for t in p[:2])

    def finish(self) -> None:
        """After the step's last backward: every product must have used what it kept."""
        if self._held:
            counts, passes = sorted(len(v) for v in self._held.values()), self.backward_passes
            self.reset()
            raise RuntimeError(
                f"compute.defer_expert_weight_grad: {len(counts)} expert products saw fewer than the step's "
                f"{passes} backward passes (held {counts}); their weight gradients would be lost. "
                "Every micro-batch's backward must reach every MoE layer once; set "
                "compute.defer_expert_weight_grad=false for a step that does not."
            )


def expert_major(parts: list[Part]) -> Part:
    """The rows of several micro-batches' (dy, x, offsets), each sorted by expert, as one
    (dy_RN, x_RK, offsets_E) with every expert's rows together (in micro-batch order) and the
    rows past each micro-batch's last offset (padding the experts skip) at the end. One row copy
    of each operand; no host sync (every index is computed on the device). Empties `parts` as it
    copies them, so that each micro-batch's operands can be freed once copied.

    Row m of micro-batch p in group g (an expert, or the padding as group E) goes to row
    m + shift[p, g]: where group g starts in the step, plus g's rows in the micro-batches before
    p, less where g starts in p (`_copy_rows`)."""
    if len(parts) == 1:
        return parts[0]
    R = sum(x.shape[0] for _, x, _ in parts)
    ends_PE = torch.stack([off.long() for _, _, off in parts])
    rows_P1 = torch.stack([off.new_full((1,), x.shape[0], dtype=torch.long) for _, x, off in parts])
    ends_PG = torch.cat([ends_PE, rows_P1], dim=1)  # the padding ends where the micro-batch does
    counts_PG = torch.diff(ends_PG, dim=1, prepend=ends_PG.new_zeros(len(parts), 1))
    total_G = counts_PG.sum(0)
    group_start_G = total_G.cumsum(0) - total_G
    earlier_PG = counts_PG.cumsum(0) - counts_PG  # a group's rows in the micro-batches before
    shift_PG = group_start_G + earlier_PG - (ends_PG - counts_PG)
    dy_RN = parts[0][0].new_empty(R, parts[0][0].shape[1])
    x_RK = parts[0][1].new_empty(R, parts[0][1].shape[1])
    for p in range(len(parts)):
        (dy_MN, x_MK, offsets_E), parts[p] = parts[p], None
        _copy_rows(dy_MN, x_MK, offsets_E, shift_PG[p], dy_RN, x_RK)
        del dy_MN, x_MK
    offsets_E = total_G[:-1].cumsum(0).to(torch.int32)
    return dy_RN, x_RK, offsets_E


def _copy_rows(dy_MN, x_MK, offsets_E, shift_G, dy_RN, x_RK) -> None:
    """dy_RN[m + shift_G[g]] = dy_MN[m] for each row m, g its group (the number of `offsets_E` at
    or below m), and the same for x. On CUDA one Triton kernel for both; elsewhere index_copy_."""
    if dy_MN.is_cuda:
        from moetrain.model.expert_major_kernel import copy_rows_expert_major

        copy_rows_expert_major(dy_MN, x_MK, offsets_E, shift_G, dy_RN, x_RK)
        return
    rows_M = torch.arange(x_MK.shape[0], device=x_MK.device)
    dest_M = rows_M + shift_G[torch.searchsorted(offsets_E.long(), rows_M, right=True)]
    dy_RN.index_copy_(0, dest_M, dy_MN)
    x_RK.index_copy_(0, dest_M, x_MK)
