"""FP8 matrix products for training, and MXFP8 quantization.

Legend: M rows (tokens, or expert assignments sorted by expert), K the reduction dim, N output
features, E experts.

**Row-wise recipe** (`precision.fp8=rowwise`; Hopper's scaled FP8 GEMMs). Each operand of a GEMM is
cast to float8_e4m3fn with one fp32 scale per row *along the reduction dim*:

    scale = 2^ceil(log2(amax / 448)),   q = round_e4m3(x / scale),   x ≈ q · scale

(the power of two makes the scaling exact and keeps |x / scale| ≤ 448, e4m3's largest finite
value: nothing saturates). The products accumulate in fp32 inside the kernel and come out in
bf16. Forward y = x·Wᵀ scales x per token and W per output feature; the input gradient
dx = dy·W scales dy per token and W per input feature; the weight gradient dW = dyᵀ·x scales
both per feature over the tokens (linear layers). For the grouped expert GEMMs the weight
gradient is a bf16 grouped GEMM: its reduction runs over each expert's variable-length token
block. Per-row scales confine the rows past the last offset (the uninitialized padding the
sync-free dispatcher leaves) to themselves.

On CUDA the products are `torch._scaled_mm` / `torch._scaled_grouped_mm`; on CPU both are
emulated exactly (dequantize, fp32 GEMM, round to bf16; torch 2.11's CPU `_scaled_mm` takes
per-tensor scales only), so the recipe's numerics are testable without a GPU.

Under `torch.compile` the FP8 products run as eager islands (`torch.compiler.disable`): compiled,
the backward's grouped GEMM hit a device-side assert on torch 2.11 (docs/benchmarks.md, "FP8").
Inside the islands the quantizers are Triton kernels with `quantize_rowwise`'s bits, each reading
its operand once (src/moetrain/model/fp8_kernels.py).

**MXFP8** (`precision.fp8=mxfp8`, the OCP microscaling format of Blackwell's tensor cores): blocks
of 32 elements along the reduction dim share a power-of-two e8m0 scale, chosen as above
(`quantize_mxfp8`). The forward and input-gradient products of the same GEMMs take MXFP8
operands, computed from the dequantized values (exact in bf16) with fp32 accumulation on any
device: MXFP8's numerics, not its speed (no Blackwell kernel is called); weight gradients stay bf16.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from moetrain.model.config import Fp8
from moetrain.model.experts import GroupedExperts, GroupedMM, GroupedProducts, SwiGLUGroupedMM, eager_grouped_mm
from moetrain.model.fp8_choice import Fp8Select, Product, choose
from moetrain.model.swiglu import swiglu

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
MX_BLOCK = 32


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax / s ≤ 448 (fp32); 1 for all-zero slices. Taken from
    the binary exponent of amax / 448 (v = m·2^e with m in [0.5, 1): ceil(log2 v) is e, or e − 1
    when m is exactly 0.5), so no rounding of a logarithm can pick the power below."""
    amax = amax.float()
    mantissa, exponent = torch.frexp(amax / E4M3_MAX)
    scale = torch.ldexp(torch.ones_like(amax), exponent - (mantissa == 0.5).to(exponent.dtype))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def quantize_rowwise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): q = e4m3(x / scale) with one fp32 scale per slice along `dim` (kept as a
    size-1 dim), x ≈ q.float() · scale."""
    scale = _pow2_scale(x.abs().amax(dim=dim, keepdim=True))
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def _quantize(x: torch.Tensor, dim: int, layout: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rowwise` for the GEMMs, q in the given layout. On CUDA the Triton kernels of
    src/moetrain/model/fp8_kernels.py (the same bits), elsewhere the plain formulation above."""
    if not x.is_cuda:
        q, scale = quantize_rowwise(x, dim)
        if layout == "col":  # the last two dims stored column-major (the FP8 GEMMs' second operand)
            return q.transpose(-2, -1).contiguous().transpose(-2, -1), scale
        return (q.contiguous() if layout == "row" else q), scale  # "row": x a transposed view
    from moetrain.model.fp8_kernels import quantize_cols_transposed, quantize_rows

    if (dim, layout) == (-1, None):
        return quantize_rows(x)
    if (dim, layout) == (-1, "row"):  # x a transposed view (dyᵀ): quantize dy's columns
        q, scale = quantize_cols_transposed(x.transpose(-2, -1))
        return q, scale.unsqueeze(-1)
    # (0 or −2, "col"): per column over the rows, q column-major = the transposed kernel's output
    q, scale = quantize_cols_transposed(x)
    return q.transpose(-2, -1), scale.unsqueeze(-2)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 along the last dim (a multiple of 32): (q e4m3 of x's shape, scales e8m0 of shape
    (…, K / 32)); x ≈ q.float() · scale repeated over each block."""
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"MXFP8 needs the last dim to be a multiple of {MX_BLOCK}, got {x.shape[-1]}")
    q, scale = quantize_rowwise(x.float().unflatten(-1, (-1, MX_BLOCK)), -1)  # each block a row
    return q.flatten(-2), scale.squeeze(-1).to(torch.float8_e8m0fnu)


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q.float().unflatten(-1, (-1, MX_BLOCK)) * scale.float().unsqueeze(-1)).flatten(-2)


FAST_ACCUM_FORWARD = True
"""Hopper's fast FP8 accumulation (partial sums not promoted to fp32) in forward's CUDA products,
as torchao's float8 training; backward's (`fast_backward`) with `precision.fp8_fast_accum_backward`
(docs/benchmarks.md, "FP8": throughput and 250-step loss curve)."""


def _scaled_mm(a_MK, b_KN, scale_M1, scale_1N, fast: bool = False) -> torch.Tensor:
    if a_MK.is_cuda:
        return torch._scaled_mm(a_MK, b_KN, scale_M1, scale_1N, out_dtype=torch.bfloat16, use_fast_accum=fast)
    return ((a_MK.float() * scale_M1) @ (b_KN.float() * scale_1N)).to(torch.bfloat16)


def _scaled_grouped_mm(a_MK, b_EKN, scale_M, scale_EN, offsets_E, fast: bool = False) -> torch.Tensor:
    """Row block e of a (rows offsets[e-1]..offsets[e]) times b[e], with row-wise scales; bf16."""
    if a_MK.is_cuda:
        return torch._scaled_grouped_mm(
            a_MK, b_EKN, scale_M, scale_EN, offs=offsets_E, out_dtype=torch.bfloat16, use_fast_accum=fast
        )
    return _emulated_scaled_grouped_mm(a_MK, b_EKN, scale_M, scale_EN, offsets_E)


@torch.compiler.disable
def _emulated_scaled_grouped_mm(a_MK, b_EKN, scale_M, scale_EN, offsets_E) -> torch.Tensor:
    """CPU: the same products from the dequantized operands (exact in fp32), rounded to bf16."""
    a = a_MK.float() * scale_M.unsqueeze(-1)
    b = b_EKN.float() * scale_EN.unsqueeze(-2)
    return torch._grouped_mm(a, b, offs=offsets_E).to(torch.bfloat16)


class _Fp8Linear(torch.autograd.Function):
    """y (M, N) = x (M, K) · w (N, K)ᵀ with all three GEMMs in row-wise FP8."""

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor, weight_grad: bool, fast_backward: bool) -> torch.Tensor:
        xq, xs = _quantize(x_MK, -1)
        wq, ws = _quantize(w_NK, -1)
        y = _scaled_mm(xq, wq.t(), xs, ws.t(), FAST_ACCUM_FORWARD)
        # The weight gradient's operand, kept quantized (1 byte an element instead of x's 2):
        # per input feature over the tokens, as the backward's dW = dyᵀ·x takes it.
        xtq, xts = _quantize(x_MK, 0, "col") if weight_grad else (None, None)
        ctx.save_for_backward(xtq, xts, w_NK)
        ctx.x_dtype, ctx.fast_backward = x_MK.dtype, fast_backward
        return y

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        xtq, xts, w_NK = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dyq, dys = _quantize(dy_MN, -1)  # per token, over N
        wq, ws = _quantize(w_NK, 0, "col")  # per input feature, over N
        dx = _scaled_mm(dyq, wq, dys, ws, ctx.fast_backward)
        dw = None
        if xtq is not None:
            dytq, dyts = _quantize(dy_MN.t(), -1, "row")  # per output feature, over tokens
            dw = _scaled_mm(dytq, xtq, dyts, xts, ctx.fast_backward).to(w_NK.dtype)
        return dx.to(ctx.x_dtype), dw, None, None


def _grouped_product(xq_MK, xs_M1, w_ENK, offsets_E) -> torch.Tensor:
    """Row block e of the quantized x times w[e]ᵀ (w quantized per output feature); bf16."""
    wq, ws = _quantize(w_ENK, -1)
    return _scaled_grouped_mm(
        xq_MK, wq.transpose(-2, -1), xs_M1.squeeze(-1), ws.squeeze(-1), offsets_E, FAST_ACCUM_FORWARD
    )


class Fp8Products(GroupedProducts):
    """The expert layer's grouped GEMMs in row-wise FP8: forward (from x, or straight from h =
    [gate | up] for SwiGLU's: `swiglu_forward`) and input gradient; the weight gradient a bf16
    grouped GEMM (fp32 on CPU). `fast_backward`: the input gradient with fast accumulation."""

    def __init__(self, fast_backward: bool = False):
        self.fast_backward = fast_backward

    def forward(self, x_MK, w_ENK, offsets_E) -> torch.Tensor:
        return _grouped_product(*_quantize(x_MK, -1), w_ENK, offsets_E)

    def swiglu_forward(self, h_M2F, w_ENF, offsets_E) -> torch.Tensor:
        """a = silu(gate) · up quantized per row; on CUDA one kernel that reads h and writes only a's q."""
        if h_M2F.is_cuda:
            from moetrain.model.fp8_kernels import swiglu_quantize_rows

            return _grouped_product(*swiglu_quantize_rows(h_M2F), w_ENF, offsets_E)
        return _grouped_product(*_quantize(swiglu(h_M2F), -1), w_ENF, offsets_E)

    def input_grad(self, dy_MN, w_ENK, offsets_E) -> torch.Tensor:
        """dx = dy · w[e] per row block: dy per token, w per expert and input feature, over N; bf16."""
        dyq, dys = _quantize(dy_MN, -1)
        wq, ws = _quantize(w_ENK, -2, "col")
        return _scaled_grouped_mm(dyq, wq, dys.squeeze(-1), ws.squeeze(-2), offsets_E, self.fast_backward)

    def weight_grad(self, dy_RN, x_RK, offsets_E) -> torch.Tensor:
        dt = torch.bfloat16 if dy_RN.is_cuda else torch.float32
        return _grouped(dy_RN.t().to(dt), x_RK.to(dt), offsets_E)


