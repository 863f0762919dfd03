"""Lion (`optim.name=lion`; Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
every parameter steps by the sign of an interpolation of its momentum and its gradient.

Legend: W a parameter, G its gradient (reduced over the data-parallel ranks and clipped), M its
momentum (optim.lion_betas = (β1, β2), the paper's defaults (0.9, 0.99)).

Per element and step:

    C = β1·M + (1 − β1)·G
    W ← W·(1 − lr·wd) − lr·sign(C)
    M ← β2·M + (1 − β2)·G

Every update element is ±lr, so the update's RMS is lr where AdamW's is nearer 0.2·lr: Lion
usually takes a learning rate 3–10× smaller than AdamW's and a weight decay 3–10× larger. One
moment per element instead of AdamW's two, and no step count in the update.

`Lion` is an `UpdateRule` (src/moetrain/optim/rule.py), computed in fp32 from any dtype of
parameter (split masters joined), gradient and momentum, written back rounded to nearest; a
skipped step keeps every tensor bit for bit through `torch.where`, so nothing is read on the
host on any path.
"""

from __future__ import annotations

import dataclasses

import torch

from moetrain.optim.rule import UpdateGroup
from moetrain.optim.split_master import join, split_fp32


@dataclasses.dataclass(frozen=True)
class Lion:
    """Lion's `UpdateRule` (module docstring)."""

    betas: tuple[float, float] = (0.9, 0.99)
    state = ("lion_momentum",)

    @torch.no_grad()
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
        """`UpdateRule.update`: one path, fused or not, that reads nothing on the host; each
        parameter (with `lo`: the split master (p, lo)) and its momentum in place, in fp32."""
        step.add_((~skip).float() if skip is not None else 1.0)
        beta1, beta2 = self.betas
        for g in groups:
            (momenta,) = g.state
            for i, (p, grad, m) in enumerate(zip(g.params, g.grads, momenta)):
                lo = g.los[i] if g.los is not None else None
                w = join(p, lo) if lo is not None else p.float()
                g32 = grad.float() if grad_coef is None else grad.float() * grad_coef
                m32 = m.float()
                c = m32 * beta1 + g32 * (1 - beta1)
                new_w = w * (1 - lr * g.weight_decay) - lr * torch.sign(c)
                new_m = m32 * beta2 + g32 * (1 - beta2)
                if skip is not None:
                    new_w, new_m = torch.where(skip, w, new_w), torch.where(skip, m32, new_m)
                m.copy_(new_m)
                if lo is None:
                    p.copy_(new_w)
                else:
                    hi, new_lo = split_fp32(new_w)
                    p.copy_(hi)
                    lo.copy_(new_lo)
