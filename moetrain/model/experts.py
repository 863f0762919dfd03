"""Routed experts: E SwiGLU MLPs stored as stacked tensors and run as grouped GEMMs.

Legend: M token-expert assignments (sorted by expert), D model dim, F expert hidden, E experts.

The input rows arrive sorted by expert with `offsets_E` (int32, on the device) marking where each
expert's rows end. `torch._grouped_mm` multiplies each row block by its expert's weights in one
kernel: no Python loop over experts, no host sync, dropless. The gate and up projections are one
fused weight, so a layer is two grouped GEMMs forward.
"""

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.fp8 import fp8_grouped_mm, fp8_swiglu_grouped_mm, mxfp8_grouped_mm


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, d_model: int, hidden: int, expert_offset: int = 0):
        super().__init__()
        self.num_experts, self.d_model, self.hidden = num_experts, d_model, hidden
        # Global index of the first expert held here (expert parallelism holds a slice).
        self.expert_offset = expert_offset
        # nn.Linear layout per expert (out, in): [gate; up] stacked on the out dim.
        self.w_gate_up_E2FD = nn.Parameter(torch.empty(num_experts, 2 * hidden, d_model))
        self.w_down_EDF = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.fp8: str | None = None
        """FP8 grouped GEMMs (moetrain/model/fp8.py): "rowwise" or "mxfp8", set by `train.fp8`."""

    def forward(self, x_MD: torch.Tensor, offsets_E: torch.Tensor, group: "ExpertGroup | None" = None) -> torch.Tensor:
        """`group`: run experts [group.lo, group.hi) only (offsets_E then has one entry per expert
        of the group); their weight gradients are gathered by `group.grads` (`ExpertGroup`)."""
        w_gate_up, w_down = self.w_gate_up_E2FD, self.w_down_EDF
        if group is not None:
            w_gate_up, w_down = _GroupWeights.apply(w_gate_up, w_down, group)
        autocast = torch.is_autocast_enabled(x_MD.device.type)
        if autocast:  # autocast does not know _grouped_mm: cast the rows explicitly
            x_MD = x_MD.to(torch.get_autocast_dtype(x_MD.device.type))
        if self.fp8:
            # Weights are quantized from their stored values (bf16 or fp32); the outputs are bf16.
            if self.fp8 == "mxfp8":
                h_M2F = mxfp8_grouped_mm(x_MD, w_gate_up, offsets_E)
                gate_MF, up_MF = h_M2F.chunk(2, dim=-1)
                return mxfp8_grouped_mm(F.silu(gate_MF) * up_MF, w_down, offsets_E)
            # SwiGLU and the down projection as one function: only h is kept for backward.
            return fp8_swiglu_grouped_mm(fp8_grouped_mm(x_MD, w_gate_up, offsets_E), w_down, offsets_E)
        if autocast:  # the CUDA fast path wants bf16 weights too
            dtype = torch.get_autocast_dtype(x_MD.device.type)
            w_gate_up, w_down = w_gate_up.to(dtype), w_down.to(dtype)
        h_M2F = grouped_mm(x_MD, w_gate_up.transpose(-2, -1), offsets_E)
        gate_MF, up_MF = h_M2F.chunk(2, dim=-1)
        return grouped_mm(F.silu(gate_MF) * up_MF, w_down.transpose(-2, -1), offsets_E)


class GroupGrads:
    """The weight gradients of n expert groups of one layer (each a slice of the experts'
    weights), put together into one gradient per weight tensor. Autograd would give each group's
    slice its own full-size gradient (zeros elsewhere) and sum the n of them: n passes over the
    layer's expert weights. Here each group's backward copies its slice into one buffer, and the
    last of the n hands the whole buffer to autograd (the others give no gradient): one pass."""

    def __init__(self, groups: int):
        self.groups = groups
        self.seen = 0
        self.bufs: list[torch.Tensor] | None = None


class ExpertGroup:
    """Experts [lo, hi) of a GroupedExperts, and the gradients of the layer's groups."""

    __slots__ = ("lo", "hi", "grads")

    def __init__(self, lo: int, hi: int, grads: GroupGrads):
        self.lo, self.hi, self.grads = lo, hi, grads


class _GroupWeights(torch.autograd.Function):
    """The group's slices of the expert weights (views); backward: see `GroupGrads`."""

    @staticmethod
    def forward(ctx, w_gate_up, w_down, group):
        ctx.group = group
        ctx.shapes = (w_gate_up.shape, w_down.shape)
        return w_gate_up[group.lo : group.hi], w_down[group.lo : group.hi]

    @staticmethod
    def backward(ctx, grad_gate_up, grad_down):
        group, grads = ctx.group, ctx.group.grads
        if grads.bufs is None:
            like = (grad_gate_up, grad_down)
            grads.bufs = [g.new_empty(shape) for g, shape in zip(like, ctx.shapes)]
        for buf, g in zip(grads.bufs, (grad_gate_up, grad_down)):
            buf[group.lo : group.hi].copy_(g)
        grads.seen += 1
        if grads.seen < grads.groups:
            return None, None, None
        bufs, grads.bufs, grads.seen = grads.bufs, None, 0
        return bufs[0], bufs[1], None


def grouped_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Row-block-wise matmul: rows [offsets[e-1], offsets[e]) of `a` times `b[e]`."""
    if a_MK.device.type == "cpu":
        return _ContiguousGrad.apply(_grouped_mm_eager(a_MK, b_EKN, offsets_E))
    return _ContiguousGrad.apply(torch._grouped_mm(a_MK, b_EKN, offs=offsets_E))


@torch.compiler.disable
def _grouped_mm_eager(a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    # torch.compile's shape propagation for _grouped_mm accepts only bf16 (the CUDA kernel's
    # rule), while the CPU kernel runs fp32: on CPU, compiled blocks call it eagerly.
    return torch._grouped_mm(a_MK, b_EKN, offs=offsets_E)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    _grouped_mm's backward rejects gradients with zero or odd strides (e.g. from `.sum()` or an
    expand); downstream ops may produce such gradients.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()
