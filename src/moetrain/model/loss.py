"""The language-model loss: the LM head's matrix product and the cross-entropy, over chunks of tokens.

Legend: N tokens, D model dim, V vocabulary, C tokens per chunk.

Why chunks: computed the plain way (`lm_head(h)` then `cross_entropy(logits.float())`), a step
holds the logits of all N tokens several times over (the bf16 product, its fp32 copy, the saved
log-softmax, in backward the fp32 gradient and its bf16 cast: N·V·10 B, 7.7 GiB at 8192 tokens
and a 100k vocabulary). Here each chunk of C tokens gets its logits, its loss and at once the
gradient of the mean loss with respect to its logits, which is multiplied back into the gradients
of the hidden states and of the head's weight: one chunk's logits exist at a time, and backward
only scales those gradients by the incoming one (the loss is the graph's last node). On CUDA a
chunk's element-wise work is one compiled function, two kernels.

The numbers are the plain path's up to summation order: logits in the matmul dtype, softmax and
loss in fp32, the head's weight gradient summed over chunks in fp32 (on CUDA by the GEMM itself).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from moetrain.model.fp8 import FAST_ACCUM_FORWARD, Fp8Linear, _quantize, _scaled_mm


def linear_cross_entropy(
    h_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    chunk_tokens: int,
    fp8: bool = False,
    fast_backward: bool = False,
) -> torch.Tensor:
    """Mean cross-entropy of `h_ND @ weight_VDᵀ` against `targets_N` (fp32 scalar), computed
    `chunk_tokens` tokens at a time (module docstring). Under autocast the products run in its
    dtype, as `nn.Linear` would. `fp8`: the logits and the hidden states' gradient are row-wise
    FP8 products (`_Fp8Head`); the weight's gradient stays in the matmul dtype, summed in fp32.
    `fast_backward`: the hidden states' gradient product with fast accumulation."""
    device_type = h_ND.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h_ND.dtype
    # Inside an autograd Function's forward grad mode is off: decide here what needs a gradient.
    grads = (torch.is_grad_enabled() and h_ND.requires_grad, torch.is_grad_enabled() and weight_VD.requires_grad)
    with torch.autocast(device_type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(
            h_ND, weight_VD, targets_N, chunk_tokens, dtype, grads, fp8, fast_backward
        )


def _chunk_loss_and_grad(logits_CV: torch.Tensor, targets_C: torch.Tensor, scale: float):
    """Summed cross-entropy of the chunk (fp32) and `scale` × its gradient with respect to the
    logits, in the logits' dtype: softmax(logits) − one_hot(target)."""
    x_CV = logits_CV.float()
    lse_C = torch.logsumexp(x_CV, dim=-1)
    loss = (lse_C - x_CV.gather(1, targets_C.unsqueeze(1)).squeeze(1)).sum()
    # The one-hot as a comparison, not a scatter: every step after the log-sum-exp is then
    # element-wise, so the compiled function writes the gradient in the logits' dtype in one pass
    # and never materializes an fp32 chunk (a scatter made it keep one: 1.5 GiB at 8e's peak).
    is_target_CV = torch.arange(x_CV.shape[1], device=x_CV.device).unsqueeze(0) == targets_C.unsqueeze(1)
    p_CV = torch.exp(x_CV - lse_C.unsqueeze(1)) - is_target_CV.to(x_CV.dtype)
    return loss, (p_CV * scale).to(logits_CV.dtype)


@functools.cache
def _compiled_chunk_loss_and_grad():
    """The element-wise part compiled (fused passes), for CUDA; compiled at its first use."""
    return torch.compile(_chunk_loss_and_grad, dynamic=False)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, weight_VD, targets_N, chunk_tokens, dtype, grads, fp8, fast_backward):
        """`grads`: whether h and the weight want gradients; the rest as `linear_cross_entropy`'s."""
        N = h_ND.shape[0]
        w_VD = weight_VD.to(dtype)
        head = _Fp8Head(w_VD, dtype, input_grad=grads[0], fast_backward=fast_backward) if fp8 else _Head(w_VD)
        grad_h_ND = torch.empty_like(h_ND) if grads[0] else None
        grad_w_VD = None  # fp32, made by the first chunk
        chunk = chunk_tokens if chunk_tokens > 0 else N
        fn = _compiled_chunk_loss_and_grad() if h_ND.is_cuda else _chunk_loss_and_grad
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        for start in range(0, N, chunk):
            h_CD = h_ND[start : start + chunk].to(dtype)
            logits_CV = head.logits(h_CD)
            targets_C = targets_N[start : start + chunk]
            if not any(grads):  # no gradient wanted (evaluation)
                x_CV = logits_CV.float()
                loss += (torch.logsumexp(x_CV, dim=-1) - x_CV.gather(1, targets_C.unsqueeze(1)).squeeze(1)).sum()
                continue
            chunk_loss, grad_CV = fn(logits_CV, targets_C, 1.0 / N)
            loss += chunk_loss
            if grad_h_ND is not None:
                grad_h_ND[start : start + chunk] = head.input_grad(grad_CV)
            if grads[1]:
                grad_w_VD = _accumulate_fp32(grad_w_VD, grad_CV.t(), h_CD)
            del logits_CV, grad_CV  # one chunk's logits at a time
        ctx.save_for_backward(grad_h_ND, grad_w_VD)
        ctx.weight_dtype = weight_VD.dtype
        return loss / N

    @staticmethod
    def backward(ctx, grad_out):
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        grad_h = grad_h_ND * grad_out if grad_h_ND is not None else None
        grad_w = None
        if grad_w_VD is not None:  # one pass: scaled and written in the weight's dtype
            grad_w = torch.mul(grad_w_VD, grad_out, out=torch.empty_like(grad_w_VD, dtype=ctx.weight_dtype))
        return grad_h, grad_w, None, None, None, None, None, None


