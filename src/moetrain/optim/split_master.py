"""`SplitMaster`: bf16 compute weights whose fp32 master copy costs no more memory than fp32 weights.

Legend: P the split parameters' elements, flattened (dense first, then experts).

With `optim.bf16_weights` the matrices that the forward and backward multiply with (attention and
MLP projections, experts, LM head) are stored as bf16 tensors, so no forward, backward or
recompute casts them and no cast copy lives from forward to backward. Their fp32 master is kept
exactly, in the same 4 bytes per element that an fp32 weight takes:

    x (fp32 bits, as int32)  =  hi · 2¹⁶ + lo      hi: the bf16 parameter the model computes with
                                                    lo: a signed 16-bit remainder (the optimizer's)

hi is x rounded to the nearest bf16 (ties away from zero, where torch's cast rounds ties to even:
the two differ only when the low 16 bits are exactly 0x8000) and lo = x − hi · 2¹⁶ lies in
[−2¹⁵, 2¹⁵): `join(hi, lo)` gives x back bit for bit. So memory per element is hi 2 + lo 2 +
fp32 gradient 4 + AdamW's two fp32 moments 8 = 16 bytes, as with fp32 weights, and without the
2 bytes per element of bf16 copies that autocast makes of every weight and keeps for backward.

The update rules run on (hi, lo) directly (src/moetrain/optim/adamw.py: on CUDA one Triton kernel
that moves the bytes of torch's fused fp32 AdamW; src/moetrain/optim/lion.py).

Gradients: autograd gives a bf16 parameter a bf16 gradient. A post-accumulate-grad hook takes it
off the parameter: after the step's first backward the bf16 gradient itself is kept (its fp32
value is exact: no cast pass, 2 bytes per element instead of 4); later backwards accumulate in
fp32, or, where a `GradReducer` buckets them, in its fp32 buffer. With optim.grad_dtype=bf16 they
stay bf16 throughout (src/moetrain/optim/grad_store.py).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from moetrain.model.experts import GroupedExperts
from moetrain.model.router import Router


def split_fp32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `x` → (hi bf16, lo int16) with `join(hi, lo)` equal to `x` bit for bit (module docstring)."""
    bits = x.detach().contiguous().view(torch.int32)
    hi_bits = (bits + 0x8000) >> 16  # rounds the magnitude half up: sign-magnitude bits
    lo = (bits - hi_bits * 65536).to(torch.int16)
    return hi_bits.to(torch.int16).view(torch.bfloat16), lo


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 values that `split_fp32` split into `hi` (bf16) and `lo` (int16)."""
    return (hi.contiguous().view(torch.int16).to(torch.int32) * 65536 + lo.to(torch.int32)).view(torch.float32)


def is_split_candidate(model: nn.Module) -> set[int]:
    """ids of the parameters `optim.bf16_weights` stores in bf16: every matrix the model multiplies
    with. The embedding table (a lookup that starts the fp32 residual stream), the routers (their
    logits are computed in fp32) and the 1-D norm weights stay fp32."""
    keep_fp32 = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding | Router) for p in m.parameters(recurse=False)
    }
    return {id(p) for p in model.parameters() if p.requires_grad and p.ndim >= 2 and id(p) not in keep_fp32}


class SplitMaster:
    """The split parameters of one rank (`is_split_candidate`) and their update rule's `state`, in one
    order: dense parameters, then experts, each in reverse registration order (the order in which
    backward finishes them, and `GradReducer`'s). hi, lo and the state are flat buffers (one
    view per parameter); each gradient is allocated by the step's first backward that reaches its
    parameter and dropped by `zero_grad`, as torch does for `.grad`, so it does not exist during
    the forward pass — except those of the parameters in `persistent` (a `GradReducer` buckets
    them: one flat buffer, kept)."""

    def __init__(
        self,
        model: nn.Module,
        ids: set[int],
        *,
        weight_decay: float,
        fused: bool,
        persistent: set[int] = frozenset(),
        moments_dtype: torch.dtype = torch.float32,
        grad_dtype: torch.dtype = torch.float32,
        state: tuple[str, ...] = ("exp_avg", "exp_avg_sq"),
    ):
        expert_ids = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
        named = [(n, p) for n, p in model.named_parameters() if id(p) in ids][::-1]
        named = [x for x in named if id(x[1]) not in expert_ids] + [x for x in named if id(x[1]) in expert_ids]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.num_dense = sum(1 for p in self.params if id(p) not in expert_ids)
        self.weight_decay, self.fused = weight_decay, fused
        numel = sum(p.numel() for p in self.params)
        device = self.params[0].device
        # hi and lo first, each parameter's fp32 storage freed as it is split: the transient is
        # one parameter, not a second copy of the model.
        self.hi = torch.empty(numel, dtype=torch.bfloat16, device=device)
        self.lo = torch.empty(numel, dtype=torch.int16, device=device)
        self.offsets = [0, *itertools.accumulate(p.numel() for p in self.params)][:-1]
        for i, p in enumerate(self.params):
            hi, lo = split_fp32(p.data)
            self.view(self.hi, i).copy_(hi)
            self.view(self.lo, i).copy_(lo)
            p.data = self.view(self.hi, i)
        self.state = {k: torch.zeros(numel, dtype=moments_dtype, device=device) for k in state}
        """The update rule's state (`UpdateRule.state`), flat."""
        self.step = torch.zeros((), dtype=torch.float32, device=device)
        """Updates made (shared by every split parameter: they are always updated together)."""
        self.grad_dtype = grad_dtype
        """Of the accumulated and the kept gradients (optim.grad_dtype)."""
        self.persistent = [id(p) in persistent for p in self.params]
        """Per parameter: whether its gradient is kept, a view of one flat buffer (in this order)."""
        kept = [p.numel() for p, keep in zip(self.params, self.persistent) if keep]
        kept_grads = iter(torch.zeros(sum(kept), dtype=grad_dtype, device=device).split(kept) if kept else ())
        self.grads: list[torch.Tensor | None] = [
            next(kept_grads).view(p.shape) if keep else None for p, keep in zip(self.params, self.persistent)
        ]
        """Per parameter: its gradient (None before the step's first backward reaches it; bf16
        after one backward, `grad_dtype` after more; a view of the flat buffer if `persistent`)."""
        self._views: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._written: set[int] = set()
        self._index = {id(p): i for i, p in enumerate(self.params)}
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._accumulate)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter `i`'s part of one of the flat buffers, shaped like the parameter."""
        p = self.params[i]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view(p.shape)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every parameter's part of one of the flat buffers (`view`), in order: the update's
        tensors (hi, lo and the moments; `grads` are the gradients). Made once per buffer (the
        buffers live as long as this object): the update asks for them every step."""
        cached = self._views.get(id(flat))
        if cached is None or cached[0] is not flat:
            cached = self._views[id(flat)] = (flat, [self.view(flat, i) for i in range(len(self.params))])
        return cached[1]

    def grad_views(self) -> dict[int, torch.Tensor]:
        """id(parameter) → its gradient, a view of the one flat buffer, of the `persistent` ones."""
        return {id(p): g for p, g, keep in zip(self.params, self.grads, self.persistent) if keep}

    def grad_of(self, p: nn.Parameter) -> torch.Tensor | None:
        """`p`'s gradient of this step (None before a backward reached it, unless kept)."""
        return self.grads[self._index[id(p)]]

    @property
    def dense_grads(self) -> list[torch.Tensor]:
        return [g for g in self.grads[: self.num_dense] if g is not None]

    @property
    def expert_grads(self) -> list[torch.Tensor]:
        return [g for g in self.grads[self.num_dense :] if g is not None]

    # ---- gradients --------------------------------------------------------------------------------
    def _accumulate(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: take the bf16 gradient (module docstring; on CUDA later ones
        are added by one Triton pass each, `accumulate_grad`). A backward that gave `p` no
        gradient (the experts' before the step's last backward, with
        compute.defer_expert_weight_grad) adds nothing."""
        if p.grad is None:
            return
        i = self._index[id(p)]
        if id(p) not in self._written:
            if self.persistent[i]:
                self.grads[i].copy_(p.grad)
            else:
                self.grads[i] = p.grad
        elif self.grad_dtype != torch.float32:
            self.grads[i].add_(p.grad)
        elif self.fused and p.grad.is_contiguous() and self.grads[i].is_contiguous():
            from moetrain.optim.triton_kernels import accumulate_grad

            self.grads[i] = accumulate_grad(self.grads[i], p.grad)
        elif self.grads[i].dtype != torch.float32:
            self.grads[i] = self.grads[i].float().add_(p.grad)
        else:
            self.grads[i].add_(p.grad)
        self._written.add(id(p))
        p.grad = None

    def finish(self) -> None:
        """After the step's last backward: zero gradients for parameters no backward reached
        (a kept buffer still holds an earlier step's)."""
        for i, p in enumerate(self.params):
            if id(p) not in self._written:
                if self.persistent[i]:
                    self.grads[i].zero_()
                else:
                    self.grads[i] = torch.zeros(p.shape, dtype=self.grad_dtype, device=p.device)
                self._written.add(id(p))

    def zero_grad(self) -> None:
        """Drop the gradients (a kept buffer is not zeroed: the next backward copies into it)."""
        self._written.clear()
        self.grads = [g if keep else None for g, keep in zip(self.grads, self.persistent)]

    # ---- state ------------------------------------------------------------------------------------
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """Parameter name (as `model.named_parameters` gives it) → its update rule's state, as views."""
        return {
            name: {"step": self.step} | {k: self.view(flat, i) for k, flat in self.state.items()}
            for i, name in enumerate(self.names)
        }

    def memory_bytes(self) -> int:
        """lo and the rule's state (hi is the parameter, `grad` the gradient)."""
        return sum(t.numel() * t.element_size() for t in (self.lo, *self.state.values()))
