"""`parallelize`: prepare a model built on the meta device for training, in one fixed order.

    0. pipeline parallel (pp > 1): keep only this rank's stages' blocks (and the embedding / LM
       head where it holds the first / last stage); the stages themselves are views built after
       initialization (moetrain/parallel/pipeline.py)
    1. expert parallel: each MoE layer keeps its rank's experts and gets an all-to-all dispatcher
       (`parallel.dispatcher`: nosync, fixed buffers, or alltoall, exact splits)
       (or, with ep = 1 and dp > 1, a dispatcher that only sums routing counts over dp)
    1b. FP8 (`train.fp8=rowwise|mxfp8`): the experts' grouped GEMMs and the attention / shared-expert /
        dense-MLP linears switch to row-wise FP8 products (same parameters)
    2. activation recompute (per block, every `train.recompute_every`-th; full or selective)
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

from functools import partial

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torch import nn

from moetrain.errors import ConfigError
from moetrain.model.experts import GroupedExperts
from moetrain.model.fp8 import Fp8Linear, MxFp8Linear
from moetrain.model.transformer import Transformer, canonical_name
from moetrain.parallel.dims import ParallelConfig, ParallelState, Stack
from moetrain.parallel.expert_parallel import apply_expert_parallel
from moetrain.parallel.fsdp import apply_fsdp
from moetrain.parallel.pipeline import split_model
from moetrain.train.config import Fp8, Recompute, TrainerConfig


def parallelize(model: Transformer, state: ParallelState, cfg: TrainerConfig, parallel: ParallelConfig) -> Transformer:
    if state.dims.num_stages > 1:
        split_model(model, state.dims, state.pp_rank)
    apply_expert_parallel(model, state, parallel)
    if cfg.fp8 != Fp8.none:
        apply_fp8(model, cfg.fp8.value)
    if cfg.recompute != Recompute.none:
        apply_recompute(model, selective=cfg.recompute == Recompute.selective, every=cfg.recompute_every)
    if parallel.compile_overlap and not cfg.compile:
        raise ConfigError("parallel.compile_overlap=true reorders collectives inside compiled blocks: "
                          "it needs train.compile=true.")
    if cfg.compile:
        apply_compile(model, overlap=parallel.compile_overlap)
    if parallel.stack == Stack.fsdp:
        apply_fsdp(model, state)
    return model


def apply_fp8(model: Transformer, recipe: str = "rowwise") -> None:
    """FP8 (`recipe`: "rowwise" or "mxfp8") for every expert grouped GEMM and every linear layer
    inside the blocks except the router (a tiny product whose fp32 logits decide routing). Linear
    layers become `Fp8Linear` / `MxFp8Linear` in place (the class changes, the fp32 parameter
    stays), so names, initialization and checkpoints are unchanged. Row-wise kernels need every
    GEMM dim divisible by 16; MXFP8 blocks need multiples of 32."""
    align = 32 if recipe == "mxfp8" else 16
    linear_class = MxFp8Linear if recipe == "mxfp8" else Fp8Linear
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for dim in (module.d_model, module.hidden):
                if dim % align:
                    raise ConfigError(f"train.fp8={recipe} needs dims divisible by {align}; {canonical_name(name)} has {dim}.")
            module.fp8 = recipe
        elif isinstance(module, nn.Linear) and ".blocks." in f".{name}" and type(module) is nn.Linear:
            if module.in_features % align or module.out_features % align:
                raise ConfigError(
                    f"train.fp8={recipe} needs dims divisible by {align}; {canonical_name(name)} is "
                    f"{module.in_features} → {module.out_features}."
                )
            module.__class__ = linear_class


def apply_recompute(model: Transformer, selective: bool = False, every: int = 1) -> None:
    """Full: keep only each block's input during forward; recompute the block in backward.
    Selective: also keep the outputs of the ops in `SAVED_OPS` (matrix products, attention,
    collectives), so backward recomputes only the cheap element-wise ops between them.
    Non-reentrant checkpointing restores the RNG state, so random routing picks the same experts
    twice. Blocks are named by layer index: with `every` = N only blocks 0, N, 2N, … recompute."""
    kwargs = {"context_fn": partial(create_selective_checkpoint_contexts, _save_matmuls_and_comms)} if selective else {}
    for name, block in list(model.blocks.items()):
        if int(name) % every == 0:
            model.blocks[name] = checkpoint_wrapper(block, preserve_rng_state=True, **kwargs)


def _saved_ops() -> set:
    aten, ops = torch.ops.aten, set()
    names = [
        "mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    ]
    for name in names:
        if hasattr(aten, name):  # some exist only in newer torch versions
            ops.add(getattr(aten, name).default)
    c10d = torch.ops._c10d_functional
    for name in ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor"):
        ops.add(getattr(c10d, name).default)
    return ops


SAVED_OPS = _saved_ops()
"""Ops whose outputs selective recompute keeps: recomputing them would redo the FLOPs that
dominate a step (or repeat a collective)."""


def _save_matmuls_and_comms(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


OVERLAP_PASSES = [
    "reorder_communication_preserving_peak_memory", "sink_waits_iterative", "reorder_communication_preserving_peak_memory",
]
"""Inductor's reordering passes for compute/communication overlap (the order its config file
recommends): start each collective as early as its inputs allow, wait for it as late as its
users allow, without raising the block's peak memory."""


def apply_compile(model: Transformer, overlap: bool = False) -> None:
    """Compile each block separately: blocks share one graph, so compile time does not grow with
    depth. dynamic=False: shapes are fixed by the batch config. `overlap`: Inductor's
    compute/communication reordering (a process-wide Inductor setting)."""
    if overlap:
        import torch._inductor.config as inductor_config

        inductor_config.reorder_for_compute_comm_overlap = True
        inductor_config.reorder_for_compute_comm_overlap_passes = list(OVERLAP_PASSES)
    for block in model.blocks.values():
        block.compile(dynamic=False)