@torch.compiler.disable  # see the module docstring
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, fast_backward: bool = False) -> torch.Tensor:
    """x (…, K) · weight (N, K)ᵀ in row-wise FP8; bf16 out. `fast_backward`: the gradients'
    products with fast accumulation too (`FAST_ACCUM_FORWARD`)."""
    weight_grad = torch.is_grad_enabled() and weight.requires_grad  # not in evaluation
    y = _Fp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, weight_grad, fast_backward)
    return y.view(*x.shape[:-1], weight.shape[0])


@torch.compiler.disable  # see the module docstring
def fp8_grouped_mm(x_MK, w_ENK, offsets_E, fast_backward: bool = False, deferral=None):
    """Row block e of x times w[e]ᵀ in row-wise FP8. `deferral`: (a `DeferredExpertGrads`, this
    weight's key), the weight gradient computed once per step (src/moetrain/model/expert_grads.py)."""
    return GroupedMM.apply(x_MK, w_ENK, offsets_E, Fp8Products(fast_backward), deferral)


@torch.compiler.disable  # see the module docstring
def fp8_swiglu_grouped_mm(h_M2F, w_ENF, offsets_E, fast_backward: bool = False, deferral=None):
    """`fp8_grouped_mm(silu(gate) · up, w, offsets)` for h = [gate | up], keeping only h."""
    return SwiGLUGroupedMM.apply(h_M2F, w_ENF, offsets_E, Fp8Products(fast_backward), deferral)