class _Head:
    """The LM head's two products with the hidden states, in the matmul dtype."""

    def __init__(self, w_VD: torch.Tensor):
        self.w_VD = w_VD

    def logits(self, h_CD: torch.Tensor) -> torch.Tensor:
        return h_CD @ self.w_VD.t()

    def input_grad(self, grad_CV: torch.Tensor) -> torch.Tensor:
        return grad_CV @ self.w_VD


class _Fp8Head:
    """The same products in row-wise FP8 (src/moetrain/model/fp8.py): the weight quantized once per
    call, per vocabulary row for the logits (reduction over D) and per model feature for the
    input gradient (reduction over V); a chunk's hidden states and logit gradients per token.
    The outputs come back in the matmul dtype."""

    def __init__(self, w_VD: torch.Tensor, dtype: torch.dtype, input_grad: bool, fast_backward: bool):
        self.dtype, self.fast_backward = dtype, fast_backward
        self.wq_VD, self.ws_V1 = _quantize(w_VD, -1)
        self.wq_col = _quantize(w_VD, 0, "col") if input_grad else None

    def logits(self, h_CD: torch.Tensor) -> torch.Tensor:
        hq, hs = _quantize(h_CD.contiguous(), -1)
        return _scaled_mm(hq, self.wq_VD.t(), hs, self.ws_V1.t(), FAST_ACCUM_FORWARD).to(self.dtype)

    def input_grad(self, grad_CV: torch.Tensor) -> torch.Tensor:
        gq, gs = _quantize(grad_CV.contiguous(), -1)
        wq, ws = self.wq_col
        return _scaled_mm(gq, wq, gs, ws, self.fast_backward).to(self.dtype)


def _accumulate_fp32(grad_w_VD: torch.Tensor | None, a_VC: torch.Tensor, b_CD: torch.Tensor) -> torch.Tensor:
    """grad_w + a @ b in fp32 (a @ b for the first chunk: `grad_w` None), in place after the
    first. On CUDA with low-precision inputs the GEMM writes and accumulates fp32 itself (no
    product in the input dtype, no separate add pass); elsewhere (torch has no CPU kernel for
    `out_dtype`) the product plus an fp32 add."""
    if a_VC.is_cuda and a_VC.dtype != torch.float32:
        if grad_w_VD is None:
            return torch.mm(a_VC, b_CD, out_dtype=torch.float32)
        return torch.addmm(grad_w_VD, a_VC, b_CD, out_dtype=torch.float32, out=grad_w_VD)
    if grad_w_VD is None:
        grad_w_VD = torch.zeros(a_VC.shape[0], b_CD.shape[1], dtype=torch.float32, device=a_VC.device)
    grad_w_VD += a_VC @ b_CD
    return grad_w_VD


def lm_loss(head: nn.Linear, h_BTD: torch.Tensor, targets_BT: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The LM loss of final hidden states (after the last norm) through `head`: chunked when
    `chunk_tokens` > 0, else the plain `cross_entropy(head(h).float())`."""
    if chunk_tokens > 0:
        fp8 = type(head) is Fp8Linear  # precision.fp8_lm_head
        h_ND, targets_N = h_BTD.flatten(0, 1), targets_BT.flatten()
        fast = fp8 and head.fast_accum_backward
        return linear_cross_entropy(h_ND, head.weight, targets_N, chunk_tokens, fp8, fast)
    logits_BTV = head(h_BTD)
    return nn.functional.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())
