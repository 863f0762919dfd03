"""`parallelize`: prepare a model built on the meta device for training, in one fixed order.

    0. pipeline parallel (pp > 1): keep only this rank's stages' blocks (and the embedding / LM
       head where it holds the first / last stage); the stages themselves are views built after
       initialization (src/moetrain/parallel/pipeline.py)
    0b. context parallel (cp > 1): the model's sequence layout is this rank's `ContextShard`
       (src/moetrain/parallel/context_parallel.py); the engine shards each micro-batch with it
    1. expert parallel: each MoE layer keeps its rank's experts and gets an all-to-all dispatcher
       (`parallel.dispatcher`: nosync, fixed buffers, or alltoall, exact splits)
       (or, with ep = 1 and dp > 1, a dispatcher that only sums routing counts over dp)
    1b. FP8 (`precision.fp8=rowwise|mxfp8`): the converter `apply_fp8` (src/moetrain/model/fp8.py) gives
        the experts FP8 grouped GEMMs and replaces the chosen block linears with FP8 ones (same parameters)
    2. activation recompute (per block, every `compute.recompute_every`-th; full or selective)
    3. torch.compile (per block)
    4. data parallel:
       - `parallel.stack=ddp`: after `to_empty()` + `init_weights()`, the optimizer attaches its
         gradient reduction (`GradReducer`, src/moetrain/optim/grad_reducer.py), which needs real
         gradient storage;
       - `parallel.stack=fsdp`: `fully_shard` each block, then the root, on the dp mesh
         (src/moetrain/parallel/fsdp.py); it wraps the recompute/compile wrappers of 2-3.

Wrappers are applied in place; parameter names do not change, so checkpoints are interchangeable
between wrapped and unwrapped models. The settings were checked by `RunConfig.validate`
(src/moetrain/train/config.py) before the model was built: nothing here refuses a configuration.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from moetrain.model.config import Fp8
from moetrain.model.fp8 import apply_fp8
from moetrain.model.fp8_choice import Fp8Select
from moetrain.model.transformer import Transformer
from moetrain.parallel.config import ParallelConfig, Recompute, Stack
from moetrain.parallel.context_parallel import ContextShard
from moetrain.parallel.dims import ParallelState
from moetrain.parallel.expert_parallel import apply_expert_parallel
from moetrain.parallel.fsdp import apply_fsdp
from moetrain.parallel.overlapped_dispatcher import OverlappedDispatcher
from moetrain.parallel.pipeline import split_model


def parallelize(
    model: Transformer,
    state: ParallelState,
    parallel: ParallelConfig,
    *,
    fp8: Fp8 = Fp8.none,
    fp8_select: Fp8Select = Fp8Select.auto,
    fp8_lm_head: bool = False,
    fp8_fast_backward: bool = False,
    rows: int = 0,
    recompute: Recompute = Recompute.none,
    recompute_every: int = 1,
    compile: bool = False,
    param_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype = torch.float32,
) -> Transformer:
    """Apply the layout `parallel` (on `state`'s process groups) and the execution settings
    (precision.fp8*, compute.recompute*, compute.compile) to a meta-device model, in the order of the
    module docstring. `rows`: tokens per micro-batch on this rank (what `precision.fp8_select=auto`
    sizes the products by); `param_dtype` and `grad_dtype`: `apply_fsdp`'s."""
    if state.dims.num_stages > 1:
        split_model(model, state.dims, state.index("pp"))
    if state.dims.cp > 1:
        model.set_sequence_layout(ContextShard(state.dims.cp, state.index("cp"), state.group("cp")))
    apply_expert_parallel(model, state, parallel)
    if fp8 != Fp8.none:
        apply_fp8(model, fp8, fp8_select, rows, fp8_lm_head, fp8_fast_backward)
    if recompute != Recompute.none:
        apply_recompute(model, selective=recompute == Recompute.selective, every=recompute_every)
    if compile:
        apply_compile(model, overlap=parallel.compile_overlap)
    if parallel.stack == Stack.fsdp:
        apply_fsdp(model, state, param_dtype, grad_dtype)
    return model


def apply_recompute(model: Transformer, selective: bool = False, every: int = 1) -> None:
    """Full: keep only each block's input during forward; recompute the block in backward.
    Selective: also keep the outputs of the ops in `SAVED_OPS` (matrix products, attention,
    collectives), so backward recomputes only the cheap element-wise ops between them.
    Non-reentrant checkpointing restores the RNG state, so random routing picks the same experts
    twice. Blocks are named by layer index: with `every` = N only blocks 0, N, 2N, … recompute."""
    kwargs = {"context_fn": partial(create_selective_checkpoint_contexts, _save_matmuls_and_comms)} if selective else {}
    for name, block in list(model.blocks.items()):
        if int(name) % every == 0:
            model.blocks[name] = checkpoint_wrapper(block, checkpoint_fn=model.runtime.checkpoint, **kwargs)


def _saved_ops() -> set:
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    names = [
        "mm",
        "addmm",
        "bmm",
        "_grouped_mm",
        "_scaled_mm",
        "_scaled_grouped_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward",  # local blocks' windowed FlashAttention (model/local_attention.py)
    ]
    comms = ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor")
    # some aten ops exist only in newer torch versions
    return {getattr(aten, n).default for n in names if hasattr(aten, n)} | {getattr(c10d, n).default for n in comms}


SAVED_OPS = _saved_ops()
"""Ops whose outputs selective recompute keeps: recomputing them would redo the FLOPs that
dominate a step (or repeat a collective)."""


def _save_matmuls_and_comms(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


OVERLAP_PASSES = [
    "reorder_communication_preserving_peak_memory",
    "sink_waits_iterative",
    "reorder_communication_preserving_peak_memory",
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
        moe = getattr(block, "ffn", None)
        if isinstance(getattr(moe, "dispatcher", None), OverlappedDispatcher):
            # the overlapped exchange runs eagerly: its experts and shared expert compile alone
            moe.experts.compile(dynamic=False)
            if moe.shared_expert is not None:
                moe.shared_expert.compile(dynamic=False)
