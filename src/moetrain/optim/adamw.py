"""AdamW's update rule (`AdamW`, an `UpdateRule`: src/moetrain/optim/rule.py), with two backends.

`adamw_update` makes one AdamW step (decoupled weight decay, bias-corrected, eps after the square
root) of `UpdateGroup`s (state: exp_avg, exp_avg_sq): parameters fp32, or split masters (the bf16
half and the int16 remainder, src/moetrain/optim/split_master.py); gradients fp32 or bf16; moments
fp32 or bf16 (optim.moments_dtype: 4 bytes per parameter instead of 8, rounded to nearest after
each fp32 update, as DeepSeek-V3 trains its AdamW moments). Its two backends:

- torch (`adamw_reference`): torch.optim.AdamW's single-tensor update as foreach ops, in fp32 on
  every dtype above; the step count and the skip decision are read on the host. Off CUDA (or
  with optim.fused=false).
- device (`fused`): nothing read on the host. Groups of fp32 parameters, gradients and moments go
  to torch's fused AdamW kernel (`torch._fused_adamw_`: the bits of torch.optim.AdamW(fused=True));
  the others to our Triton kernels (src/moetrain/optim/triton_kernels.py), which read the bias
  corrections, the clipping factor and the skip decision from device memory.
"""

from __future__ import annotations

import dataclasses

import torch

from moetrain.optim.rule import UpdateGroup
from moetrain.optim.split_master import join, split_fp32


@dataclasses.dataclass(frozen=True)
class AdamW:
    """AdamW's `UpdateRule`: `adamw_update` with these hyperparameters (optim.betas, optim.eps)."""

    betas: tuple[float, float]
    eps: float
    state = ("exp_avg", "exp_avg_sq")

    def update(self, groups: list[UpdateGroup], step: torch.Tensor, **kwargs) -> None:
        adamw_update(groups, step, betas=self.betas, eps=self.eps, **kwargs)


def adamw_reference(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    los: list[torch.Tensor] | None = None,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_coef: torch.Tensor | None,
) -> None:
    """One AdamW step of the tensors in place: torch.optim.AdamW's single-tensor update (its
    formula, its operations in its order, its Python-float scalars) as foreach ops, in fp32 on the
    split masters' joined values (`los`) and on lower-precision gradients and moments, written back
    rounded to nearest. `step` counts this update (1 = first); `grad_coef`: the clipping factor."""
    masters = [join(p, lo) for p, lo in zip(params, los)] if los is not None else params
    grads = [g.float() for g in grads]  # the gradients themselves when they are fp32
    if grad_coef is not None:
        grads = [g * grad_coef for g in grads]
    m = [t.float() for t in exp_avgs]  # the moments themselves when they are fp32
    v = [t.float() for t in exp_avg_sqs]
    if weight_decay != 0:
        torch._foreach_mul_(masters, 1 - lr * weight_decay)
    torch._foreach_lerp_(m, grads, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(masters, m, denom, value=-lr / bias_correction1)
    for low, high in ((exp_avgs, m), (exp_avg_sqs, v)):
        for t, t32 in zip(low, high):
            if t32 is not t:
                t.copy_(t32)
    for p, lo, master in zip(params, los or (), masters):
        new_hi, new_lo = split_fp32(master)
        p.copy_(new_hi)
        lo.copy_(new_lo)


def adamw_update(
    groups: list[UpdateGroup],
    step: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    grad_coef: torch.Tensor | None,
    skip: torch.Tensor | None,
    fused: bool,
) -> None:
    """One AdamW step of every tensor of `groups`, the arguments as `UpdateRule.update`'s (a 0-d
    `lr` only where `fused`): `fused`, on the device with no host read (module docstring); else
    `adamw_reference`."""
    beta1, beta2 = betas
    groups = [g for g in groups if g.params]
    if not fused:
        if skip is not None and bool(skip):
            return
        step += 1
        for g in groups:
            adamw_reference(
                g.params, g.grads, *g.state, g.los,
                step=float(step), lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=g.weight_decay,
                grad_coef=grad_coef,
            )  # fmt: skip
        return
    step.add_((~skip).float() if skip is not None else 1.0)
    hyper = dict(beta1=beta1, beta2=beta2, eps=eps)
    torch_groups = [g for g in groups if g.fp32]
    if torch_groups:
        grad_scale = grad_coef.reciprocal() if grad_coef is not None else None  # torch's kernel divides by it
        found_inf = skip.float() if skip is not None else None
        for g in torch_groups:
            torch._fused_adamw_(
                g.params, g.grads, *g.state, [], [step] * len(g.params),
                weight_decay=g.weight_decay, amsgrad=False, maximize=False, grad_scale=grad_scale,
                found_inf=found_inf, lr=lr, **hyper,
            )  # fmt: skip
    triton_groups = [g for g in groups if not g.fp32]
    if triton_groups:
        from moetrain.optim.triton_kernels import adamw_triton, adamw_triton_flat, bias_corrections

        corrections = bias_corrections(step, lr, beta1, beta2)
        for g in triton_groups:
            if g.flat is not None and all(grad.is_contiguous() for grad in g.grads):
                param, lo, exp_avg, exp_avg_sq, offsets = g.flat
                adamw_triton_flat(
                    param, lo, g.grads, offsets, exp_avg, exp_avg_sq, corrections,
                    weight_decay=g.weight_decay, grad_coef=grad_coef, skip=skip, **hyper,
                )  # fmt: skip
                continue
            for i, (p, grad, m, v) in enumerate(zip(g.params, g.grads, *g.state)):
                lo = g.los[i].view(-1) if g.los is not None else None
                adamw_triton(
                    p.view(-1), lo, grad.view(-1), m.view(-1), v.view(-1), corrections,
                    weight_decay=g.weight_decay, grad_coef=grad_coef, skip=skip, **hyper,
                )  # fmt: skip
