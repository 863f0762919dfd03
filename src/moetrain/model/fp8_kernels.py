"""The row-wise FP8 quantizers of src/moetrain/model/fp8.py as Triton kernels (CUDA).

Legend: R rows, C columns (the last, contiguous dim), B a leading batch dim (experts).

Every operand of the row-wise recipe is quantized along one dim, in one of two shapes:
- `quantize_rows`: along the contiguous last dim (activations per token, weights per output
  feature): one program per row, which holds a row of up to 8192 elements in registers, so x is
  read once and q written once: 2 + 1 bytes per bf16 element.
- `quantize_cols_transposed`: along dim −2 of a (B, R, C) tensor, q written transposed as
  (B, C, R) row-major: what the FP8 GEMMs take as their second operand (column-major) or as a
  transposed first one. A column's scale needs all its R rows, and R is long (32k tokens), so
  two kernels keep the GPU full: column maxima over chunks of rows, folded by atomic max; then
  tiles cast with their columns' scales and written transposed (reads coalesced along C, writes
  along R): 2 + 2 + 1 bytes per bf16 element.

Why this shape (benchmarks/probes/fp8_quant_probe.py, bench-8e's operands on one H200): one
program per column block leaves most of the GPU idle at R = 32k, and taking the column maxima
inside the row quantizer runs at ~1.5 TB/s against ~3.8 for rows alone plus ~2.7 for separate
maxima, so the passes stay separate. (Inductor's compiled plain formulation spends ~47 ms of
bench-8e's 293 ms step in quantization.)

Numerics are `fp8.quantize_rowwise`'s bit for bit: the scale is 2^ceil(log2(amax / 448)) taken
from amax / 448's fp32 bits (exact, no log2 approximation), the division by the scale is a
multiplication by its exact reciprocal, and the cast to e4m3 rounds to nearest even after the
clamp. tests/model/test_fp8_kernels.py compares both in Triton's interpreter on CPU, and
tests/gpu/test_cuda.py on the GPU.

The SwiGLU passes over an expert layer's h = [gate | up] live here too (fused with the FP8
quantizer, and plain forward and backward, which the deferred bf16 products use as well:
src/moetrain/model/swiglu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
ROW_BLOCK = 8192  # rows up to this long are read once, kept in registers
# Launch configurations: the fastest of benchmarks/probes/fp8_quant_probe.py's on bench-8e's shapes
# (docs/measurements.md): rows ~3.8-4.1 TB/s with 4 warps, column maxima ~2.7, cast-and-transpose ~3.7.
TILE_R, TILE_C = 64, 128  # the cast-and-transpose tiles
AMAX_CHUNK_R, AMAX_TILE_R, AMAX_TILE_C = 256, 64, 128  # the column-amax programs


@triton.jit
def _pow2_scale_and_inverse(amax):
    """(2^ceil(log2(amax / 448)), its reciprocal) from the fp32 bits of amax / 448; (1, 1) for 0.
    Exact for amax / 448 in fp32's normal range (every finite bf16 activation or weight)."""
    v = tl.div_rn(amax, 448.0)
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    exponent = tl.where(amax > 0, exponent, 0)
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    return scale, inverse


@triton.jit
def _to_e4m3(x, inverse):
    """e4m3(clamp(x · inverse, ±448)), rounded to nearest even in fp32 bits before the cast, so the
    cast itself is exact (the interpreter's cast rounds ties differently from the GPU's)."""
    v = tl.clamp(x * inverse, -448.0, 448.0)
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    subnormal = (a + 16384.0) - 16384.0  # below 2⁻⁶: multiples of 2⁻⁹, fp32's spacing at 2¹⁴
    r = tl.where(a >= 0.015625, normal, subnormal)
    sign = v.to(tl.int32, bitcast=True) & -0x80000000
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _rows_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, C: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    if C <= BLOCK:  # the whole row in registers: one read
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < C, other=0.0).to(tl.float32)
        scale, inverse = _pow2_scale_and_inverse(tl.max(tl.abs(x), axis=0))
        tl.store(scale_ptr + row, scale)
        tl.store(q_row + cols, _to_e4m3(x, inverse), mask=cols < C)
    else:  # a pass for the amax, a pass for the cast (its reads hit the cache)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, C, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < C, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale, inverse = _pow2_scale_and_inverse(tl.max(amax, axis=0))
        tl.store(scale_ptr + row, scale)
        for start in range(0, C, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < C, other=0.0).to(tl.float32)
            tl.store(q_row + cols, _to_e4m3(x, inverse), mask=cols < C)


