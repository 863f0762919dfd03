"""FP8 numerics on CPU: the row-wise quantizer, the FP8 linear and grouped products (forward and
both gradients) against float64 references, and the MXFP8 quantizer against an independent
element-by-element reference. (The CUDA kernels are checked against these in tests/gpu.)"""

import math

import pytest
import torch

from moetrain.model.fp8 import (
    E4M3_MAX,
    MX_BLOCK,
    dequantize_mxfp8,
    fp8_expert_mlp,
    fp8_grouped_mm,
    fp8_linear,
    fp8_swiglu_grouped_mm,
    mxfp8_grouped_mm,
    mxfp8_linear,
    quantize_mxfp8,
    quantize_rowwise,
)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_rowwise_scales_are_powers_of_two_that_fit_e4m3():
    torch.manual_seed(0)
    x = torch.randn(16, 64) * torch.logspace(-3, 3, 16).unsqueeze(1)
    x[3] = 0  # an all-zero row must not divide by zero
    q, scale = quantize_rowwise(x, dim=-1)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (16, 1)
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)  # powers of two
    ratio = x.abs().amax(dim=-1, keepdim=True) / scale
    nonzero = ratio.squeeze(1) > 0
    assert torch.all(ratio[nonzero] <= E4M3_MAX) and torch.all(ratio[nonzero] > E4M3_MAX / 2)
    deq = q.float() * scale
    assert torch.all(deq[3] == 0)
    # e4m3 keeps 3 mantissa bits: each normal element is within 2^-4 of its value.
    normal = x.abs() >= scale * 2**-6
    assert torch.all((deq - x).abs()[normal] <= 2**-4 * x.abs()[normal] + 1e-12)
    assert rel(deq, x) < 0.04


def dequantized(x, dim):
    q, s = quantize_rowwise(x, dim)
    return q.double() * s.double()


def test_fp8_linear_forward_and_gradients():
    """Each product equals the float64 product of the quantized operands (up to the bf16 output),
    and stays within FP8's error of the exact product."""
    torch.manual_seed(1)
    x = torch.randn(64, 96)
    w = torch.randn(48, 96) * 0.05
    dy = torch.randn(64, 48)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xg, wg)
    y.backward(dy.to(y.dtype))
    assert y.dtype == torch.bfloat16 and xg.grad.dtype == torch.float32 and wg.grad.dtype == torch.float32
    dyb = dy.to(torch.bfloat16).float()
    # the same quantized operands, multiplied in float64
    assert rel(y, dequantized(x, -1) @ dequantized(w, -1).T) < 4e-3
    assert rel(xg.grad, dequantized(dyb, -1) @ dequantized(w, 0)) < 4e-3
    assert rel(wg.grad, dequantized(dyb.T, -1) @ dequantized(x, 0)) < 4e-3
    # and FP8's error against the exact products
    assert rel(y, x.double() @ w.double().T) < 0.06
    assert rel(xg.grad, dyb.double() @ w.double()) < 0.06
    assert rel(wg.grad, dyb.double().T @ x.double()) < 0.06


def test_fp8_linear_keeps_leading_dims():
    y = fp8_linear(torch.randn(2, 8, 32), torch.randn(16, 32))
    assert y.shape == (2, 8, 16)


def test_fp8_grouped_mm_forward_and_gradients_ignore_padding_rows():
    """Experts own row blocks (one of them empty); rows past the last offset hold garbage (NaN,
    as the sync-free dispatcher may leave) and must not reach any valid row or gradient."""
    torch.manual_seed(2)
    E, K, N, M = 4, 64, 32, 72
    offsets = torch.tensor([10, 30, 30, 60], dtype=torch.int32)
    x = torch.randn(M, K)
    x[60:] = float("nan")
    w = torch.randn(E, N, K) * 0.05
    dy = torch.randn(M, N)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_grouped_mm(xg, wg, offsets)
    y.backward(dy.to(y.dtype))
    dyb = dy.to(torch.bfloat16).double()
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    want_y, want_dx = torch.zeros(60, N, dtype=torch.float64), torch.zeros(60, K, dtype=torch.float64)
    want_dw = torch.zeros(E, N, K, dtype=torch.float64)
    for e, (a, b) in enumerate(zip(starts, ends)):
        want_y[a:b] = x[a:b].double() @ w[e].double().T
        want_dx[a:b] = dyb[a:b] @ w[e].double()
        want_dw[e] = dyb[a:b].T @ x[a:b].double()
    assert torch.isfinite(y[:60]).all() and torch.isfinite(xg.grad[:60]).all() and torch.isfinite(wg.grad).all()
    assert rel(y[:60], want_y) < 0.06
    assert rel(xg.grad[:60], want_dx) < 0.06
    assert rel(wg.grad, want_dw) < 1e-5  # the weight gradient is not quantized (fp32 on CPU)
    assert torch.all(wg.grad[2] == 0)  # the empty expert


