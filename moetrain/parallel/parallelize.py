"""`parallelize`: wrap a built model for training, in one fixed, documented order.

    1. activation recompute (per block)
    2. torch.compile (per block)

(Pipeline split, expert parallelism and data parallelism/FSDP will slot in before and after
these, in the order pipeline → expert parallel → recompute → compile → data parallel.)
Applied to the blocks in place; the model's parameter names do not change, so checkpoints are
interchangeable between wrapped and unwrapped models.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from moetrain.model.transformer import Transformer
from moetrain.train.config import Recompute, TrainerConfig


def parallelize(model: Transformer, cfg: TrainerConfig) -> Transformer:
    if cfg.recompute == Recompute.full:
        apply_recompute(model)
    if cfg.compile:
        apply_compile(model)
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

