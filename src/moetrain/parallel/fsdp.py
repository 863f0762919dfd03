"""The FSDP2 baseline stack (`parallel.stack=fsdp`): `fully_shard` per block, then the root
(docs/architecture.md, "FSDP2 baseline": the step, mixed precision).

Every parameter, the stacked (E, …) experts included, becomes a DTensor sharded (dim 0) over the
data-parallel mesh, and every rank computes all experts for its own tokens (no expert
parallelism): the design Olmo-core 3 replaced with resident experts, here so benchmarks compare
the two stacks on the same model, data and batch.

The model stays plain: `init_weights(fill=init_full_then_shard)` initializes each parameter on a
full temporary and keeps this rank's shard, so values match every other layout. Checkpoints save
and load each rank's rows of every parameter and moment (`local_flat_range`: a dim-0 shard is one
flat range of the whole tensor) under the ddp stack's entry names and shapes, so any layout loads
them; nothing is gathered.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from moetrain.model.transformer import Transformer
from moetrain.parallel.dims import ParallelState


def apply_fsdp(
    model: Transformer,
    state: ParallelState,
    param_dtype: torch.dtype | None = None,
    grad_dtype: torch.dtype = torch.float32,
) -> None:
    """Shard each block, then the root (embedding, final norm, LM head), over the replicas' mesh. On the
    meta device: nothing is allocated until `to_empty()`, and then only the shards.

    `param_dtype` (bf16 compute: the autocast dtype): the blocks' parameters are all-gathered in
    that dtype and their gradients reduce-scattered in fp32 into the fp32 shards; their inputs
    stay fp32, and so does the root (docs/architecture.md, "FSDP2 baseline").

    `grad_dtype` bf16 (optim.grad_dtype, the root too): FSDP's reduce dtype. It keeps each
    parameter's unsharded gradient between micro-batches in bf16 (every later gradient added in
    fp32 and rounded once: `FSDPParam.accumulate_unsharded_grad_if_needed`), reduce-scatters in
    bf16, and casts the reduced shard back to the parameters' fp32 for the optimizer. On one rank
    (no mesh) nothing is sharded: `FSDPAdamW` keeps the bf16 gradients itself."""
    if state.mesh is None:
        return  # one rank: nothing to shard
    policy = root_policy = MixedPrecisionPolicy()
    if param_dtype is not None and param_dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    if grad_dtype != torch.float32:
        param_dtype = policy.param_dtype
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=grad_dtype, cast_forward_inputs=False)
        root_policy = MixedPrecisionPolicy(reduce_dtype=grad_dtype)
    for block in model.blocks.values():
        fully_shard(block, mesh=state.mesh, mp_policy=policy)
    fully_shard(model, mesh=state.mesh, mp_policy=root_policy)


def reshard(model: nn.Module) -> None:
    """Put FSDP's sharded parameters back in place. The root keeps its parameters gathered after a
    forward without autograd (evaluation): until resharded, `model.parameters()` are plain full
    tensors, not the DTensors the optimizer holds state for. No-op for other models."""
    if isinstance(model, FSDPModule):
        model.reshard()


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)


@torch.no_grad()
def copy_shard(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Write the full tensor `full` into `dst`: all of it for a plain tensor, this rank's shard for
    a DTensor (every rank holds the same `full`, so the shard is cut locally: no communication)."""
    if not is_sharded(dst):
        dst.copy_(full)
        return
    shard = distribute_tensor(full, dst.device_mesh, dst.placements, src_data_rank=None).to_local()
    dst.to_local().copy_(shard)


def local_flat_range(t: DTensor) -> tuple[int, torch.Tensor]:
    """(first element, this rank's shard flattened: a view) of a DTensor sharded on dim 0 over
    one mesh dim (FSDP's placement): the local rows are one range of the whole tensor's
    row-major order. No communication."""
    assert tuple(t.placements) == (Shard(0),), t.placements
    (chunk,) = t.__create_chunk_list__()  # the local shard's offsets, as DCP computes them
    local = t.to_local()
    assert local.is_contiguous()
    return chunk.offsets[0] * math.prod(t.shape[1:]) if t.ndim else 0, local.view(-1)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (collective for a DTensor: every rank of its mesh must call it)."""
    return t.full_tensor() if is_sharded(t) else t


@torch.no_grad()
def init_full_then_shard(param: torch.Tensor, init: Callable[[torch.Tensor], None]) -> None:
    """`Transformer.init_weights`'s `fill` for sharded parameters: run `init` on a full temporary
    (one parameter at a time), keep this rank's shard. Plain tensors are filled in place."""
    if not is_sharded(param):
        init(param)
        return
    full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
    init(full)
    copy_shard(param, full)


def local_numel(module: nn.Module) -> int:
    """Parameter elements this rank holds (its shards, under FSDP)."""
    return sum((p.to_local() if is_sharded(p) else p).numel() for p in module.parameters())
