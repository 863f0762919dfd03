"""Token copies into expert order and back, with the top-k weighting fused into the way back.

Legend: N tokens, K top-k, M = N·K assignments (token copies), D model dim.

`sort_idx_M` (a stable argsort of the flat expert ids) orders the copies by expert: copy m is
flat assignment sort_idx[m], of token sort_idx[m] // K; its inverse `inv_M` (inv[sort_idx[m]] = m)
says where assignment n·K + k sits. Both directions are gathers, forward and backward:

- `permute`:            x_MD[m] = x_ND[sort_idx[m] // K];
  backward              grad_x[n] = Σ_k grad_MD[inv[n, k]], the k in expert order;
- `unpermute_combine`:  y_ND[n] = Σ_k w[n, k] · y_MD[inv[n, k]];
  backward              grad_y_MD[m] = w_flat[sort_idx[m]] · grad_y[sort_idx[m] // K],
                        grad_w[n, k] = ⟨y_MD[inv[n, k]], grad_y[n]⟩.

Why: autograd's backward of a row gather is a scatter-add (atomic on CUDA) into a zero-filled
buffer, and a plain combine writes and keeps an (N, K, D) copy of the experts' output. Here each
gather fuses with the sum or product beside it (Inductor's, inside a compiled block; `fused`'s
outside one): no (N, K, D) tensor, no zero fill, no atomics, and the saved tensor is the experts'
output itself. The sums over k run in the order `index_add` adds on the CPU (ascending m), so the
fp32 CPU numerics are the plain autograd formulation's, bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def fused(fn: Callable) -> Callable:
    """`fn` compiled by Inductor where its first argument is on a CUDA device (its gathers,
    masks, products and sums fused into a kernel or two, as inside a compiled block), `fn` itself
    elsewhere: the CPU keeps the eager numerics, and inside a compiled block it is traced like
    any code. Compiled at its first call on a GPU, so importing it costs nothing."""
    compiled = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled
        if not args[0].is_cuda or torch.compiler.is_compiling():
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args)

    return run


def inverse_permutation(sort_idx_M: torch.Tensor) -> torch.Tensor:
    """inv with inv[sort_idx[m]] = m (a scatter of M indices; no sort)."""
    arange_M = torch.arange(sort_idx_M.numel(), device=sort_idx_M.device, dtype=sort_idx_M.dtype)
    return torch.empty_like(sort_idx_M).scatter_(0, sort_idx_M, arange_M)


@fused
def _sum_copies(grad_MD: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
    """grad_x[n] = Σ_k grad_MD[inv[n, k]], in ascending positions: each token's copies in expert
    order, as index_add would add them."""
    N, K = inv_NK.shape
    return grad_MD.index_select(0, inv_NK.sort(dim=1).values.flatten()).view(N, K, -1).sum(1)


@fused
def _weighted_sum(y_MD: torch.Tensor, w_NK: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
    N, K = inv_NK.shape
    y_NKD = y_MD.index_select(0, inv_NK.flatten()).view(N, K, -1)
    return (y_NKD * w_NK.unsqueeze(-1).to(y_MD.dtype)).sum(1)


@fused
def _weighted_sum_backward(grad_ND, y_MD, w_NK, sort_idx_M, inv_NK) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = inv_NK.shape
    grad_NKD = grad_ND.unsqueeze(1) * w_NK.unsqueeze(-1).to(y_MD.dtype)
    grad_y_MD = grad_NKD.view(N * K, -1).index_select(0, sort_idx_M)
    y_NKD = y_MD.index_select(0, inv_NK.flatten()).view(N, K, -1)
    return grad_y_MD, weight_grad(grad_ND, y_NKD, w_NK.dtype)


def weight_grad(grad_ND: torch.Tensor, y_NKD: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The top-k weights' gradient ⟨y_NKD, grad_y⟩, summed in fp32 whatever y's dtype (no-ops on
    fp32): the router's gradient is not rounded to bf16."""
    return (grad_ND.unsqueeze(1).float() * y_NKD.float()).sum(-1).to(dtype)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, token_idx_M: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inv_NK)
        return x_ND.index_select(0, token_idx_M)

    @staticmethod
    def backward(ctx, grad_MD: torch.Tensor):
        (inv_NK,) = ctx.saved_tensors
        return _sum_copies(grad_MD, inv_NK), None, None


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_MD: torch.Tensor, w_NK: torch.Tensor, sort_idx_M: torch.Tensor, inv_NK: torch.Tensor):
        ctx.save_for_backward(y_MD, w_NK, sort_idx_M, inv_NK)
        return _weighted_sum(y_MD, w_NK, inv_NK)

    @staticmethod
    def backward(ctx, grad_ND: torch.Tensor):
        return *_weighted_sum_backward(grad_ND, *ctx.saved_tensors), None, None


def permute(x_ND: torch.Tensor, sort_idx_M: torch.Tensor, inv_NK: torch.Tensor) -> torch.Tensor:
    """Token rows -> their copies in expert order (M, D)."""
    return _Permute.apply(x_ND, sort_idx_M // inv_NK.shape[1], inv_NK)


def unpermute_combine(
    y_MD: torch.Tensor, topk_weights_NK: torch.Tensor, sort_idx_M: torch.Tensor, inv_NK: torch.Tensor
) -> torch.Tensor:
    """The experts' output rows in expert order -> each token's weighted sum over its k copies
    (N, D), in y's dtype."""
    return _UnpermuteCombine.apply(y_MD, topk_weights_NK, sort_idx_M, inv_NK)
