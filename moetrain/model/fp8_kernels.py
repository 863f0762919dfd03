"""The row-wise FP8 quantizers of moetrain/model/fp8.py as Triton kernels (CUDA).

Legend: R rows, C columns (the last, contiguous dim), B a leading batch dim (experts).

Every operand of the row-wise recipe is quantized along one dim, in one of two shapes:
- `quantize_rows`: along the contiguous last dim (activations per token, weights per output
  feature): one program per row, which holds a row of up to 8192 elements in registers, so x is
  read once and q written once: 2 + 1 bytes per bf16 element. Asked for the column maxima too
  (for a later column-wise quantization of the same operand), a program takes 16 rows in turn
  and folds their |x| into a (C,) buffer by one atomic max per column.
- `quantize_cols_transposed`: along dim −2 of a (B, R, C) tensor, q written transposed as
  (B, C, R) row-major: what the FP8 GEMMs take as their second operand (column-major) or as a
  transposed first one. A column's scale needs all its R rows, and R is long (32k tokens), so
  two kernels keep the GPU full: column maxima over chunks of rows, folded by atomic max; then
  tiles cast with their columns' scales and written transposed (reads coalesced along C, writes
  along R): 2 + 2 + 1 bytes per bf16 element.

Measured on bench-8e (docs/benchmarks.md): Inductor's compiled plain formulation spent ~47 ms of
a 293 ms step in quantization; one program per column block (a first version of the transposed
kernel) left most of the GPU idle at R = 32k and spent 54 ms in that kernel alone; row tiles of
16k elements per program (instead of one row, or 16 in a loop) ran at half the speed.

Numerics are `fp8.quantize_rowwise`'s bit for bit: the scale is 2^ceil(log2(amax / 448)) taken
from amax / 448's fp32 bits (exact, no log2 approximation), the division by the scale is a
multiplication by its exact reciprocal, and the cast to e4m3 rounds to nearest even after the
clamp. tests/model/test_fp8_kernels.py compares both in Triton's interpreter on CPU, and
tests/gpu/test_cuda.py on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
ROW_BLOCK = 8192  # rows up to this long are read once, kept in registers
TILE_R, TILE_C = 128, 64  # the cast-and-transpose tiles
AMAX_CHUNK_R, AMAX_TILE_R, AMAX_TILE_C = 256, 32, 128  # the column-amax programs
AMAX_ROWS = 16  # rows per program when the row quantizer also takes column maxima


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
def _rows_kernel(
    x_ptr, q_ptr, scale_ptr, amax_ptr, stride_x, stride_q, R, C: tl.constexpr, BLOCK: tl.constexpr,
    ROWS: tl.constexpr, COL_AMAX: tl.constexpr
):
    """ROWS rows of batch b (R rows each) per program. With COL_AMAX (whole rows in registers) the
    program also folds its rows' |x| into amax (B, C) by atomic max: the column maxima that the
    transposed quantization of the same operand needs later, without reading it again."""
    b = tl.program_id(1)
    first = tl.program_id(0) * ROWS
    if C <= BLOCK:  # whole rows in registers: one read
        cols = tl.arange(0, BLOCK)
        col_max = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(ROWS):
            r = first + i
            ok = r < R
            row = (b * R + r).to(tl.int64)
            x = tl.load(x_ptr + row * stride_x + cols, mask=(cols < C) & ok, other=0.0).to(tl.float32)
            scale, inverse = _pow2_scale_and_inverse(tl.max(tl.abs(x), axis=0))
            tl.store(scale_ptr + row, scale, mask=ok)
            tl.store(q_ptr + row * stride_q + cols, _to_e4m3(x, inverse), mask=(cols < C) & ok)
            if COL_AMAX:
                col_max = tl.maximum(col_max, tl.abs(x))
        if COL_AMAX:
            tl.atomic_max(amax_ptr + b * C + cols, col_max, mask=cols < C)
    else:  # a pass for the amax, a pass for the cast (its reads hit the cache); one row
        row = (b * R + first).to(tl.int64)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, C, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < C, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale, inverse = _pow2_scale_and_inverse(tl.max(amax, axis=0))
        tl.store(scale_ptr + row, scale)
        for start in range(0, C, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + cols, mask=cols < C, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * stride_q + cols, _to_e4m3(x, inverse), mask=cols < C)


@triton.jit
def _col_amax_kernel(
    x_ptr, amax_ptr, stride_xb, stride_xr, R: tl.constexpr, C: tl.constexpr, CHUNK_R: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
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
    x_ptr, amax_ptr, q_ptr, scale_ptr, stride_xb, stride_xr, R: tl.constexpr, C: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
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


def quantize_rows(x: torch.Tensor, col_amax: bool = False):
    """x (…, C) → (q e4m3 of x's shape, row-major; scale fp32 (…, 1); and with `col_amax` the
    maxima of |x| per column: (C,) for 2-D x, (B, C) per leading index for 3-D x — the input of
    `quantize_cols_transposed(x, amax=…)`, so the transposed pass reads x once)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    C = x.shape[-1]
    B = x.shape[0] if x.dim() == 3 else 1
    x_RC = x.reshape(-1, C)  # a view for every tensor the GEMMs pass (rows evenly strided)
    R = x_RC.shape[0] // B if B else 0
    q_RC = torch.empty(x_RC.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale_R = torch.empty(x_RC.shape[0], dtype=torch.float32, device=x.device)
    block = min(ROW_BLOCK, triton.next_power_of_2(max(C, 1)))
    fused = col_amax and C <= block
    amax_BC = torch.zeros((B, C), dtype=torch.float32, device=x.device) if fused else scale_R
    if x_RC.numel():
        rows = AMAX_ROWS if fused else 1
        _rows_kernel[(triton.cdiv(R, rows), B)](
            x_RC, q_RC, scale_R, amax_BC, x_RC.stride(0), q_RC.stride(0), R, C=C, BLOCK=block, ROWS=rows,
            COL_AMAX=fused, num_warps=8 if block >= 4096 else 4,
        )
    q, scale = q_RC.view(x.shape), scale_R.view(*x.shape[:-1], 1)
    if not col_amax:
        return q, scale
    if not fused:  # rows too long to hold: the column maxima by their own kernel
        return q, scale, _column_amax(x)
    return q, scale, amax_BC if x.dim() == 3 else amax_BC[0]


def _column_amax(x: torch.Tensor) -> torch.Tensor:
    x_BRC = x if x.dim() == 3 else x.unsqueeze(0)
    B, R, C = x_BRC.shape
    amax_BC = torch.zeros((B, C), dtype=torch.float32, device=x.device)
    if x_BRC.numel():
        _col_amax_kernel[(triton.cdiv(C, AMAX_TILE_C), triton.cdiv(R, AMAX_CHUNK_R), B)](
            x_BRC, amax_BC, x_BRC.stride(0), x_BRC.stride(1), R=R, C=C, CHUNK_R=AMAX_CHUNK_R,
            BLOCK_R=AMAX_TILE_R, BLOCK_C=AMAX_TILE_C, num_warps=4,
        )
    return amax_BC if x.dim() == 3 else amax_BC[0]


def quantize_cols_transposed(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) or (B, R, C), contiguous last dim → (q e4m3 (…, C, R) row-major, scale fp32 (…, C)):
    each column quantized over its R rows, written transposed. `amax`: x's column maxima if
    already known (from `quantize_rows(x, col_amax=True)`), else computed here."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    x_BRC = x if x.dim() == 3 else x.unsqueeze(0)
    B, R, C = x_BRC.shape
    q_BCR = torch.empty((B, C, R), dtype=torch.float8_e4m3fn, device=x.device)
    scale_BC = torch.empty((B, C), dtype=torch.float32, device=x.device)
    if x_BRC.numel():
        amax_BC = (_column_amax(x) if amax is None else amax).reshape(B, C)
        _cols_transposed_kernel[(triton.cdiv(C, TILE_C), triton.cdiv(R, TILE_R), B)](
            x_BRC, amax_BC, q_BCR, scale_BC, x_BRC.stride(0), x_BRC.stride(1), R=R, C=C, BLOCK_R=TILE_R,
            BLOCK_C=TILE_C, num_warps=4,
        )
    if x.dim() == 2:
        return q_BCR[0], scale_BC[0]
    return q_BCR, scale_BC
