"""The Triton FP8 quantizers (src/moetrain/model/fp8_kernels.py): in Triton's interpreter on CPU they
give `quantize_rowwise`'s bytes and scales (ties, negative zeros, all-zero rows, amax just above a
power of two); they compile for Hopper ahead of time. tests/gpu/test_cuda.py checks them on the GPU."""

import pytest
import torch
from support.steps import run_in_triton_interpreter

from moetrain.model.fp8 import _pow2_scale

triton = pytest.importorskip("triton")

KERNEL_CHECK = """
import torch
from moetrain.model.fp8 import quantize_rowwise
from moetrain.model.fp8_kernels import quantize_cols_transposed, quantize_rows

def same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

torch.manual_seed(0)
for dtype in (torch.bfloat16, torch.float32):
    x = (torch.randn(41, 1100) * torch.logspace(-12, 3, 41).unsqueeze(1)).to(dtype)
    x[3] = 0
    x[4, :7] = -0.0
    x[5, 0] = 448 * 2.0**-3 * (1 + 2.0**-7)  # amax / 448 just above a power of two
    x[6] = torch.arange(1100) * 2.0**-9  # many exact ties between e4m3 neighbours
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rowwise(x, -1)
    assert same(q, q_ref) and torch.equal(s, s_ref), dtype
    w = (torch.randn(3, 150, 130) * torch.logspace(-5, 2, 130)).to(dtype)
    q, s = quantize_cols_transposed(w)
    q_ref, s_ref = quantize_rowwise(w, -2)
    assert same(q, q_ref.transpose(-2, -1).contiguous()) and torch.equal(s, s_ref.squeeze(-2)), dtype
    q, s = quantize_cols_transposed(x.t())  # a transposed view: made contiguous first
    q_ref, s_ref = quantize_rowwise(x.t(), 0)
    assert same(q, q_ref.t().contiguous()) and torch.equal(s, s_ref.squeeze(0)), dtype
long = (torch.randn(3, 9000) * 3).bfloat16()  # past ROW_BLOCK: the two-pass path
q, s = quantize_rows(long)
q_ref, s_ref = quantize_rowwise(long, -1)
assert same(q, q_ref) and torch.equal(s, s_ref)
tall = torch.randn(700, 70) * torch.logspace(-3, 3, 700).unsqueeze(1)  # several row chunks per column
q, s = quantize_cols_transposed(tall)
q_ref, s_ref = quantize_rowwise(tall, 0)
assert same(q, q_ref.t().contiguous()) and torch.equal(s, s_ref.squeeze(0))
print("ok")
"""


def test_quantizer_kernels_give_the_reference_bits_in_the_interpreter():
    result = run_in_triton_interpreter(KERNEL_CHECK)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


SWIGLU_CHECK = """
import torch
import torch.nn.functional as F
from moetrain.model.fp8 import quantize_rowwise
from moetrain.model.fp8_kernels import swiglu_backward, swiglu_forward, swiglu_quantize_rows

torch.manual_seed(0)
for M, Fh in ((37, 96), (5, 4100)):  # one row in registers; past the block: two passes
    h = (torch.randn(M, 2 * Fh) * torch.logspace(-3, 1, M).unsqueeze(1)).bfloat16()
    h[2] = 0
    g, u = h.float().chunk(2, dim=-1)
    a_ref = (F.silu(g) * u).bfloat16()  # fp32 product, rounded to bf16 once
    q, s = swiglu_quantize_rows(h)
    q_ref, s_ref = quantize_rowwise(a_ref, -1)
    assert q.shape == (M, Fh) and s.shape == (M, 1)
    assert torch.equal(s, s_ref), (M, Fh)
    same = q.view(torch.uint8) == q_ref.view(torch.uint8)
    # exp's last fp32 bit may differ from torch's; then a's bf16 rounding, and one e4m3 step
    assert same.float().mean() > 0.999, same.float().mean()
    deq, deq_ref = q.float() * s, q_ref.float() * s_ref
    assert ((deq - deq_ref).abs() <= deq_ref.abs() * 2.0**-3 + 1e-30)[~same].all()
    da = torch.randn(M, Fh).bfloat16()
    dh, a = swiglu_backward(da, h)
    hh = h.float().requires_grad_()
    gg, uu = hh.chunk(2, dim=-1)
    a32 = F.silu(gg) * uu
    (dh32,) = torch.autograd.grad(a32, hh, da.float())
    assert dh.dtype == torch.bfloat16 and a.dtype == torch.bfloat16 and dh.shape == h.shape
    for got, want in ((dh, dh32), (a, a32.detach())):
        assert ((got.float() - want).abs() <= want.abs() * 2.0**-7 + 1e-30).all()  # the cast may truncate
    assert torch.equal(swiglu_forward(h), a)  # forward's product is backward's recomputed one
print("ok")
"""


