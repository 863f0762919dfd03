"""`ReplicatedAdamW`: torch AdamW with the full optimizer state on every rank, the ddp stack's
data-parallel gradient reduction (`GradReducer`, when dp > 1) and global-norm clipping."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moetrain.model.transformer import canonical_name
from moetrain.optim.base import TorchAdamW, build_adamw
from moetrain.optim.clip import global_grad_norm
from moetrain.optim.grad_reducer import GradReducer, expert_param_ids
from moetrain.parallel.dims import ParallelState

if TYPE_CHECKING:
    from moetrain.optim.config import OptimConfig


class ReplicatedAdamW(TorchAdamW):
    """The `Optimizer` (moetrain/optim/base.py) of the ddp stack without parallel.shard_optimizer."""

    def __init__(self, model: nn.Module, state: ParallelState, cfg: OptimConfig):
        self.model = model
        self.reducer = GradReducer(model, state) if state.dims.dp > 1 else None
        self.loss_scale = self.reducer.loss_scale if self.reducer is not None else 1.0
        self.ep_group = state.ep_group
        self.pp_group = state.pp_group
        expert_ids = expert_param_ids(model)
        self.expert_params = [p for p in model.parameters() if id(p) in expert_ids]
        self.dense_params = [p for p in model.parameters() if id(p) not in expert_ids]
        self.adamw = build_adamw(model, cfg)
        self.fused = any(g.get("fused") for g in self.adamw.param_groups)

    def prepare(self, sync: bool, backward_passes: int = 1) -> None:
        if self.reducer is not None:
            self.reducer.prepare(sync, backward_passes)

    def finish(self) -> None:
        if self.reducer is not None:
            self.reducer.finish()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm before clipping (device tensor); clips (see `_clip`)."""
        total = global_grad_norm(self.dense_params, self.expert_params, self.ep_group, self.pp_group)
        self._clip([p.grad for p in self.dense_params + self.expert_params if p.grad is not None], total, max_norm)
        return total

    def zero_grad(self) -> None:
        if self.reducer is not None:
            self.reducer.zero_grad()  # the reducer's buckets must stay the gradients' storage
        else:
            self.adamw.zero_grad(set_to_none=True)

    def memory_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for s in self.adamw.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        )

    def state_dict_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The live AdamW state per parameter (created as zeros for a fresh optimizer, so a
        checkpoint can be loaded into it in place)."""
        return {canonical_name(name): self._live_state(p) for name, p in self.model.named_parameters()}

    def load_state_dict_tensors(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        live = self.state_dict_tensors()
        for name, tensors in state.items():
            for key, value in tensors.items():
                if live[name][key] is not value:
                    live[name][key].copy_(value)