def test_fp8_swiglu_down_is_swiglu_then_the_grouped_product_bit_for_bit():
    """The fused SwiGLU + down projection (one function, keeping only h = [gate | up]) gives the
    unfused composition's output and gradients bit for bit on CPU, padding rows included (NaN
    there stays there)."""
    torch.manual_seed(3)
    E, F, N, M = 4, 48, 32, 72
    offsets = torch.tensor([10, 30, 30, 60], dtype=torch.int32)
    h = torch.randn(M, 2 * F)
    h[60:] = float("nan")
    w = torch.randn(E, N, F) * 0.05
    dy = torch.randn(M, N).to(torch.bfloat16)

    def run(fused):
        hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            y = fp8_swiglu_grouped_mm(hg, wg, offsets)
        else:
            gate, up = hg.chunk(2, dim=-1)
            y = fp8_grouped_mm(torch.nn.functional.silu(gate) * up, wg, offsets)
        y.backward(dy)
        return y, hg.grad, wg.grad

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got[:60], want[:60]) and got.dtype == want.dtype
    assert torch.isfinite(run(True)[2]).all()


def test_fp8_products_keep_only_what_backward_needs():
    """Kept for backward: the expert layer's h = [gate | up] but not silu(gate) · up (recomputed);
    the FP8 linear's input as its e4m3 weight-gradient operand (1 byte an element, not 4 or 2),
    and nothing of it when no weight gradient is asked for."""
    from moetrain.model.experts import GroupedExperts

    E, D, F, M = 4, 64, 96, 80
    experts = GroupedExperts(E, D, F)
    experts.mlp = fp8_expert_mlp
    torch.nn.init.normal_(experts.w_gate_up_E2FD, std=0.1)
    torch.nn.init.normal_(experts.w_down_EDF, std=0.1)
    offsets = torch.tensor([20, 40, 60, 80], dtype=torch.int32)

    def kept(fn, *args):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fn(*args)
        return [(tuple(t.shape), t.dtype) for t in saved]

    shapes = [shape for shape, _ in kept(experts, torch.randn(M, D, requires_grad=True), offsets)]
    assert (M, 2 * F) in shapes and (M, F) not in shapes, shapes
    x, w = torch.randn(M, D, requires_grad=True), torch.randn(32, D, requires_grad=True)
    saved = kept(fp8_linear, x, w)
    assert ((M, D), torch.float8_e4m3fn) in saved and ((M, D), torch.float32) not in saved, saved
    assert ((M, D), torch.float8_e4m3fn) not in kept(fp8_linear, x, w.detach())


def _e4m3_table():
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).double()
    keep = ~torch.isnan(values)
    return codes[keep].tolist(), values[keep].tolist()


def _round_e4m3(v: float, codes, values) -> float:
    """Nearest e4m3 value, ties to the even code (independent of torch's cast)."""
    best = min(range(len(values)), key=lambda i: (abs(values[i] - v), codes[i] & 1))
    return values[best]


def test_mxfp8_quantizer_matches_an_elementwise_reference():
    torch.manual_seed(3)
    x = torch.randn(3, 4 * MX_BLOCK) * torch.tensor([1e-3, 1.0, 300.0]).unsqueeze(1)
    x[1, :MX_BLOCK] = 0  # an all-zero block
    q, scale = quantize_mxfp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 4)
    codes, values = _e4m3_table()
    for r in range(3):
        for blk in range(4):
            block = x[r, blk * MX_BLOCK : (blk + 1) * MX_BLOCK].double().tolist()
            amax = max(abs(v) for v in block)
            # the smallest power of two s with amax / s <= 448 (1 for an all-zero block)
            exp = 0 if amax == 0 else math.ceil(math.log2(amax / 448))
            if amax and amax / 2.0**exp > 448:
                exp += 1
            assert scale[r, blk].float().item() == 2.0**exp, (r, blk)
            got = q[r, blk * MX_BLOCK : (blk + 1) * MX_BLOCK].double().tolist()
            want = [_round_e4m3(v / 2.0**exp, codes, values) for v in block]
            assert got == want, (r, blk)
    assert rel(dequantize_mxfp8(q, scale)[0], x[0]) < 0.04


