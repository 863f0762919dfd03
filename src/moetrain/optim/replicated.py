"""`ReplicatedAdamW`: torch AdamW (or a `RuleOptimizer` of the update rule) with the full optimizer
state on every rank, the ddp stack's data-parallel gradient reduction (`GradReducer` when dp > 1,
else `NoReduction`) and global-norm clipping. With optim.bf16_weights the matrices are bf16 and
their fp32 masters, gradients and rule state live in a `SplitMaster`
(src/moetrain/optim/split_master.py); torch AdamW keeps the rest (norms, embedding, routers). With
optim.grad_dtype=bf16 the gradients are bf16 off the parameters' `.grad` (the reducer's buckets,
or at dp = 1 a `GradStore`). With optim.name=muon the blocks' matrices are Muon's (`Muon.whole`:
every rank holds them whole and orthogonalizes its share of them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moetrain.model.transformer import canonical_name
from moetrain.optim.base import FlatShard, TorchAdamW, build_torch_style, use_fused
from moetrain.optim.clip import global_grad_norm
from moetrain.optim.grad_reducer import GradReducer, GradReduction, NoReduction, expert_param_ids, reduced_param_ids
from moetrain.optim.grad_store import GradStore
from moetrain.optim.muon import Muon, MuonConfig, muon_matrices
from moetrain.optim.rule import UpdateGroup
from moetrain.optim.split_master import SplitMaster, is_split_candidate
from moetrain.parallel.dims import ParallelState

if TYPE_CHECKING:
    from moetrain.optim.config import OptimConfig


class ReplicatedAdamW(TorchAdamW):
    """The `Optimizer` (src/moetrain/optim/base.py) of the ddp stack without parallel.shard_optimizer."""

    def __init__(self, model: nn.Module, state: ParallelState, cfg: OptimConfig, *, bf16_weights: bool = False):
        self.model = model
        self.rule = cfg.rule()
        split_ids = is_split_candidate(model) if bf16_weights else set()
        device = next(model.parameters()).device
        grad_dtype = cfg.grad_dtype.dtype
        self.split = (
            SplitMaster(
                model,
                split_ids,
                weight_decay=cfg.weight_decay,
                fused=use_fused(cfg, device) and device.type == "cuda",  # the Triton kernel
                persistent=reduced_param_ids(model, state),  # GradReducer's buckets
                moments_dtype=cfg.moments_dtype.dtype,
                grad_dtype=grad_dtype,
                state=self.rule.state,
            )
            if split_ids
            else None
        )
        self.reducer = (
            GradReducer(model, state, split=self.split, grad_dtype=grad_dtype) if state.dims.replicas > 1 else None
        )
        self.reduction: GradReduction = self.reducer if self.reducer is not None else NoReduction(self.split)
        self.low_grads = grad_dtype != torch.float32
        self.grads: GradStore | None = None
        """Where the bf16 gradients are (optim.grad_dtype): the reducer's store of bucket views at
        dp > 1, else one that allocates them as backward reaches each parameter; None: `.grad`."""
        if self.low_grads:
            self.grads = self.reducer.store if self.reducer is not None else GradStore(grad_dtype)
            if self.reducer is None:
                for p in model.parameters():
                    if p.requires_grad and id(p) not in split_ids:
                        self.grads.add(p)
        self.ep_group = state.group("ep")
        self.pp_group = state.group("pp")
        # the first of the replicas holding a parameter alike: its stage's dp·cp ranks for dense
        # parameters, its edp group (replica ranks e·ep + this ep index) for experts
        self._first = (state.index("dp", "cp") == 0, state.index("edp") == 0)
        self._expert_ids = expert_ids = expert_param_ids(model)
        rest = [p for p in model.parameters() if id(p) not in split_ids]
        self.expert_params = [p for p in rest if id(p) in expert_ids]
        self.dense_params = [p for p in rest if id(p) not in expert_ids]
        shapes = muon_matrices(model) if cfg.name == "muon" else {}
        self.muon_named = [(n, p) for n, p in model.named_parameters() if id(p) in shapes]
        """optim.name=muon: the matrices Muon updates (whole: every rank holds them)."""
        groups = [state.group("edp") if id(p) in expert_ids else state.group("dp", "cp") for _, p in self.muon_named]
        self.muon = Muon.whole(self.muon_named, shapes, MuonConfig.of(cfg), moments_dtype=cfg.moments_dtype.dtype,
                               groups=groups)  # fmt: skip
        muon_ids = set(shapes)
        self.adamw = build_torch_style(
            model, cfg, exclude=split_ids | muon_ids, grad_of=self._grad_of if self.low_grads else None
        )
        self.fused = any(g.get("fused") for g in self.adamw.param_groups)
        self._split_coef: torch.Tensor | None = None

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm before clipping (device tensor); clips (see `_clip`; the
        split parameters' update takes the factor as its gradient multiplier)."""
        grads, expert_grads = self._grads(self.dense_params), self._grads(self.expert_params)
        if self.split is not None:
            grads += self.split.dense_grads
            expert_grads += self.split.expert_grads
        total = global_grad_norm(grads, expert_grads, self.ep_group, self.pp_group)  # fp32 norms of bf16 too
        self._split_coef = self._clip(self._grads(self.dense_params + self.expert_params), total, max_norm)
        return total

    def grad_parts(self) -> list[tuple[str, torch.Tensor, bool]]:
        """Every parameter's whole reduced gradient (`Optimizer.grad_parts`), counted on the
        first of the ranks that hold it alike."""
        split = dict(zip(map(id, self.split.params), self.split.grads)) if self.split is not None else {}
        parts = []
        for name, p in self.model.named_parameters():
            grad = split[id(p)] if id(p) in split else self._grad_of(p)
            if grad is not None:
                parts.append((canonical_name(name), grad, self._first[id(p) in self._expert_ids]))
        return parts

    def _grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of those of `params` that have one."""
        return [g for g in map(self._grad_of, params) if g is not None]

    def _update(self, skip: torch.Tensor | None) -> None:
        super()._update(skip)
        coef, self._split_coef = self._split_coef, None
        if self.split is not None:
            s = self.split
            state = s.state.values()
            group = UpdateGroup(
                s.views(s.hi), list(s.grads), tuple(map(s.views, state)), s.weight_decay, s.views(s.lo),
                flat=(s.hi, s.lo, *state, s.offsets),
            )  # fmt: skip
            lr = self.adamw.param_groups[0]["lr"]
            self.rule.update([group], s.step, lr=lr, grad_coef=coef, skip=skip, fused=s.fused)

    def zero_grad(self) -> None:
        if self.split is not None:
            self.split.zero_grad()
        if self.reducer is not None:
            self.reducer.zero_grad()  # the reducer's buckets must stay the gradients' storage
        else:
            super().zero_grad()

    def checkpoint_masters(self) -> dict[str, FlatShard]:
        """The bf16 parameters' fp32 masters as split shards over the whole of their live
        halves (every rank holds them whole): a checkpoint joins them block by block as it writes
        and splits what it reads straight into them."""
        if self.split is None:
            return {}
        s = self.split
        out = {}
        for name, p, off in zip(s.names, s.params, s.offsets):
            n = p.numel()
            out[canonical_name(name)] = FlatShard(
                tuple(p.shape), 0, hi=s.hi[off : off + n], lo=s.lo[off : off + n], replicated=True
            )
        return out

    def grad_bytes(self) -> int:
        """The reducer's buckets (split ones are `SplitMaster`'s gradients), or the gradients
        allocated this step, and the split parameters' gradients."""
        if self.reducer is not None:
            split = {id(p) for p in self.split.params} if self.split is not None else set()
            tensors = [b.flat for b in self.reducer.buckets if not b.split]
            tensors += self._grads([p for p in self.reducer.unreduced if id(p) not in split])
        else:
            tensors = self._grads(self.dense_params + self.expert_params)
        if self.split is not None:
            tensors += self.split.dense_grads + self.split.expert_grads
        return sum(t.numel() * t.element_size() for t in tensors)

    def memory_bytes(self) -> int:
        return super().memory_bytes() + (self.split.memory_bytes() if self.split is not None else 0)

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The live optimizer state per parameter, views (created as zeros for a fresh optimizer,
        so a checkpoint can be loaded into it in place)."""
        own = self.split.state_tensors() if self.split is not None else {}
        own.update({name: {"momentum": m} for (name, _), m in zip(self.muon_named, self.muon.momentum)})
        return {
            canonical_name(name): own[name] if name in own else self._live_state(p)
            for name, p in self.model.named_parameters()
        }