@triton.jit
def _col_amax_kernel(
    x_ptr,
    amax_ptr,
    stride_xb,
    stride_xr,
    R: tl.constexpr,
    C: tl.constexpr,
    CHUNK_R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Column maxima of |x| over one chunk of rows, folded into amax (B, C) by atomic max."""
    b = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    first = tl.program_id(1) * CHUNK_R
    x_b = x_ptr + b * stride_xb
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, CHUNK_R, BLOCK_R):
        rows = first + start + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        x = tl.load(x_b + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=0))
    tl.atomic_max(amax_ptr + b * C + cols, amax, mask=cols < C)


@triton.jit
def _cols_transposed_kernel(
    x_ptr,
    amax_ptr,
    q_ptr,
    scale_ptr,
    stride_xb,
    stride_xr,
    R: tl.constexpr,
    C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One (rows × columns) tile cast with its columns' scales and written transposed."""
    b = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    col_ok = cols < C
    scale, inverse = _pow2_scale_and_inverse(tl.load(amax_ptr + b * C + cols, mask=col_ok, other=0.0))
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + b * C + cols, scale, mask=col_ok)
    mask = (rows[:, None] < R) & col_ok[None, :]
    x = tl.load(x_ptr + b * stride_xb + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask=mask, other=0.0)
    q = _to_e4m3(x.to(tl.float32), inverse[None, :])
    out = q_ptr + b * C * R + cols[:, None].to(tl.int64) * R + rows[None, :]
    tl.store(out, tl.trans(q), mask=tl.trans(mask))


