"""Routed experts: E SwiGLU MLPs stored as stacked tensors and run as grouped GEMMs.

Legend: M token-expert assignments (sorted by expert), D model dim, F expert hidden, E experts.

The input rows arrive sorted by expert with `offsets_E` (int32, on the device) marking where each
expert's rows end. `torch._grouped_mm` multiplies each row block by its expert's weights in one
kernel: no Python loop over experts, no host sync, dropless. The gate and up projections are one
fused weight, so a layer is two grouped GEMMs forward.

The layer's one seam is `GroupedExperts.mlp`: `expert_mlp` unless a precision converter gives
another. With `runtime.expert_grads` set (`compute.defer_expert_weight_grad`;
src/moetrain/model/expert_grads.py), the two products are `GroupedMM` and `SwiGLUGroupedMM`,
autograd functions whose weight gradients wait for the step's last backward and whose SwiGLU keeps
only h for backward; they run eagerly inside compiled blocks (their backward keeps tensors across
micro-batches, which a graph cannot). Row-wise FP8 runs the same two functions with its own
`GroupedProducts` (src/moetrain/model/fp8.py).
"""

from collections.abc import Callable, Hashable

import torch
from torch import nn

from moetrain.model.expert_grads import DeferredExpertGrads
from moetrain.model.runtime import ModelRuntime
from moetrain.model.swiglu import swiglu, swiglu_backward, swiglu_forward

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
        self.mlp: Callable[..., torch.Tensor] = expert_mlp
        """The layer's products, `expert_mlp`'s arguments in, y out: `expert_mlp` in the matmul dtype
        unless a precision converter gives another (`apply_fp8`, src/moetrain/model/fp8.py)."""

    def forward(
        self, x_MD: torch.Tensor, offsets_E: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """`weights`: the (gate_up, down) weights of the experts `offsets_E` names when they are
        some of this module's (a slice of each; the overlapped exchange runs a group of experts
        at a time: src/moetrain/parallel/overlapped_dispatcher.py); by default all of them."""
        w_gate_up, w_down = weights if weights is not None else (self.w_gate_up_E2FD, self.w_down_EDF)
        deferral = self._deferral(w_gate_up, w_down) if torch.is_grad_enabled() else (None, None)
        if torch.is_autocast_enabled(x_MD.device.type):  # autocast does not know _grouped_mm: cast the rows explicitly
            x_MD = x_MD.to(torch.get_autocast_dtype(x_MD.device.type))
        return self.mlp(x_MD, w_gate_up, w_down, offsets_E, deferral)

    def _deferral(self, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[Deferral | None, Deferral | None]:
        """Each weight's (deferral object, key) when its gradient is deferred, else None. A key
        names the weight and, for a group's slice, where the slice starts in it."""
        if self.runtime.expert_grads is None:
            return None, None
        return (
            (self.runtime.expert_grads, (id(self), "gate_up", w_gate_up.storage_offset())),
            (self.runtime.expert_grads, (id(self), "down", w_down.storage_offset())),
        )


def expert_mlp(x_MD, w_gate_up, w_down, offsets_E, deferral: tuple[Deferral | None, Deferral | None]) -> torch.Tensor:
    """The expert layer (grouped gate/up, SwiGLU, grouped down) in x's dtype, the weights' gradients
    deferred where `deferral` names them (`GroupedExperts._deferral`)."""
    if torch.is_autocast_enabled(x_MD.device.type):  # the CUDA fast path wants bf16 weights too
        w_gate_up, w_down = w_gate_up.to(x_MD.dtype), w_down.to(x_MD.dtype)
    if deferral[0] is not None:
        return deferred_expert_mlp(x_MD, w_gate_up, w_down, offsets_E, deferral)
    h_M2F = grouped_mm(x_MD, w_gate_up.transpose(-2, -1), offsets_E)
    return grouped_mm(swiglu(h_M2F), w_down.transpose(-2, -1), offsets_E)


def grouped_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Row-block-wise matmul: rows [offsets[e-1], offsets[e]) of `a` times `b[e]`."""
    if a_MK.device.type == "cpu" or a_MK.dtype != torch.bfloat16:
        return _ContiguousGrad.apply(eager_grouped_mm(a_MK, b_EKN, offsets_E))
    return _ContiguousGrad.apply(torch._grouped_mm(a_MK, b_EKN, offs=offsets_E))


@torch.compiler.disable
def eager_grouped_mm(a_MK: torch.Tensor, b_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    # torch.compile's shape propagation for _grouped_mm accepts only bf16 (the CUDA fast path's
    # rule), while eager _grouped_mm takes fp32 too (CPU, and CUDA's fallback): compiled blocks
    # (and the FP8 products' CPU emulation) call it eagerly on CPU and for any other dtype.
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


class GroupedProducts:
    """An expert layer's grouped GEMMs, forward and backward, in the operands' dtype: what
    `GroupedMM` and `SwiGLUGroupedMM` run. A precision converter brings its own (`Fp8Products`,
    `MxFp8Products`: src/moetrain/model/fp8.py)."""

    def forward(self, x_MK: torch.Tensor, w_ENK: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """Row block e of x (M, K) times w[e]ᵀ."""
        return torch._grouped_mm(x_MK, w_ENK.transpose(-2, -1), offs=offsets_E)

    def swiglu_forward(self, h_M2F: torch.Tensor, w_ENF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """`forward` of a = silu(gate) · up, from h = [gate | up]."""
        return self.forward(swiglu_forward(h_M2F), w_ENF, offsets_E)

    def input_grad(self, dy_MN: torch.Tensor, w_ENK: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """dx: row block e of dy times w[e]."""
        return torch._grouped_mm(dy_MN, w_ENK, offs=offsets_E)

    def weight_grad(self, dy_RN: torch.Tensor, x_RK: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """dW (E, N, K): expert e's rows of dyᵀ times its rows of x (autograd's own formula for a
        grouped GEMM whose weight operand is wᵀ)."""
        return torch._grouped_mm(dy_RN.t(), x_RK, offs=offsets_E)


def _weight_grad(ctx, dy_MN, x_MK, offsets_E, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight's gradient in `dtype` through `ctx.products`: None for a weight that takes none,
    and, deferred (`ctx.deferral`), before the step's last backward (`DeferredExpertGrads.weight_grad`)."""
    if not ctx.needs_input_grad[1]:
        return None
    if ctx.deferral is None:
        dw = ctx.products.weight_grad(dy_MN, x_MK, offsets_E)
    else:
        deferred, key = ctx.deferral
        dw = deferred.weight_grad(key, dy_MN, x_MK, offsets_E, ctx.products.weight_grad)
    return None if dw is None else dw.to(dtype)


class GroupedMM(torch.autograd.Function):
    """y (M, N): row block e of x (M, K) times w[e] (N, K)ᵀ, forward and gradients by `products`,
    the weight gradient deferred where `deferral` (a `Deferral` or None) says."""

    @staticmethod
    def forward(ctx, x_MK, w_ENK, offsets_E, products: GroupedProducts, deferral: Deferral | None):
        ctx.save_for_backward(x_MK, w_ENK, offsets_E)
        ctx.products, ctx.deferral = products, deferral
        return products.forward(x_MK, w_ENK, offsets_E)

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        x_MK, w_ENK, offsets_E = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx = ctx.products.input_grad(dy_MN, w_ENK, offsets_E)
        return dx.to(x_MK.dtype), _weight_grad(ctx, dy_MN, x_MK, offsets_E, w_ENK.dtype), None, None, None


class SwiGLUGroupedMM(torch.autograd.Function):
    """y (M, N): row block e of a = silu(gate) · up times w[e] (N, F)ᵀ, from h = [gate | up]
    (M, 2F), keeping only h (a is recomputed in backward, in the pass that gives h's gradient:
    src/moetrain/model/swiglu.py); products and deferral as `GroupedMM`'s."""

    @staticmethod
    def forward(ctx, h_M2F, w_ENF, offsets_E, products: GroupedProducts, deferral: Deferral | None):
        ctx.save_for_backward(h_M2F, w_ENF, offsets_E)
        ctx.products, ctx.deferral = products, deferral
        return products.swiglu_forward(h_M2F, w_ENF, offsets_E)

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        h_M2F, w_ENF, offsets_E = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        da_MF = ctx.products.input_grad(dy_MN, w_ENF, offsets_E)
        dh_M2F, a_MF = swiglu_backward(da_MF.to(h_M2F.dtype), h_M2F)
        return dh_M2F, _weight_grad(ctx, dy_MN, a_MF, offsets_E, w_ENF.dtype), None, None, None


@torch.compiler.disable  # the backward keeps tensors across micro-batches: no graph can hold that
def deferred_expert_mlp(x_MD, w_gate_up, w_down, offsets_E, deferral: tuple[Deferral, Deferral]) -> torch.Tensor:
    """The expert layer (grouped gate/up, SwiGLU, grouped down) with deferred weight gradients."""
    h_M2F = GroupedMM.apply(x_MD, w_gate_up, offsets_E, GroupedProducts(), deferral[0])
    return SwiGLUGroupedMM.apply(h_M2F, w_down, offsets_E, GroupedProducts(), deferral[1])
