"""`MomentsAdamW`: AdamW whose two moments are kept in a lower precision (optim.moments_dtype=bf16).

torch's AdamW keeps its state in the parameters' dtype. With bf16 moments the state is 4 bytes per
parameter instead of 8; each step reads them, updates in fp32 (the same formula and operation
order as torch's, `adamw_reference`) and rounds them back to nearest, as DeepSeek-V3 trains its
AdamW moments. On CUDA the update is one Triton kernel per parameter
(moetrain/optim/adamw_split_kernel.py), reading the clipping divisor, the skip decision and the
step count from device memory; elsewhere the torch reference.

It stands in for `torch.optim.AdamW` where the optimizers use one (`build_adamw`): the same
`param_groups` (with "lr", "weight_decay"), `state` per parameter ("step", "exp_avg",
"exp_avg_sq"), the fused kernel's `grad_scale` (a divisor) and `found_inf` attributes, `step()` and
`zero_grad()`. Sharded (DTensor) parameters of the fsdp stack are updated through their local
shards.

With optim.grad_dtype=bf16 the gradients are not the parameters' `.grad` (an fp32 parameter's
`.grad` is fp32) but bf16 tensors a `GradStore` keeps (moetrain/optim/grad_store.py), which
`grad_of` looks up; each is read and converted to fp32 inside the update, and the clipping factor
comes as `grad_coef`, multiplied in fp32 there, so the stored gradients are never rounded again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetrain.optim.split_master import adamw_reference


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class MomentsAdamW:
    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        moments_dtype: torch.dtype,
        fused: bool,
        grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ):
        self.param_groups = [
            {"params": list(g["params"]), "weight_decay": g["weight_decay"], "lr": lr, "fused": fused} for g in groups
        ]
        self.betas, self.eps, self.fused = tuple(betas), eps, fused
        params = [p for g in self.param_groups for p in g["params"]]
        device = _local(params[0]).device if params else torch.device("cpu")
        self.step_t = torch.zeros((), dtype=torch.float32, device=device)
        """Updates made (all parameters are updated together): shared by every state entry."""
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {
            p: {
                "step": self.step_t,
                "exp_avg": torch.zeros_like(p, dtype=moments_dtype),
                "exp_avg_sq": torch.zeros_like(p, dtype=moments_dtype),
            }
            for p in params
        }
        self.grad_of = grad_of or (lambda p: p.grad)
        """A parameter's gradient (None: not updated): `.grad`, or where a `GradStore` keeps it."""
        self.grad_scale: torch.Tensor | None = None
        """Fused path: the gradients are divided by it (the clipping factor's reciprocal)."""
        self.grad_coef: torch.Tensor | None = None
        """The gradients are multiplied by it (the clipping factor), in place of `grad_scale`:
        gradients stored in bf16, which scaling in place would round again."""
        self.found_inf: torch.Tensor | None = None
        """Fused path: nonzero = skip this update (decided on the device)."""

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        coef = self.grad_coef
        if coef is None and self.grad_scale is not None:
            coef = self.grad_scale.reciprocal()
        if self.fused:
            from moetrain.optim.adamw_split_kernel import adamw_update, bias_corrections

            skip = self.found_inf != 0 if self.found_inf is not None else None
            self.step_t.add_(1 - self.found_inf if self.found_inf is not None else 1.0)
        else:
            self.step_t += 1
        corrections: dict[float, torch.Tensor] = {}  # per learning rate: once per step, not per group
        for group in self.param_groups:
            hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=self.eps, weight_decay=group["weight_decay"])
            if self.fused and group["lr"] not in corrections:
                corrections[group["lr"]] = bias_corrections(self.step_t, group["lr"], beta1, beta2)
            for p in group["params"]:
                grad = self.grad_of(p)
                if grad is None:
                    continue
                state = self.state[p]
                tensors = [_local(t) for t in (p, grad, state["exp_avg"], state["exp_avg_sq"])]
                if self.fused:
                    param, grad, m, v = (t.view(-1) for t in tensors)
                    adamw_update(param, None, grad, m, v, corrections[group["lr"]], grad_coef=coef, skip=skip, **hyper)
                else:
                    param, grad, m, v = tensors
                    adamw_reference(param, None, grad, m, v, step=float(self.step_t), grad_coef=coef, **hyper)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