def test_swiglu_kernels_give_the_fp32_formulation_in_the_interpreter():
    """The fused SwiGLU-and-quantize kernel gives quantize_rowwise of bf16(silu(gate) · up) (up to
    one e4m3 step where exp's last bit rounds a differently), the backward kernel autograd's
    fp32 gradient of [gate | up] and the recomputed product, each to bf16 rounding, and the
    forward kernel that product bit for bit."""
    result = run_in_triton_interpreter(SWIGLU_CHECK)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_pow2_scale_is_the_smallest_power_of_two_that_fits():
    """2^ceil(log2(amax / 448)) from the binary exponent: exact where a rounded log2 is not."""
    amax = torch.tensor([448.0, 448 * (1 + 2.0**-23), 448 * 2.0**-20 * (1 + 2.0**-23), 1e-30, 0.0, 3e38])
    scale = _pow2_scale(amax)
    assert torch.all((amax / scale <= 448) & (amax / scale > 224) | (amax == 0))
    assert scale[0] == 1 and scale[1] == 2 and scale[4] == 1


@pytest.mark.parametrize(
    "kernel",
    [
        "rows",
        "rows_long",
        "col_amax",
        "cols",
        "swiglu_rows",
        "swiglu_forward",
        "swiglu_backward",
    ],
)
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_quantizer_kernels_compile_for_sm90(kernel, dtype):
    from triton.backends.compiler import GPUTarget

    from moetrain.model import fp8_kernels as k

    strides = {"stride_xb": "i64", "stride_xr": "i64", "R": "constexpr", "C": "constexpr"}
    if kernel.startswith("rows"):
        fn = k._rows_kernel
        signature = {
            "x_ptr": dtype,
            "q_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32",
            "stride_x": "i64",
            "stride_q": "i64",
            "C": "constexpr",
            "BLOCK": "constexpr",
        }
        values = {"C": 4096 if kernel == "rows" else 50000, "BLOCK": 4096 if kernel == "rows" else k.ROW_BLOCK}
    elif kernel == "swiglu_rows":
        fn = k._swiglu_rows_kernel
        signature = {
            "h_ptr": dtype,
            "q_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32",
            "stride_h": "i64",
            "stride_q": "i64",
            "F": "constexpr",
            "BLOCK": "constexpr",
        }
        values = {"F": 4096, "BLOCK": 4096}
    elif kernel == "swiglu_forward":
        fn = k._swiglu_forward_kernel
        signature = {"h_ptr": dtype, "a_ptr": dtype, "stride_h": "i64", "stride_a": "i64"}
        signature |= {"F": "constexpr", "BLOCK": "constexpr"}
        values = {"F": 4096, "BLOCK": k.SWIGLU_BLOCK}
    elif kernel == "swiglu_backward":
        fn = k._swiglu_backward_kernel
        signature = {
            "da_ptr": dtype,
            "h_ptr": dtype,
            "dh_ptr": dtype,
            "a_ptr": dtype,
            "stride_da": "i64",
            "stride_h": "i64",
            "F": "constexpr",
            "BLOCK": "constexpr",
        }
        values = {"F": 4096, "BLOCK": k.SWIGLU_BLOCK}
    elif kernel == "col_amax":
        fn = k._col_amax_kernel
        signature = {
            "x_ptr": dtype,
            "amax_ptr": "*fp32",
            **strides,
            "CHUNK_R": "constexpr",
            "BLOCK_R": "constexpr",
            "BLOCK_C": "constexpr",
        }
        values = {"R": 32768, "C": 4096, "CHUNK_R": k.AMAX_CHUNK_R, "BLOCK_R": k.AMAX_TILE_R, "BLOCK_C": k.AMAX_TILE_C}
    else:
        fn = k._cols_transposed_kernel
        signature = {
            "x_ptr": dtype,
            "amax_ptr": "*fp32",
            "q_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32",
            **strides,
            "BLOCK_R": "constexpr",
            "BLOCK_C": "constexpr",
        }
        values = {"R": 32768, "C": 4096, "BLOCK_R": k.TILE_R, "BLOCK_C": k.TILE_C}
    names = list(signature)
    source = triton.compiler.ASTSource(
        fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in values.items()}
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    assert ".target sm_90" in compiled.asm["ptx"] and len(compiled.asm["cubin"]) > 1000