def _mx(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x through MXFP8 (blocks of 32 along `dim`) and back: fp32 on CPU, bf16 on CUDA (exact)."""
    q, scale = quantize_mxfp8(x.movedim(dim, -1))
    return dequantize_mxfp8(q, scale).to(torch.bfloat16 if x.is_cuda else torch.float32).movedim(-1, dim)


class _MxLinear(torch.autograd.Function):
    """y = x·wᵀ and dx = dy·w from MXFP8 operands; dw = dyᵀ·x in bf16 (fp32 on CPU)."""

    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_NK)
        return (_mx(x_MK, -1) @ _mx(w_NK, -1).t()).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):
        x_MK, w_NK = ctx.saved_tensors
        dx = _mx(dy_MN, -1) @ _mx(w_NK, 0)
        dt = torch.bfloat16 if dy_MN.is_cuda else torch.float32
        dw = dy_MN.t().to(dt) @ x_MK.to(dt)
        return dx.to(x_MK.dtype), dw.to(w_NK.dtype)


class MxFp8Products(GroupedProducts):
    """The expert layer's forward and input-gradient products from MXFP8 operands (blocks along
    each row's reduction dim, so padding rows stay to themselves); the weight gradient in bf16."""

    def forward(self, x_MK, w_ENK, offsets_E) -> torch.Tensor:
        return _grouped(_mx(x_MK, -1), _mx(w_ENK, -1).transpose(-2, -1), offsets_E).to(torch.bfloat16)

    def input_grad(self, dy_MN, w_ENK, offsets_E) -> torch.Tensor:
        return _grouped(_mx(dy_MN, -1), _mx(w_ENK, -2), offsets_E)

    weight_grad = Fp8Products.weight_grad


def _grouped(a, b, offsets_E) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offsets_E) if a.is_cuda else eager_grouped_mm(a, b, offsets_E)


