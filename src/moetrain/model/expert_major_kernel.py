"""`expert_major`'s row copy as one Triton kernel (CUDA): a micro-batch's rows of both operands,
dy (M, N) and x (M, K), each sent to its place in the step's expert-major layout.

Legend: M rows of the micro-batch (sorted by expert), R rows of the step, N and K the operands'
widths, E experts, G = E + 1 groups (the experts, then the padding rows past the last offset).

Row m of expert group g goes to row m + shift[g] (`expert_major` computes `shift`); each program
finds its rows' groups by counting the expert ends at or below them. The widths are compile-time
constants, so the stores go out as aligned 16-byte vectors. Why a kernel: `index_copy_` (the CPU
path) moved these rows at about 1.5 TB/s on one H200 (docs/measurements.md) and needs each row's
destination as an index tensor of its own; this kernel computes it where it copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R, BLOCK_C = 16, 256  # rows per program; columns per copy (bf16: 512 bytes a row)


@triton.jit
def _copy_block(src_ptr, dst_ptr, rows, dest, row_mask, WIDTH: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = tl.arange(0, BLOCK_C)
    for c in range(0, WIDTH, BLOCK_C):
        if WIDTH % BLOCK_C == 0:  # no column mask: whole vectors of every row
            mask = row_mask[:, None] & (cols[None, :] >= 0)
        else:
            mask = row_mask[:, None] & (c + cols[None, :] < WIDTH)
        values = tl.load(src_ptr + rows[:, None] * WIDTH + c + cols[None, :], mask=mask)
        tl.store(dst_ptr + dest[:, None] * WIDTH + c + cols[None, :], values, mask=mask)


@triton.jit
def _expert_major_rows_kernel(
    dy_ptr, dy_out_ptr, x_ptr, x_out_ptr, ends_ptr, shift_ptr, M,
    E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < M
    group = tl.zeros([BLOCK_R], dtype=tl.int32)
    for e in range(0, E):  # the expert ends at or below the row: its group (E past the last end)
        group += (tl.load(ends_ptr + e).to(tl.int64) <= rows).to(tl.int32)
    dest = rows + tl.load(shift_ptr + group, mask=row_mask, other=0)
    _copy_block(dy_ptr, dy_out_ptr, rows, dest, row_mask, N, BLOCK_C)
    _copy_block(x_ptr, x_out_ptr, rows, dest, row_mask, K, BLOCK_C)


def copy_rows_expert_major(
    dy_MN: torch.Tensor, x_MK: torch.Tensor, ends_E: torch.Tensor, shift_G: torch.Tensor,
    dy_RN: torch.Tensor, x_RK: torch.Tensor,
) -> None:  # fmt: skip
    """dy_RN[m + shift_G[g(m)]] = dy_MN[m] and the same for x, g(m) the group of row m
    (the number of `ends_E` at or below m)."""
    dy_MN, x_MK = dy_MN.contiguous(), x_MK.contiguous()
    M, N = dy_MN.shape
    if M == 0:
        return
    grid = (triton.cdiv(M, BLOCK_R),)
    _expert_major_rows_kernel[grid](
        dy_MN, dy_RN, x_MK, x_RK, ends_E, shift_G.long(), M,
        E=ends_E.shape[0], N=N, K=x_MK.shape[1], BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
    )  # fmt: skip
