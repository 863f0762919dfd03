"""SwiGLU over an expert layer's fused gate/up output h = [gate | up]: a = silu(gate) · up.

Legend: M rows, F expert hidden.

For the expert products that keep only h for backward (row-wise FP8's, the deferred weight
gradients'): a is computed in forward and again in backward, where the same pass gives h's
gradient. On CUDA each is one Triton kernel (src/moetrain/model/fp8_kernels.py), rounding once;
elsewhere torch's ops.
"""

import torch
import torch.nn.functional as F


def swiglu(h_M2F: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up in torch ops (what autograd differentiates off CUDA)."""
    gate_MF, up_MF = h_M2F.chunk(2, dim=-1)
    return F.silu(gate_MF) * up_MF


def swiglu_forward(h_M2F: torch.Tensor) -> torch.Tensor:
    """a = silu(gate) · up; on CUDA one kernel, whose a is the backward's recomputed a bit for bit."""
    if h_M2F.is_cuda:
        from moetrain.model.fp8_kernels import swiglu_forward as kernel

        return kernel(h_M2F)
    return swiglu(h_M2F)


def swiglu_backward(da_MF: torch.Tensor, h_M2F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gradient of h = [gate | up], a = silu(gate) · up recomputed) from a's gradient. On CUDA
    one kernel; elsewhere autograd's own formulas on the recomputed product (the bits of the
    unfused SwiGLU's backward)."""
    if h_M2F.is_cuda:
        from moetrain.model.fp8_kernels import swiglu_backward as kernel

        return kernel(da_MF, h_M2F)
    with torch.enable_grad():
        h = h_M2F.detach().requires_grad_()
        a_MF = swiglu(h)
        (dh_M2F,) = torch.autograd.grad(a_MF, h, da_MF)
    return dh_M2F, a_MF.detach()