@torch.compiler.disable  # eager islands, as the row-wise recipe
def mxfp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (…, K) · weight (N, K)ᵀ with MXFP8 operands (emulated products, see the module docstring)."""
    return _MxLinear.apply(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])


@torch.compiler.disable
def mxfp8_grouped_mm(x_MK: torch.Tensor, w_ENK: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return GroupedMM.apply(x_MK, w_ENK, offsets_E, MxFp8Products(), None)


def _autocast(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype where autocast is on, as F.linear would take it: the FP8 products
    quantize (and keep for backward) bf16 activations, not the fp32 norm outputs; outside the
    FP8 island, so the cast fuses into the producing kernel of a compiled block."""
    if torch.is_autocast_enabled(x.device.type):
        return x.to(torch.get_autocast_dtype(x.device.type))
    return x


class Fp8Linear(nn.Linear):
    """nn.Linear (no bias) whose products run in row-wise FP8, on the `weight` Parameter of the
    nn.Linear it replaces (`apply_fp8`): names, initialization, checkpoints and optimizers see no
    difference. `fast_accum_backward`: the gradients' products with fast accumulation
    (`precision.fp8_fast_accum_backward`)."""

    def __init__(self, linear: nn.Linear, fast_accum_backward: bool = False):
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight, self.fast_accum_backward = linear.weight, fast_accum_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(_autocast(x), self.weight, self.fast_accum_backward)


