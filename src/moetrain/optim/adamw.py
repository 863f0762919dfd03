"""The AdamW update every moetrain optimizer runs where it does not run torch.optim.AdamW, with two
backends; and `MomentsAdamW`, which runs it in torch.optim.AdamW's place.

`adamw_update` makes one AdamW step (decoupled weight decay, bias-corrected, eps after the square
root) of `AdamWGroup`s: parameters fp32, or split masters (the bf16 half and the int16 remainder,
src/moetrain/optim/split_master.py); gradients fp32 or bf16; moments fp32 or bf16 (optim.moments_dtype).
Its two backends:

- torch (`adamw_reference`): torch.optim.AdamW's single-tensor update, its operations in its order
  with its Python-float scalars, as foreach ops over the group, in fp32 on every dtype above. The
  step count and the skip decision are read on the host. Off CUDA (or with optim.fused=false).
- device (`fused`): nothing read on the host. Groups of fp32 parameters, gradients and moments go
  to torch's fused AdamW kernel (`torch._fused_adamw_`, the kernel of torch.optim.AdamW(fused=True),
  so the bits of the optimizers that run torch's AdamW); the others to our Triton kernel
  (src/moetrain/optim/triton_kernels.py, `adamw_triton`, or `adamw_triton_flat` for a group with
  `flat` buffers), which reads the bias corrections, the
  clipping factor and the skip decision from device memory.

`MomentsAdamW` stands in for `torch.optim.AdamW` where the replicated and the FSDP optimizer need
a dtype torch's AdamW does not take (`build_adamw`): bf16 moments (4 bytes per parameter instead of
8, rounded to nearest after each fp32 update, as DeepSeek-V3 trains its AdamW moments), or bf16
gradients kept off `.grad` (optim.grad_dtype=bf16: a parameter's `.grad` is in its own dtype),
which `grad_of` looks up and the update reads in fp32. It has torch's `param_groups` (with "lr",
"weight_decay") and `state` per parameter ("step", "exp_avg", "exp_avg_sq"); its `step` takes the
clipping factor and the skip decision as arguments. Sharded (DTensor) parameters of the fsdp stack
are updated through their local shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from moetrain.optim.split_master import join, split_fp32


@dataclasses.dataclass(frozen=True)
class AdamWGroup:
    """Tensors updated with one weight decay: per element of the lists a parameter, its gradient
    and its two moments, each of the parameter's number of elements. `los`: the parameters are
    split masters, `params` their bf16 halves and `los` the int16 remainders. Each list holds one
    dtype."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    weight_decay: float
    los: list[torch.Tensor] | None = None
    flat: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, list[int]] | None = None
    """(params, los, exp_avgs, exp_avg_sqs, offsets) when the parameters and moments above are
    views of flat buffers at those offsets (a `SplitMaster`'s): the device backend then updates
    them in one launch per gradient dtype (`adamw_triton_flat`), wherever the gradients lie."""

    @property
    def fp32(self) -> bool:
        """fp32 parameters, gradients and moments: what torch's fused AdamW kernel takes."""
        tensors = (self.params, self.grads, self.exp_avgs)
        return self.los is None and all(t[0].dtype == torch.float32 for t in tensors)


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
    """One AdamW step of the tensors in place, in torch ops: torch.optim.AdamW's single-tensor
    update (its formula, its operations in its order, its Python-float scalars), as foreach ops.
    With `los` the parameters are split masters: the step runs on their fp32 values
    (`join(param, lo)`) and is written back into both halves. `step` counts this update (1 =
    first); `grad_coef` multiplies the gradients (the clipping factor). Gradients and moments of a
    lower precision are computed with in fp32; the moments are rounded back to nearest."""
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
    groups: list[AdamWGroup],
    step: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    betas: tuple[float, float],
    eps: float,
    grad_coef: torch.Tensor | None,
    skip: torch.Tensor | None,
    fused: bool,
) -> None:
    """One AdamW step of every tensor of `groups`, counted in `step` (a 0-d fp32 tensor on the
    tensors' device, shared by all of them). `lr`: a number, or (fused only) a 0-d fp32 device
    tensor, read at each launch (what a CUDA graph of the update needs). `grad_coef`: multiplies
    the gradients (the clipping factor; None: 1). `skip` (a device bool): leave parameters,
    moments and `step` as they are. `fused`: on the device, with no host read (module
    docstring); else `adamw_reference`."""
    beta1, beta2 = betas
    groups = [g for g in groups if g.params]
    if not fused:
        if skip is not None and bool(skip):
            return
        step += 1
        for g in groups:
            adamw_reference(
                g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.los,
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
                g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, [], [step] * len(g.params),
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
            for i, (p, grad, m, v) in enumerate(zip(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs)):
                lo = g.los[i].view(-1) if g.los is not None else None
                adamw_triton(
                    p.view(-1), lo, grad.view(-1), m.view(-1), v.view(-1), corrections,
                    weight_decay=g.weight_decay, grad_coef=grad_coef, skip=skip, **hyper,
                )  # fmt: skip


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard, any other tensor itself."""
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
        device = local_tensor(params[0]).device if params else torch.device("cpu")
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

    @torch.no_grad()
    def step(self, grad_coef: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
        """`adamw_update` of every parameter that has a gradient (on the device when `fused`):
        `grad_coef` multiplies the gradients (the clipping factor), `skip` (a device bool) leaves
        everything as it is."""
        (lr,) = {g["lr"] for g in self.param_groups}  # one learning rate: `set_lr` sets every group's
        groups = []
        for group in self.param_groups:
            params = [p for p in group["params"] if self.grad_of(p) is not None]
            groups.append(
                AdamWGroup(
                    [local_tensor(p) for p in params],
                    [local_tensor(self.grad_of(p)) for p in params],
                    [local_tensor(self.state[p]["exp_avg"]) for p in params],
                    [local_tensor(self.state[p]["exp_avg_sq"]) for p in params],
                    weight_decay=group["weight_decay"],
                )
            )
        adamw_update(
            groups, self.step_t, lr=lr, betas=self.betas, eps=self.eps, grad_coef=grad_coef, skip=skip, fused=self.fused
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