def test_mxfp8_needs_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.randn(4, 48))


def test_compiled_quantizer_equals_the_eager_one():
    """What the GEMMs use on CUDA (`_quantize`: the row-wise quantizer compiled, one function per
    dim, dynamic shapes) is bit-identical to the eager reference; here compiled for the CPU."""
    from moetrain.model.fp8 import _quantize

    torch.manual_seed(0)
    x = torch.randn(48, 96, dtype=torch.bfloat16)
    x[5] = 0  # an all-zero row: scale 1
    cases = [
        ((-1, None), x),
        ((-1, "row"), torch.randn(96, 40).t() * 3),
        ((0, "col"), x),
        ((-2, "col"), torch.randn(3, 16, 24, dtype=torch.bfloat16)),
    ]
    for key, x in cases:
        compiled = torch.compile(lambda t, key=key: _quantize(t, *key), dynamic=True)
        (q, s), (q_ref, s_ref) = compiled(x), quantize_rowwise(x, key[0])
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), key
        if key[1] == "row":
            assert q.is_contiguous()
        if key[1] == "col":
            assert q.transpose(-2, -1).is_contiguous()


def _mx_ref(x: torch.Tensor, dim: int) -> torch.Tensor:
    """MXFP8 round trip along `dim` in float64, from the quantizer tested above."""
    q, scale = quantize_mxfp8(x.movedim(dim, -1))
    return dequantize_mxfp8(q, scale).double().movedim(-1, dim)


def test_mxfp8_linear_products_use_blocks_along_each_reduction_dim():
    """train.fp8=mxfp8: y = x·wᵀ and dx = dy·w equal float64 products of the MXFP8 round trips
    (blocks along K for the forward, along N for the input gradient) up to the bf16 output; the
    weight gradient is the unquantized dyᵀ·x."""
    torch.manual_seed(1)
    x = torch.randn(64, 96, requires_grad=True)
    w = (torch.randn(128, 96) * 0.05).requires_grad_()
    dy = torch.randn(64, 128).bfloat16().float()  # what reaches backward through y's bf16
    y = mxfp8_linear(x, w)
    y.float().backward(dy)
    assert y.dtype == torch.bfloat16
    assert rel(y, _mx_ref(x.detach(), -1) @ _mx_ref(w.detach(), -1).T) < 4e-3  # bf16 rounding only
    assert rel(x.grad, _mx_ref(dy, -1) @ _mx_ref(w.detach(), 0)) < 4e-3
    assert rel(w.grad, dy.double().T @ x.detach().double()) < 1e-5
    assert rel(y, x.detach() @ w.detach().T) < 0.06  # and FP8-close to the exact product


def test_mxfp8_grouped_mm_matches_per_expert_products():
    torch.manual_seed(2)
    offsets = torch.tensor([32, 32, 96], dtype=torch.int32)  # the second expert gets no rows
    x = torch.randn(96, 64, requires_grad=True)
    w = (torch.randn(3, 32, 64) * 0.1).requires_grad_()
    dy = torch.randn(96, 32).bfloat16().float()
    y = mxfp8_grouped_mm(x, w, offsets)
    y.float().backward(dy)
    bounds = [(0, 32, 0), (32, 96, 2)]
    for lo, hi, e in bounds:
        want = _mx_ref(x.detach()[lo:hi], -1) @ _mx_ref(w.detach()[e], -1).T
        assert rel(y[lo:hi], want) < 4e-3
        want_dx = _mx_ref(dy[lo:hi], -1) @ _mx_ref(w.detach()[e], 0)
        assert rel(x.grad[lo:hi], want_dx) < 4e-3
        assert rel(w.grad[e], dy[lo:hi].double().T @ x.detach()[lo:hi].double()) < 1e-5
    assert torch.all(w.grad[1] == 0)
