"""The optimizer's Triton kernels (CUDA): the AdamW update (`adamw_triton`, the Triton backend of
`adamw_update` in moetrain/optim/adamw.py), the accumulation of gradients over micro-batches
(`accumulate_grad`, `SplitMaster`'s) and the sum of squares of the clipping norm (`sum_squares`).

The AdamW kernel: per element it reads the parameter (fp32, or the bf16 half `hi` and the 16-bit
remainder `lo` of a split master, moetrain/optim/split_master.py), the gradient (fp32 or bf16) and
the two moments (fp32 or bf16), and writes all but the gradient back: for a split master with fp32
moments 16 bytes read (14 with a bf16 gradient), 12 written, as torch's fused fp32 AdamW; one
launch per tensor. The bias corrections (from the step count), the clipping factor and the skip
decision are read from device memory, so the host never waits. The arithmetic is
`adamw_reference`'s, with IEEE-rounded square root and division; tests/optim/test_split_master.py
and tests/optim/test_moments_bf16.py compare the two (on CPU through Triton's interpreter,
TRITON_INTERPRET=1), tests/gpu/test_cuda.py on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _bf16_bits(x):
    """fp32 → the int16 bits of the nearest bf16, ties to even (torch's cast; finite values)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _adamw_kernel(
    p_ptr,
    lo_ptr,
    grad_ptr,
    m_ptr,
    v_ptr,
    corr_ptr,
    coef_ptr,
    skip_ptr,
    n,
    lr,
    beta1,
    beta2,
    eps,
    decay,
    SPLIT: tl.constexpr,
    LOW_MOMENTS: tl.constexpr,
    HAS_COEF: tl.constexpr,
    HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_SKIP:
        mask = mask & (tl.load(skip_ptr) == 0)
    step_size = tl.load(corr_ptr)  # lr / (1 − β₁ᵗ)
    bias2_sqrt = tl.load(corr_ptr + 1)  # √(1 − β₂ᵗ)
    if SPLIT:  # p_ptr: the bf16 halves as int16
        hi = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
        lo = tl.load(lo_ptr + offs, mask=mask, other=0).to(tl.int32)
        p = (hi * 65536 + lo).to(tl.float32, bitcast=True)
    else:  # p_ptr: fp32 parameters
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # fp32 or bf16
    if HAS_COEF:
        g = g * tl.load(coef_ptr)
    if LOW_MOMENTS:  # bf16 moments, as int16 bits: exact in fp32
        m = (tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32) * 65536).to(tl.float32, bitcast=True)
        v = (tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32) * 65536).to(tl.float32, bitcast=True)
    else:
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * (1.0 - lr * decay)
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    if SPLIT:
        bits = p.to(tl.int32, bitcast=True)
        new_hi = (bits + 0x8000) >> 16
        new_lo = bits - new_hi * 65536
        tl.store(p_ptr + offs, new_hi.to(tl.int16), mask=mask)
        tl.store(lo_ptr + offs, new_lo.to(tl.int16), mask=mask)
    else:
        tl.store(p_ptr + offs, p, mask=mask)
    if LOW_MOMENTS:
        tl.store(m_ptr + offs, _bf16_bits(m), mask=mask)
        tl.store(v_ptr + offs, _bf16_bits(v), mask=mask)
    else:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def bias_corrections(step: torch.Tensor, lr: float, beta1: float, beta2: float) -> torch.Tensor:
    """[lr / (1 − β₁ᵗ), √(1 − β₂ᵗ)] for step count t (0-d device tensor) as a device tensor: the
    kernel's `corrections`, computed once per optimizer step."""
    t = step.double()
    return torch.stack([lr / (1 - beta1**t), (1 - beta2**t).sqrt()]).float()


def adamw_triton(
    param: torch.Tensor,
    lo: torch.Tensor | None,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    corrections: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_coef: torch.Tensor | None,
    skip: torch.Tensor | None,
) -> None:
    """`adamw_reference` of one tensor, on flat contiguous buffers: an fp32 `param` (lo None) or
    split masters (param: the bf16 halves, `lo` the remainders); moments fp32 or bf16;
    `corrections` from `bias_corrections` of the step count that includes this update;
    `grad_coef` multiplies the gradient; `skip` (device bool): leave everything as it is."""
    n = param.numel()
    tensors = (param, grad, exp_avg, exp_avg_sq) + ((lo,) if lo is not None else ())
    assert all(t.is_contiguous() and t.numel() == n for t in tensors)
    low = exp_avg.dtype != torch.float32
    assert exp_avg.dtype in (torch.float32, torch.bfloat16) and exp_avg_sq.dtype == exp_avg.dtype
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param.view(torch.int16) if lo is not None else param,
        lo if lo is not None else param,
        grad,
        exp_avg.view(torch.int16) if low else exp_avg,
        exp_avg_sq.view(torch.int16) if low else exp_avg_sq,
        corrections,
        grad_coef if grad_coef is not None else corrections,
        skip if skip is not None else corrections,
        n,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        SPLIT=lo is not None,
        LOW_MOMENTS=low,
        HAS_COEF=grad_coef is not None,
        HAS_SKIP=skip is not None,
        BLOCK=BLOCK,
    )


ACC_BLOCK = 4096


@triton.jit
def _accumulate_kernel(acc_ptr, grad_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(acc_ptr + offs, mask=mask).to(tl.float32)
    grad = tl.load(grad_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, acc + grad, mask=mask)


def accumulate_grad(acc: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """acc + grad in fp32, in one pass: into `acc` when it is fp32, else into a new fp32 tensor
    (the step's second backward, onto the first one's bf16 gradient); returns the sum. The same
    bits as torch's `acc.add_(grad)` / `acc.float() + grad`; torch runs a mixed-dtype add through
    its non-vectorized element-wise kernel at about half the memory bandwidth (bench-sweep-64:
    88 ms per step for 7 × 2.8B accumulated elements)."""
    assert acc.is_contiguous() and grad.is_contiguous() and acc.numel() == grad.numel()
    out = acc if acc.dtype == torch.float32 else torch.empty(acc.shape, dtype=torch.float32, device=acc.device)
    n = acc.numel()
    _accumulate_kernel[(triton.cdiv(n, ACC_BLOCK),)](acc, grad, out, n, BLOCK=ACC_BLOCK, num_warps=8)
    return out


SQ_BLOCK = 8192


@triton.jit
def _sum_squares_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[program] = Σ x² over the program's BLOCK elements, in fp32."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(x * x, axis=0))


def sum_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ‖t‖² over `tensors` (contiguous, any float dtype), in fp32, as a device scalar: one pass
    that writes a partial sum per block of SQ_BLOCK elements, then one sum of the partials (a
    fixed order: the same bits on every call, no atomics). The clipping norm's pass over every
    gradient: torch's `_foreach_norm` read bf16 gradients at 2.17 TB/s on an H200
    (benchmarks/step_bytes_probe.py), under half the bandwidth."""
    assert all(t.is_contiguous() for t in tensors)
    blocks = [triton.cdiv(t.numel(), SQ_BLOCK) for t in tensors]
    partials = torch.empty(sum(blocks), dtype=torch.float32, device=tensors[0].device)
    start = 0
    for t, b in zip(tensors, blocks):
        if b:
            _sum_squares_kernel[(b,)](t, partials[start : start + b], t.numel(), BLOCK=SQ_BLOCK, num_warps=8)
        start += b
    return partials.sum()
