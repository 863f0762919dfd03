"""`FSDPAdamW`: torch AdamW over the FSDP stack's sharded (DTensor) parameters."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from moetrain.model.transformer import canonical_name
from moetrain.optim.base import TorchAdamW, build_adamw
from moetrain.parallel.dims import ParallelState
from moetrain.parallel.fsdp import copy_shard, full_tensor, is_sharded, reshard

if TYPE_CHECKING:
    from moetrain.optim.config import OptimConfig


class FSDPAdamW(TorchAdamW):
    """Each rank updates and holds state for its shards only (optimizer memory ÷ dp). FSDP
    reduce-scatters the gradients and averages them over dp during backward, so there is no
    reducer here. The `Optimizer` (moetrain/optim/base.py) of `parallel.stack=fsdp`."""

    loss_scale = 1.0
    """FSDP averages the gradients over dp itself: the losses need no extra scale."""

    def __init__(self, model: nn.Module, state: ParallelState, cfg: OptimConfig):
        self.model = model
        self.adamw = build_adamw(model, cfg)
        self.fused = any(g.get("fused") for g in self.adamw.param_groups)

    def prepare(self, sync: bool, backward_passes: int = 1) -> None:
        """Gradient accumulation: FSDP keeps unsharded gradients and reduce-scatters them only in
        the last micro-batch's backward."""
        if hasattr(self.model, "set_requires_gradient_sync"):  # absent on one rank (not sharded)
            self.model.set_requires_gradient_sync(sync)

    def finish(self) -> None:
        """Nothing to wait for: FSDP finishes its reduce-scatters at the end of backward."""

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm over the gradient shards (get_total_norm reduces DTensor norms over the
        mesh), as a plain device tensor; clip with the same coefficient as `clip_grad_norm`."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params], 2.0))
        if self.fused or max_norm == math.inf:
            self._clip([p.grad for p in params], total, max_norm)
        else:  # DTensor gradients: torch's own helper scales them
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def zero_grad(self) -> None:
        self.adamw.zero_grad(set_to_none=True)

    def memory_bytes(self) -> int:
        """Bytes of AdamW state this rank holds (its shards)."""
        tensors = [
            t.to_local() if is_sharded(t) else t
            for s in self.adamw.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def checkpoint_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The live AdamW state per parameter: DTensors sharded like the parameters (a
        checkpoint saves and loads each rank's shard of them). No copy, no communication."""
        reshard(self.model)  # the parameters must be the sharded ones AdamW holds state for
        return {canonical_name(name): self._live_state(p) for name, p in self.model.named_parameters()}

    def state_dict_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per-parameter FULL moments keyed by canonical name (the layout of the other
        optimizers), in memory, for tests and tools (checkpoints use `checkpoint_tensors`).
        Collective: the shards are all-gathered (briefly the unsharded moments, 8 bytes per
        parameter element)."""
        reshard(self.model)  # the parameters must be the sharded ones AdamW holds state for
        out = {}
        for name, p in self.model.named_parameters():
            live = self._live_state(p)
            out[canonical_name(name)] = {
                "step": live["step"],
                "exp_avg": full_tensor(live["exp_avg"]),
                "exp_avg_sq": full_tensor(live["exp_avg_sq"]),
            }
        return out

    @torch.no_grad()
    def load_state_dict_tensors(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take full per-parameter moments (as `state_dict_tensors` gives them) and keep this
        rank's shards. No communication."""
        reshard(self.model)
        for name, p in self.model.named_parameters():
            entry = state[canonical_name(name)]
            live = self._live_state(p)
            for key, value in entry.items():
                if live[key] is not value:
                    copy_shard(live[key], value)
