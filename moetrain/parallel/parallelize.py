"""`parallelize`: prepare a model built on the meta device for training, in one fixed order.

    0. pipeline parallel (pp > 1): keep only this rank's stages' blocks (and the embedding / LM
       head where it holds the first / last stage); the stages themselves are views built after
       initialization (moetrain/parallel/pipeline.py)
    1. expert parallel: each MoE layer keeps its rank's experts and gets an all-to-all dispatcher
       (`parallel.dispatcher`: nosync, fixed buffers, or alltoall, exact splits)
       (or, with ep = 1 and dp > 1, a dispatcher that only sums routing counts over dp)
    2. activation recompute (per block)
    3. torch.compile (per block)
    4. data parallel:
       - `parallel.stack=ddp`: after `to_empty()` + `init_weights()`, the trainer attaches a
         `GradReducer` (moetrain/parallel/data_parallel.py), which needs real gradient storage;
       - `parallel.stack=fsdp`: `fully_shard` each block, then the root, on the dp mesh
         (moetrain/parallel/fsdp.py); it wraps the recompute/compile wrappers of 2-3.

Wrappers are applied in place; parameter names
do not change, so checkpoints are interchangeable between wrapped and unwrapped models.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from moetrain.model.transformer import Transformer
from moetrain.parallel.dims import ParallelConfig, ParallelState, Stack
from moetrain.parallel.expert_parallel import apply_expert_parallel
from moetrain.parallel.fsdp import apply_fsdp
from moetrain.parallel.pipeline import split_model
from moetrain.train.config import Recompute, TrainerConfig


def parallelize(model: Transformer, state: ParallelState, cfg: TrainerConfig, parallel: ParallelConfig) -> Transformer:
    if state.dims.num_stages > 1:
        split_model(model, state.dims, state.pp_rank)
    apply_expert_parallel(model, state, parallel)
    if cfg.recompute == Recompute.full:
        apply_recompute(model)
    if cfg.compile:
        apply_compile(model)
    if parallel.stack == Stack.fsdp:
        apply_fsdp(model, state)
    return model


def apply_recompute(model: Transformer) -> None:
    """Keep only each block's input during forward; recompute the block in backward. Non-reentrant
    checkpointing restores the RNG state, so random routing picks the same experts twice."""
    for name, block in list(model.blocks.items()):
        model.blocks[name] = checkpoint_wrapper(block, preserve_rng_state=True)


def apply_compile(model: Transformer) -> None:
    """Compile each block separately: blocks share one graph, so compile time does not grow with
    depth. dynamic=False: shapes are fixed by the batch config."""
    for block in model.blocks.values():
        block.compile(dynamic=False)

