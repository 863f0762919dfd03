"""Expert parallelism: experts stay resident on their ranks and tokens travel to them.

Legend: E experts in all, L = E / ep experts on this rank.

`apply_expert_parallel` gives every MoE layer of a (meta-device) model the slice of experts its
rank holds and a dispatcher that moves tokens with all-to-all (`DISPATCHERS`). The model code is
unchanged: the MoE layer still asks its dispatcher for the expert step.
"""

from __future__ import annotations

import torch

from moetrain.model.experts import GroupedExperts
from moetrain.model.transformer import Transformer
from moetrain.parallel.config import DEFAULT_CAPACITY_MIN_ROWS, DispatcherKind, ParallelConfig
from moetrain.parallel.dims import ParallelState
from moetrain.parallel.exact_dispatchers import AllToAllDispatcher, DataParallelDispatcher
from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher
from moetrain.parallel.overlapped_dispatcher import OverlappedDispatcher


def _nosync(E: int, state: ParallelState, cfg: ParallelConfig) -> NoSyncDispatcher:
    floor = DEFAULT_CAPACITY_MIN_ROWS if cfg.capacity_min_rows is None else cfg.capacity_min_rows
    args = (E, state.group("ep"), state.group("dp", "cp"), cfg.capacity_factor, cfg.spill_factor, floor)
    if state.dims.overlap_chunks:  # auto resolved for the device (`RunConfig.build_dims`)
        return OverlappedDispatcher(*args, chunks=state.dims.overlap_chunks)
    return NoSyncDispatcher(*args)


DISPATCHERS = {
    DispatcherKind.nosync: _nosync,
    DispatcherKind.alltoall: lambda E, state, cfg: AllToAllDispatcher(E, state.group("ep"), state.group("dp", "cp")),
}
"""parallel.dispatcher → (experts in all, this rank's groups, the config) → its dispatcher. A new
dispatcher is a class and an entry here (and its value in `DispatcherKind`)."""


def apply_expert_parallel(model: Transformer, state: ParallelState, cfg: ParallelConfig) -> None:
    """Give each MoE layer its rank's experts and a dispatcher that reaches the others. Run on the
    meta device, before materializing: only the local experts are ever allocated.
    parallel.capacity_min_rows auto (None) is the trainer's to resolve for its device
    (src/moetrain/train/trainer.py); unresolved, it is the floor of 1024 rows."""
    dims = state.dims
    for moe in model.moe_layers():
        E = moe.cfg.num_experts
        if dims.ep > 1:
            L = E // dims.ep
            old = moe.experts
            with torch.device(old.w_down_EDF.device):
                moe.experts = GroupedExperts(L, old.d_model, old.hidden, state.index("ep") * L, moe.runtime)
            moe.dispatcher = DISPATCHERS[cfg.dispatcher](E, state, cfg)
        elif dims.replicas > 1:
            moe.dispatcher = DataParallelDispatcher(E, state.group("dp", "cp"))
