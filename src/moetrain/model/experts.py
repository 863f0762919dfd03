"""Routed experts: E SwiGLU MLPs stored as stacked tensors and run as grouped GEMMs.

Legend: M token-expert assignments (sorted by expert), D model dim, F expert hidden, E experts.

The input rows arrive sorted by expert with `offsets_E` (int32, on the device) marking where each
expert's rows end. `torch._grouped_mm` multiplies each row block by its expert's weights in one
kernel: no Python loop over experts, no host sync, dropless. The gate and up projections are one
fused weight, so a layer is two grouped GEMMs forward.

With `runtime.expert_grads` set (`compute.defer_expert_weight_grad`; src/moetrain/model/expert_grads.py),
the two products are autograd functions of their own whose weight gradients wait for the step's last
backward and whose SwiGLU keeps only h for backward, as row-wise FP8's does; they run eagerly inside
compiled blocks (their backward keeps tensors across micro-batches, which a graph cannot).
"""

from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.expert_grads import DeferredExpertGrads
from moetrain.model.fp8 import fp8_grouped_mm, fp8_swiglu_grouped_mm, mxfp8_grouped_mm
from moetrain.model.runtime import ModelRuntime
from moetrain.model.swiglu import swiglu_backward, swiglu_forward

Deferral = tuple[DeferredExpertGrads, Hashable]
"""The shared deferral object and the key of one expert weight (or one group's slice of it)."""


