"""The seam between an element-wise update rule and the layouts that hold its state.

An `UpdateRule` (AdamW: src/moetrain/optim/adamw.py; Lion: src/moetrain/optim/lion.py) names the
tensors it keeps per parameter element (`state`) and steps `UpdateGroup`s, whatever a rank holds.
The layouts (replicated.py, sharded.py, fsdp.py) own where those tensors live, the gradient
reduction, clipping and the checkpoint entries, named by the rule's `state` and a 0-d "step".

`RuleOptimizer` runs a rule in torch.optim.AdamW's place where the replicated and the FSDP
optimizer need what torch's AdamW does not do (bf16 moments, bf16 gradients kept off `.grad`,
another rule), with torch's `param_groups` and `state`; its `step` takes the clipping factor and
the skip decision as arguments. DTensor parameters are updated through their local shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch


@dataclasses.dataclass(frozen=True)
class UpdateGroup:
    """Tensors updated with one weight decay: per element of the lists a parameter, its gradient
    and, in `state`, one list per name of the rule's `state`, each tensor of the parameter's number
    of elements. `los`: the parameters are split masters (src/moetrain/optim/split_master.py),
    `params` their bf16 halves and `los` the int16 remainders. Each list holds one dtype."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    state: tuple[list[torch.Tensor], ...]
    weight_decay: float
    los: list[torch.Tensor] | None = None
    flat: tuple | None = None
    """(params, los, *state, offsets) when the parameters and state above are views of flat buffers
    at those offsets (a `SplitMaster`'s): a rule may then update them in fewer launches."""

    @property
    def fp32(self) -> bool:
        """fp32 parameters, gradients and state."""
        tensors = (self.params, self.grads, *self.state)
        return self.los is None and all(t[0].dtype == torch.float32 for t in tensors)


class UpdateRule(Protocol):
    """An element-wise update: what every layout steps its local tensors with."""

    state: tuple[str, ...]
    """The tensors kept per element, in `UpdateGroup.state`'s order (checkpoint keys optim.NAME.STATE)."""

    def update(
        self,
        groups: list[UpdateGroup],
        step: torch.Tensor,
        *,
        lr: float | torch.Tensor,
        grad_coef: torch.Tensor | None,
        skip: torch.Tensor | None,
        fused: bool,
    ) -> None:
        """One step of every tensor of `groups`, counted in `step` (a 0-d fp32 tensor on their
        device). `lr`: a number, or (fused) a 0-d fp32 device tensor read at each launch (what a
        CUDA graph needs). `grad_coef` multiplies the gradients (the clipping factor; None: 1);
        `skip` (a device bool): leave parameters, state and `step` bit for bit as they are.
        `fused`: on the device, with no host read."""
        ...


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class RuleOptimizer:
    def __init__(
        self,
        rule: UpdateRule,
        groups: list[dict],
        *,
        lr: float,
        moments_dtype: torch.dtype,
        fused: bool,
        grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ):
        self.rule, self.fused = rule, fused
        self.param_groups = [
            {"params": list(g["params"]), "weight_decay": g["weight_decay"], "lr": lr, "fused": fused} for g in groups
        ]
        params = [p for g in self.param_groups for p in g["params"]]
        device = local_tensor(params[0]).device if params else torch.device("cpu")
        self.step_t = torch.zeros((), dtype=torch.float32, device=device)
        """Updates made (all parameters are updated together): shared by every state entry."""
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {
            p: {"step": self.step_t} | {k: torch.zeros_like(p, dtype=moments_dtype) for k in rule.state} for p in params
        }
        self.grad_of = grad_of or (lambda p: p.grad)
        """A parameter's gradient (None: not updated): `.grad`, or where a `GradStore` keeps it."""

    @torch.no_grad()
    def step(self, grad_coef: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
        """The rule's `UpdateRule.update` of every parameter that has a gradient."""
        (lr,) = {g["lr"] for g in self.param_groups}  # one learning rate: `set_lr` sets every group's
        groups = []
        for group in self.param_groups:
            params = [p for p in group["params"] if self.grad_of(p) is not None]
            groups.append(
                UpdateGroup(
                    [local_tensor(p) for p in params],
                    [local_tensor(self.grad_of(p)) for p in params],
                    tuple([local_tensor(self.state[p][k]) for p in params] for k in self.rule.state),
                    weight_decay=group["weight_decay"],
                )
            )
        self.rule.update(groups, self.step_t, lr=lr, grad_coef=grad_coef, skip=skip, fused=self.fused)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