class MxFp8Linear(Fp8Linear):
    """`Fp8Linear`'s replacement with MXFP8 operands instead (`precision.fp8=mxfp8`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mxfp8_linear(_autocast(x), self.weight)


def fp8_expert_mlp(x_MD, w_gate_up, w_down, offsets_E, deferral, fast_backward: bool = False) -> torch.Tensor:
    """`GroupedExperts.mlp` in row-wise FP8 (src/moetrain/model/experts.py): SwiGLU and the down
    projection as one function, so that only h is kept for backward. Weights are quantized from
    their stored values (bf16 or fp32); the outputs are bf16."""
    h_M2F = fp8_grouped_mm(x_MD, w_gate_up, offsets_E, fast_backward, deferral[0])
    return fp8_swiglu_grouped_mm(h_M2F, w_down, offsets_E, fast_backward, deferral[1])


def mxfp8_expert_mlp(x_MD, w_gate_up, w_down, offsets_E, deferral) -> torch.Tensor:
    """`GroupedExperts.mlp` with MXFP8 operands (no deferred weight gradients: the config refuses them)."""
    return mxfp8_grouped_mm(swiglu(mxfp8_grouped_mm(x_MD, w_gate_up, offsets_E)), w_down, offsets_E)


def _autocast_input(module: nn.Module, args: tuple) -> tuple:
    """A module's input cast to autocast's dtype once where its FP8 linears read it (the
    attention's q, k and v; a SwiGLU's gate and up): a forward pre-hook. Each FP8 island is a graph
    break: cast inside each linear, the second and third casts are compiled graphs of their own, a
    read of the fp32 input each (measured ~6.5 ms a step on bench-8e)."""
    return (_autocast(args[0]), *args[1:])


def apply_fp8(
    model: nn.Module,
    recipe: Fp8 = Fp8.rowwise,
    select: Fp8Select = Fp8Select.all,
    rows: int = 0,
    lm_head: bool = False,
    fast_backward: bool = False,
) -> None:
    """Convert a model (`Transformer`) to FP8 (`recipe`: rowwise or mxfp8) from outside: the expert
    grouped GEMMs and the linear layers inside the blocks except the router (a tiny product whose
    fp32 logits decide routing), all of them (`select` all, and always for mxfp8, whose products are
    emulated), or those whose shape at `rows` tokens per micro-batch repays it (`select` auto:
    src/moetrain/model/fp8_choice.py). A chosen `nn.Linear` is replaced by an `Fp8Linear` /
    `MxFp8Linear` holding its Parameter, and the module that holds it casts its input once for them
    all (`_autocast_input`); chosen experts get the FP8 expert layer as their `mlp`. Every GEMM dim
    must be a multiple of `recipe.align` (`RunConfig.validate` checks it from the config).
    `lm_head` (row-wise only): the LM head becomes an `Fp8Linear` too, which the chunked loss runs
    in FP8 (src/moetrain/model/loss.py). `fast_backward` (row-wise only): the backward products
    of every FP8 module with Hopper's fast accumulation, as forward's."""
    recipe = Fp8(recipe)
    select = Fp8Select.all if recipe == Fp8.mxfp8 else Fp8Select(select)
    linear_class = MxFp8Linear if recipe == Fp8.mxfp8 else Fp8Linear
    experts_mlp = mxfp8_expert_mlp if recipe == Fp8.mxfp8 else partial(fp8_expert_mlp, fast_backward=fast_backward)
    assignments = rows * model.cfg.moe.top_k
    for name, module in list(model.named_modules()):
        if isinstance(module, GroupedExperts):
            assert module.d_model % recipe.align == 0 and module.hidden % recipe.align == 0, name
            if choose(Product("experts", assignments, module.d_model, module.hidden, module.num_experts), select):
                module.mlp = experts_mlp
        chosen = [
            (child_name, child)
            for child_name, child in module.named_children()
            if type(child) is nn.Linear and ".blocks." in f".{name}.{child_name}"
            and choose(Product("linear", rows, child.in_features, child.out_features), select)
        ]  # fmt: skip
        for child_name, child in chosen:
            assert child.in_features % recipe.align == 0 and child.out_features % recipe.align == 0, name
            module.register_module(child_name, linear_class(child, fast_backward))
        if chosen:
            module.register_forward_pre_hook(_autocast_input)
    if lm_head and recipe == Fp8.rowwise and model.lm_head is not None:
        model.lm_head = Fp8Linear(model.lm_head, fast_backward)