class GroupedExperts(nn.Module):
    def __init__(
        self, num_experts: int, d_model: int, hidden: int, expert_offset: int = 0, runtime: ModelRuntime | None = None
    ):
        super().__init__()
        self.runtime = runtime or ModelRuntime()
        self.num_experts, self.d_model, self.hidden = num_experts, d_model, hidden
        # Global index of the first expert held here (expert parallelism holds a slice).
        self.expert_offset = expert_offset
        # nn.Linear layout per expert (out, in): [gate; up] stacked on the out dim.
        self.w_gate_up_E2FD = nn.Parameter(torch.empty(num_experts, 2 * hidden, d_model))
        self.w_down_EDF = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.fp8: str | None = None
        """FP8 grouped GEMMs (src/moetrain/model/fp8.py): "rowwise" or "mxfp8", set by `precision.fp8`."""
        self.fp8_fast_accum_backward = False
        """Row-wise FP8's input-gradient products with fast accumulation (`precision.fp8_fast_accum_backward`)."""

    def forward(
        self, x_MD: torch.Tensor, offsets_E: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """`weights`: the (gate_up, down) weights of the experts `offsets_E` names when they are
        some of this module's (a slice of each; the overlapped exchange runs a group of experts
        at a time: src/moetrain/parallel/overlapped_dispatcher.py); by default all of them."""
        w_gate_up, w_down = weights if weights is not None else (self.w_gate_up_E2FD, self.w_down_EDF)
        deferral = self._deferral(w_gate_up, w_down) if torch.is_grad_enabled() else (None, None)
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
            fast = self.fp8_fast_accum_backward
            h_M2F = fp8_grouped_mm(x_MD, w_gate_up, offsets_E, fast, deferral[0])
            return fp8_swiglu_grouped_mm(h_M2F, w_down, offsets_E, fast, deferral[1])
        if autocast:  # the CUDA fast path wants bf16 weights too
            dtype = torch.get_autocast_dtype(x_MD.device.type)
            w_gate_up, w_down = w_gate_up.to(dtype), w_down.to(dtype)
        if deferral[0] is not None:
            return deferred_expert_mlp(x_MD, w_gate_up, w_down, offsets_E, *deferral)
        h_M2F = grouped_mm(x_MD, w_gate_up.transpose(-2, -1), offsets_E)
        gate_MF, up_MF = h_M2F.chunk(2, dim=-1)
        return grouped_mm(F.silu(gate_MF) * up_MF, w_down.transpose(-2, -1), offsets_E)

    def _deferral(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[Deferral | None, Deferral | None]:
        """Each weight's (deferral object, key) when its gradient is deferred, else None. A key
        names the weight and, for a group's slice, where the slice starts in it."""
        if self.runtime.expert_grads is None:
            return None, None
        return (
            (self.runtime.expert_grads, (id(self), "gate_up", w_gate_up.storage_offset())),
            (self.runtime.expert_grads, (id(self), "down", w_down.storage_offset())),
        )


def grouped_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Row-block-wise matmul: rows [offsets[e-1], offsets[e]) of `a` times `b[e]`."""
    if a_MK.device.type == "cpu" or a_MK.dtype != torch.bfloat16:
        return _ContiguousGrad.apply(_grouped_mm_eager(a_MK, b_EKN, offsets_E))
    return _ContiguousGrad.apply(torch._grouped_mm(a_MK, b_EKN, offs=offsets_E))


@torch.compiler.disable
def _grouped_mm_eager(a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    # torch.compile's shape propagation for _grouped_mm accepts only bf16 (the CUDA fast path's
    # rule), while eager _grouped_mm takes fp32 too (CPU, and CUDA's fallback): compiled blocks
    # call it eagerly on CPU and for any other dtype.
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


def _weight_grad(dy_RN: torch.Tensor, x_RK: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """dW (E, N, K): expert e's rows of dyᵀ times its rows of x (autograd's own formula for a
    grouped GEMM whose weight operand is wᵀ)."""
    return torch._grouped_mm(dy_RN.t(), x_RK, offs=offsets_E)


def _deferred_weight_grad(ctx, dy_MN, x_MK, offsets_E) -> torch.Tensor | None:
    """The weight's gradient through `DeferredExpertGrads.weight_grad` (None before the step's
    last backward, and for a weight that takes none)."""
    if not ctx.needs_input_grad[1]:
        return None
    deferred, key = ctx.deferral
    return deferred.weight_grad(key, dy_MN, x_MK, offsets_E, _weight_grad)


class _DeferredGroupedMM(torch.autograd.Function):
    """y (M, N): row block e of x (M, K) times w[e] (N, K)ᵀ; the weight gradient through
    `DeferredExpertGrads.weight_grad` (None before the step's last backward)."""

    @staticmethod
    def forward(ctx, x_MK, w_ENK, offsets_E, deferral: Deferral):
        ctx.save_for_backward(x_MK, w_ENK, offsets_E)
        ctx.deferral = deferral
        return torch._grouped_mm(x_MK, w_ENK.transpose(-2, -1), offs=offsets_E)

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        x_MK, w_ENK, offsets_E = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx = torch._grouped_mm(dy_MN, w_ENK, offs=offsets_E) if ctx.needs_input_grad[0] else None
        return dx, _deferred_weight_grad(ctx, dy_MN, x_MK, offsets_E), None, None


class _DeferredSwiGLUGroupedMM(torch.autograd.Function):
    """y (M, N): row block e of a = silu(gate) · up times w[e] (N, F)ᵀ, from h = [gate | up]
    (M, 2F), keeping only h (a is recomputed in backward, in the pass that gives h's gradient);
    the weight gradient as `_DeferredGroupedMM`'s."""

    @staticmethod
    def forward(ctx, h_M2F, w_ENF, offsets_E, deferral: Deferral):
        ctx.save_for_backward(h_M2F, w_ENF, offsets_E)
        ctx.deferral = deferral
        return torch._grouped_mm(swiglu_forward(h_M2F), w_ENF.transpose(-2, -1), offs=offsets_E)

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        h_M2F, w_ENF, offsets_E = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dh_M2F, a_MF = swiglu_backward(torch._grouped_mm(dy_MN, w_ENF, offs=offsets_E), h_M2F)
        return dh_M2F, _deferred_weight_grad(ctx, dy_MN, a_MF, offsets_E), None, None


@torch.compiler.disable  # the backward keeps tensors across micro-batches: no graph can hold that
def deferred_expert_mlp(
    x_MD: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offsets_E: torch.Tensor,
    gate_up: Deferral,
    down: Deferral,
) -> torch.Tensor:
    """The expert layer (grouped gate/up, SwiGLU, grouped down) with deferred weight gradients."""
    h_M2F = _DeferredGroupedMM.apply(x_MD, w_gate_up, offsets_E, gate_up)
    return _DeferredSwiGLUGroupedMM.apply(h_M2F, w_down, offsets_E, down)
