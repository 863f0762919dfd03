"""`GradStore`: gradients kept off the parameters' `.grad`, in a dtype of the optimizer's choosing
(bf16 with optim.grad_dtype=bf16), accumulated over the micro-batches of a step.

Autograd can only give a parameter a `.grad` of the parameter's own dtype, so an fp32 parameter
cannot accumulate into bf16 storage by itself. A post-accumulate-grad hook takes each
micro-batch's gradient `g` off the parameter as soon as backward has finished it (so at most the
parameters backward is working on hold an fp32 gradient) and folds it into the store:

    first backward of the step:   acc = round(g)                 (a copy: a cast, or none)
    every later one:              acc = round(fp32(acc) + g)     (`acc.add_(g)`, in place)

`round` is to nearest bf16, ties to even: torch's in-place add into a bf16 tensor computes in
fp32 and rounds once, on CPU as on CUDA (tests/optim/test_grad_dtype.py checks it bit for bit).

Two kinds of storage: a view given per parameter (a `GradReducer` bucket's stretch, kept across
steps), or none (dp = 1: each gradient is allocated by the step's first backward that reaches it
and dropped by `zero_grad`, as torch does for `.grad`).
"""

from __future__ import annotations

import torch
from torch import nn


class GradStore:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.views: dict[int, torch.Tensor] = {}
        """id(parameter) → its gradient: the given view, or the tensor the first backward made."""
        self._kept: set[int] = set()
        """Parameters with a given (persistent) view."""
        self._written: set[int] = set()

    def add(self, p: nn.Parameter, view: torch.Tensor | None = None) -> None:
        """Take `p`'s gradients from now on, into `view` (shaped like `p`, of the store's dtype) if
        given. Add `p` before anything else hooks it that must see the stored gradient (a
        `GradReducer`'s counting hook): hooks run in the order they were registered."""
        assert view is None or (view.shape == p.shape and view.dtype == self.dtype), (view.shape, p.shape)
        if view is not None:
            self.views[id(p)] = view
            self._kept.add(id(p))
        p.register_post_accumulate_grad_hook(self._accumulate)

    def _accumulate(self, p: nn.Parameter) -> None:
        if p.grad is None:  # this backward gave it none (a deferred expert weight's, before the last)
            return
        key = id(p)
        if key in self._written:
            self.views[key].add_(p.grad)
        elif key in self._kept:
            self.views[key].copy_(p.grad)
        else:  # `.to` keeps a gradient already of this dtype as it is: no copy
            self.views[key] = p.grad.to(self.dtype)
        self._written.add(key)
        p.grad = None

    def grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """`p`'s gradient of this step (None: no backward reached it and it has no kept view)."""
        return self.views.get(id(p))

    def finish(self) -> None:
        """After the step's last backward: zero the kept views no backward reached (they still
        hold an earlier step's gradient)."""
        for key in self._kept - self._written:
            self.views[key].zero_()

    def zero_grad(self) -> None:
        """Start a new step: kept views are not zeroed (the next backward copies into them);
        the others are dropped."""
        self._written.clear()
        self.views = {key: view for key, view in self.views.items() if key in self._kept}

    def nbytes(self) -> int:
        """Bytes of the gradients this store holds now."""
        return sum(v.numel() * v.element_size() for v in self.views.values())
