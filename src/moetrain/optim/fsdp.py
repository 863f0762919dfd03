"""`FSDPAdamW`: torch AdamW (or a `RuleOptimizer` of the update rule: src/moetrain/optim/rule.py)
over the FSDP stack's sharded (DTensor) parameters.

optim.grad_dtype=bf16 is FSDP's reduce dtype (src/moetrain/parallel/fsdp.py, `apply_fsdp`), whose
reduced shards stay fp32; on one rank FSDP shards and reduces nothing, and the bf16 gradients are
kept here, in a `GradStore`, as the replicated optimizer keeps them at dp = 1.

With optim.name=muon the blocks' matrices step by `Muon` over each rank's dim-0 shards
(`_muon_part`): a rank orthogonalizes the whole experts it holds where they are; the other
matrices' directions are all-gathered, the dp ranks sharing out the iteration."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.model.transformer import canonical_name
from moetrain.optim.base import TorchAdamW, build_torch_style
from moetrain.optim.clip import global_grad_norm
from moetrain.optim.grad_store import GradStore
from moetrain.optim.muon import LocalMatrices, MatrixShape, Muon, MuonConfig, check_matrices, muon_matrices
from moetrain.optim.rule import local_tensor
from moetrain.parallel.dims import ParallelState
from moetrain.parallel.fsdp import full_tensor, is_sharded, local_flat_range, reshard

if TYPE_CHECKING:
    from moetrain.optim.config import OptimConfig


class FSDPReduction:
    """FSDP's own gradient reduction, as a `GradReduction` (src/moetrain/optim/grad_reducer.py): it
    reduce-scatters the gradients and averages them over dp during backward."""

    loss_scale = 1.0
    """FSDP averages the gradients over dp itself: the losses need no extra scale."""

    def __init__(self, model: nn.Module):
        self.model = model

    def prepare(self, sync: bool, backward_passes: int = 1) -> None:
        """Gradient accumulation: FSDP keeps unsharded gradients and reduce-scatters them only in
        the last micro-batch's backward."""
        if hasattr(self.model, "set_requires_gradient_sync"):  # absent on one rank (not sharded)
            self.model.set_requires_gradient_sync(sync)

    def finish(self) -> None:
        """Nothing to wait for: FSDP finishes its reduce-scatters at the end of backward."""


class FSDPAdamW(TorchAdamW):
    """Each rank updates and holds state for its shards only (optimizer memory ÷ dp); FSDP
    reduces the gradients (`FSDPReduction`). The `Optimizer` (src/moetrain/optim/base.py) of
    `parallel.stack=fsdp`."""

    def __init__(self, model: nn.Module, state: ParallelState, cfg: OptimConfig):
        self.model = model
        self.reduction = FSDPReduction(model)
        self.grads: GradStore | None = None
        """One rank with optim.grad_dtype=bf16: the bf16 gradients (else FSDP's, on `.grad`)."""
        if cfg.grad_dtype.dtype != torch.float32 and state.mesh is None:
            self.grads = GradStore(cfg.grad_dtype.dtype)
            for p in model.parameters():
                if p.requires_grad:
                    self.grads.add(p)
        self.low_grads = self.grads is not None
        shapes = muon_matrices(model) if cfg.name == "muon" else {}
        self.muon_named = [(canonical_name(n), p) for n, p in model.named_parameters() if id(p) in shapes]
        """optim.name=muon: the matrices Muon updates, by canonical name."""
        check_matrices(self.muon_named, shapes)
        parts = [_muon_part(p, shapes[id(p)], cfg.moments_dtype.dtype) for _, p in self.muon_named]
        self.muon = Muon(MuonConfig.of(cfg), parts, gather=self._whole_directions)
        grad_of = self.grads.grad if self.low_grads else None
        self.adamw = build_torch_style(model, cfg, exclude=set(shapes), grad_of=grad_of)
        self.fused = any(g.get("fused") for g in self.adamw.param_groups)

    def _whole_directions(self, directions: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """`Muon`'s gather: the rows of a row-sharded matrix's direction all-gathered; whole
        experts' (and an unsharded tensor's) stay as they are."""
        return [
            full_tensor(_like(p, u)) if u is not None and x.group is not None else u
            for (_, p), x, u in zip(self.muon_named, self.muon.parts, directions)
        ]

    def grad_parts(self) -> list[tuple[str, torch.Tensor, bool]]:
        """Each parameter's local gradient shard (`Optimizer.grad_parts`; FSDP shards every
        parameter over the dp ranks, so every rank counts its parts)."""
        parts = []
        for name, p in self.model.named_parameters():
            grad = self._grad_of(p)
            if grad is not None:
                parts.append((canonical_name(name), local_tensor(grad), True))
        return parts

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm over the gradient shards (get_total_norm reduces DTensor norms over the
        mesh), as a plain device tensor; clip with the same coefficient as `clip_grad_norm`. One
        rank's bf16 gradients: their norm in fp32, the factor handed to the update."""
        if self.grads is not None:
            grads = [g for p in self.model.parameters() if (g := self.grads.grad(p)) is not None]
            total = global_grad_norm(grads, [])
            self._clip(grads, total, max_norm)
            return total
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params], 2.0))
        if self.fused or max_norm == math.inf:
            self._clip([p.grad for p in params], total, max_norm)
        else:  # DTensor gradients: torch's own helper scales them
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def grad_bytes(self) -> int:
        """This rank's gradient shards (fp32: FSDP casts the reduced bf16 shards back), or one
        rank's bf16 gradients. FSDP's unsharded gradients exist only inside backward and between
        micro-batches (bf16 with optim.grad_dtype=bf16) and are not counted."""
        if self.grads is not None:
            return self.grads.nbytes()
        local = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
        return sum(g.numel() * g.element_size() for g in local)

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The live optimizer state per parameter: DTensors sharded like the parameters (a
        checkpoint saves and loads each rank's shard of them). No copy, no communication."""
        reshard(self.model)  # the parameters must be the sharded ones AdamW holds state for
        muon = {n: {"momentum": _like(p, m)} for (n, p), m in zip(self.muon_named, self.muon.momentum)}
        return {
            canonical_name(name): muon.get(canonical_name(name)) or self._live_state(p)
            for name, p in self.model.named_parameters()
        }


def _muon_part(p: nn.Parameter, shape: MatrixShape, moments_dtype: torch.dtype) -> LocalMatrices:
    """This rank's shard of `p` as `Muon`'s part: rows of a matrix (gathered whole, the iteration
    shared out over the dp ranks), or whole experts along dim 0 (orthogonalized here)."""
    local = local_tensor(p)
    momentum = torch.zeros_like(local, dtype=moments_dtype)
    if is_sharded(p) and p.ndim != 3:
        return LocalMatrices(shape, local, momentum, local_flat_range(p)[0], p.device_mesh.get_group())
    return LocalMatrices(dataclasses.replace(shape, count=local.numel() // shape.numel), local, momentum)


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's rows of a tensor shaped like `p`) as a DTensor sharded as `p` is."""
    if not is_sharded(p):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