@triton.jit
def _swiglu(g, u):
    """SwiGLU's product in fp32, rounded to bf16 once (as a compiled block computes it), to nearest
    even in the fp32 bits (the interpreter's own cast truncates)."""
    bits = (g / (1.0 + tl.exp(-g)) * u).to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _swiglu_rows_kernel(h_ptr, q_ptr, scale_ptr, stride_h, stride_q, F: tl.constexpr, BLOCK: tl.constexpr):
    """One row of a = silu(gate) · up from h = [gate | up] (2F), quantized along its F elements:
    h read once, a never written (the producer of the FP8 operand is its quantizer)."""
    row = tl.program_id(0).to(tl.int64)
    h_row, q_row = h_ptr + row * stride_h, q_ptr + row * stride_q
    if F <= BLOCK:
        cols = tl.arange(0, BLOCK)
        g = tl.load(h_row + cols, mask=cols < F, other=0.0).to(tl.float32)
        u = tl.load(h_row + F + cols, mask=cols < F, other=0.0).to(tl.float32)
        a = _swiglu(g, u)
        scale, inverse = _pow2_scale_and_inverse(tl.max(tl.abs(a), axis=0))
        tl.store(scale_ptr + row, scale)
        tl.store(q_row + cols, _to_e4m3(a, inverse), mask=cols < F)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, F, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            g = tl.load(h_row + cols, mask=cols < F, other=0.0).to(tl.float32)
            u = tl.load(h_row + F + cols, mask=cols < F, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(_swiglu(g, u)))
        scale, inverse = _pow2_scale_and_inverse(tl.max(amax, axis=0))
        tl.store(scale_ptr + row, scale)
        for start in range(0, F, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            g = tl.load(h_row + cols, mask=cols < F, other=0.0).to(tl.float32)
            u = tl.load(h_row + F + cols, mask=cols < F, other=0.0).to(tl.float32)
            tl.store(q_row + cols, _to_e4m3(_swiglu(g, u), inverse), mask=cols < F)


@triton.jit
def _swiglu_backward_kernel(da_ptr, h_ptr, dh_ptr, a_ptr, stride_da, stride_h, F: tl.constexpr, BLOCK: tl.constexpr):
    """For one block of a row: dh = [d gate | d up] from da and h = [gate | up], and a = silu(gate)
    · up again (for the weight gradient), in one pass: reads da, gate, up; writes both halves of dh
    and a."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    h_row, da_row = h_ptr + row * stride_h, da_ptr + row * stride_da
    g = tl.load(h_row + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(h_row + F + cols, mask=ok, other=0.0).to(tl.float32)
    da = tl.load(da_row + cols, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = g * sig
    dh_row, a_row = dh_ptr + row * stride_h, a_ptr + row * stride_da
    tl.store(dh_row + cols, (da * u * sig * (1.0 + g * (1.0 - sig))).to(dh_ptr.dtype.element_ty), mask=ok)
    tl.store(dh_row + F + cols, (da * silu).to(dh_ptr.dtype.element_ty), mask=ok)
    tl.store(a_row + cols, (silu * u).to(a_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_forward_kernel(h_ptr, a_ptr, stride_h, stride_a, F: tl.constexpr, BLOCK: tl.constexpr):
    """For one block of a row: a = silu(gate) · up from h = [gate | up], in fp32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    h_row = h_ptr + row * stride_h
    g = tl.load(h_row + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(h_row + F + cols, mask=ok, other=0.0).to(tl.float32)
    silu = g * (1.0 / (1.0 + tl.exp(-g)))
    tl.store(a_ptr + row * stride_a + cols, (silu * u).to(a_ptr.dtype.element_ty), mask=ok)


def swiglu_quantize_rows(h_M2F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h = [gate | up] (M, 2F), contiguous rows → (q e4m3 (M, F), scale fp32 (M, 1)) of
    a = silu(gate) · up (bf16-rounded), each row quantized along F."""
    if h_M2F.stride(-1) != 1:
        h_M2F = h_M2F.contiguous()
    M, F = h_M2F.shape[0], h_M2F.shape[1] // 2
    q_MF = torch.empty((M, F), dtype=torch.float8_e4m3fn, device=h_M2F.device)
    scale_M = torch.empty(M, dtype=torch.float32, device=h_M2F.device)
    if q_MF.numel():
        block = min(ROW_BLOCK // 2, triton.next_power_of_2(F))  # gate and up in registers
        _swiglu_rows_kernel[(M,)](h_M2F, q_MF, scale_M, h_M2F.stride(0), F, F=F, BLOCK=block, num_warps=4)
    return q_MF, scale_M.view(M, 1)


SWIGLU_BLOCK = 1024


def swiglu_backward(da_MF: torch.Tensor, h_M2F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh (M, 2F) in h's dtype, a = silu(gate) · up (M, F) in da's dtype) from the gradient da of
    a and h = [gate | up], computed in fp32 from the loaded values."""
    da_MF, h_M2F = da_MF.contiguous(), h_M2F.contiguous()
    M, F = da_MF.shape
    dh_M2F = torch.empty_like(h_M2F)
    a_MF = torch.empty_like(da_MF)
    if da_MF.numel():
        grid = (M, triton.cdiv(F, SWIGLU_BLOCK))  # rows on the axis without a 65535 limit
        _swiglu_backward_kernel[grid](da_MF, h_M2F, dh_M2F, a_MF, F, 2 * F, F=F, BLOCK=SWIGLU_BLOCK, num_warps=4)
    return dh_M2F, a_MF


def swiglu_forward(h_M2F: torch.Tensor) -> torch.Tensor:
    """a = silu(gate) · up (M, F) in h's dtype from h = [gate | up] (M, 2F), computed in fp32 from
    the loaded values (the backward kernel's recomputation of a, bit for bit)."""
    h_M2F = h_M2F.contiguous()
    M, F = h_M2F.shape[0], h_M2F.shape[1] // 2
    a_MF = torch.empty((M, F), dtype=h_M2F.dtype, device=h_M2F.device)
    if a_MF.numel():
        grid = (M, triton.cdiv(F, SWIGLU_BLOCK))
        _swiglu_forward_kernel[grid](h_M2F, a_MF, 2 * F, F, F=F, BLOCK=SWIGLU_BLOCK, num_warps=4)
    return a_MF


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (…, C) with a contiguous last dim → (q e4m3 of x's shape, row-major; scale fp32 (…, 1))."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    x_RC = x.reshape(-1, x.shape[-1])  # a view for every tensor the GEMMs pass (rows evenly strided)
    q_RC = torch.empty(x_RC.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale_R = torch.empty(x_RC.shape[0], dtype=torch.float32, device=x.device)
    if x_RC.numel():
        block = min(ROW_BLOCK, triton.next_power_of_2(x_RC.shape[1]))
        _rows_kernel[(x_RC.shape[0],)](
            x_RC, q_RC, scale_R, x_RC.stride(0), q_RC.stride(0), C=x_RC.shape[1], BLOCK=block, num_warps=4
        )
    return q_RC.view(x.shape), scale_R.view(*x.shape[:-1], 1)


def _column_amax(x_BRC: torch.Tensor) -> torch.Tensor:
    """max |x| per (b, column) over the rows: (B, C) fp32."""
    B, R, C = x_BRC.shape
    amax_BC = torch.zeros((B, C), dtype=torch.float32, device=x_BRC.device)
    if x_BRC.numel():
        _col_amax_kernel[(triton.cdiv(C, AMAX_TILE_C), triton.cdiv(R, AMAX_CHUNK_R), B)](
            x_BRC,
            amax_BC,
            x_BRC.stride(0),
            x_BRC.stride(1),
            R=R,
            C=C,
            CHUNK_R=AMAX_CHUNK_R,
            BLOCK_R=AMAX_TILE_R,
            BLOCK_C=AMAX_TILE_C,
            num_warps=4,
        )
    return amax_BC


def quantize_cols_transposed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) or (B, R, C), contiguous last dim → (q e4m3 (…, C, R) row-major, scale fp32 (…, C)):
    each column quantized over its R rows, written transposed."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    x_BRC = x if x.dim() == 3 else x.unsqueeze(0)
    B, R, C = x_BRC.shape
    q_BCR = torch.empty((B, C, R), dtype=torch.float8_e4m3fn, device=x.device)
    scale_BC = torch.empty((B, C), dtype=torch.float32, device=x.device)
    if x_BRC.numel():
        amax_BC = _column_amax(x_BRC)
        _cols_transposed_kernel[(triton.cdiv(C, TILE_C), triton.cdiv(R, TILE_R), B)](
            x_BRC,
            amax_BC,
            q_BCR,
            scale_BC,
            x_BRC.stride(0),
            x_BRC.stride(1),
            R=R,
            C=C,
            BLOCK_R=TILE_R,
            BLOCK_C=TILE_C,
            num_warps=4,
        )
    if x.dim() == 2:
        return q_BCR[0], scale_BC[0]
    return q_BCR, scale_BC
