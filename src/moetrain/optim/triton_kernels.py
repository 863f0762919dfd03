"""The optimizer's Triton kernels (CUDA): the AdamW update (`adamw_triton`, the Triton backend of
`adamw_update` in src/moetrain/optim/adamw.py), the accumulation of gradients over micro-batches
(`accumulate_grad`, `SplitMaster`'s), the sum of squares of the clipping norm (`sum_squares`) and
Muon's symmetric products, one triangle of each (`symmetric_product`).

The AdamW kernel: per element it reads the parameter (fp32, or the bf16 half `hi` and the 16-bit
remainder `lo` of a split master, src/moetrain/optim/split_master.py), the gradient (fp32 or bf16) and
the two moments (fp32 or bf16), and writes all but the gradient back: for a split master with fp32
moments 16 bytes read (14 with a bf16 gradient), 12 written, as torch's fused fp32 AdamW; one
launch per tensor (`adamw_triton`), or, over a split master's flat buffers, one per gradient
dtype (`adamw_triton_flat`, which finds each gradient through a table of addresses: 256 launches
kept bench-small32e's update host-bound, docs/measurements.md "The optimizer's launches"). The
sum of squares runs one launch per dtype the same way. The bias corrections (from the step
count), the clipping factor and the skip decision are read from device memory, so the host never
waits. The arithmetic is
`adamw_reference`'s, with IEEE-rounded square root and division; tests/optim/test_split_master.py
and tests/optim/test_moments_bf16.py compare the two (on CPU through Triton's interpreter,
TRITON_INTERPRET=1), tests/gpu/test_cuda.py on the GPU.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import torch
import triton
import triton.language as tl

from moetrain.transfer import pinned_for, to_device

BLOCK = 2048


@triton.jit
def _bf16_bits(x):
    """fp32 → the int16 bits of the nearest bf16, ties to even (torch's cast; finite values)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _adamw_block(
    p_ptr, lo_ptr, g, m_ptr, v_ptr, offs, mask, corr_ptr, coef_ptr, beta1, beta2, eps, decay,
    SPLIT: tl.constexpr, LOW_MOMENTS: tl.constexpr, HAS_COEF: tl.constexpr,
):  # fmt: skip
    """The update of the elements `offs` (where `mask`) of the parameter and moments, from their
    gradient `g` (fp32, loaded by the caller)."""
    step_size = tl.load(corr_ptr)  # lr / (1 − β₁ᵗ)
    bias2_sqrt = tl.load(corr_ptr + 1)  # √(1 − β₂ᵗ)
    lr = tl.load(corr_ptr + 2)
    if SPLIT:  # p_ptr: the bf16 halves as int16
        hi = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
        lo = tl.load(lo_ptr + offs, mask=mask, other=0).to(tl.int32)
        p = (hi * 65536 + lo).to(tl.float32, bitcast=True)
    else:  # p_ptr: fp32 parameters
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
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


@triton.jit
def _adamw_kernel(
    p_ptr, lo_ptr, grad_ptr, m_ptr, v_ptr, corr_ptr, coef_ptr, skip_ptr, n, beta1, beta2, eps, decay,
    SPLIT: tl.constexpr, LOW_MOMENTS: tl.constexpr, HAS_COEF: tl.constexpr, HAS_SKIP: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if HAS_SKIP:
        mask = mask & (tl.load(skip_ptr) == 0)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # fp32 or bf16
    _adamw_block(
        p_ptr, lo_ptr, g, m_ptr, v_ptr, offs, mask, corr_ptr, coef_ptr, beta1, beta2, eps, decay,
        SPLIT, LOW_MOMENTS, HAS_COEF,
    )  # fmt: skip


@triton.jit
def _block_of(first_ptr, T, STEPS: tl.constexpr):
    """(tensor i, the first element of block `pid` in it) for this program's block: i is the last
    tensor whose first block is at most pid, found by bisection over the T + 1 first blocks
    (`_first_blocks`): first[lo] ≤ pid < first[hi] throughout, STEPS ≥ log2(T) halvings."""
    pid = tl.program_id(0)
    lo = pid * 0
    hi = lo + T
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        right = tl.load(first_ptr + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo, (pid - tl.load(first_ptr + lo)).to(tl.int64)


@triton.jit
def _adamw_table_kernel(
    p_ptr, lo_ptr, grad_addrs_ptr, m_ptr, v_ptr, first_ptr, T, numel_ptr, base_ptr,
    corr_ptr, coef_ptr, skip_ptr, beta1, beta2, eps, decay,
    GRAD_DTYPE: tl.constexpr, SPLIT: tl.constexpr, LOW_MOMENTS: tl.constexpr, HAS_COEF: tl.constexpr,
    HAS_SKIP: tl.constexpr, ALIGNED: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """`_adamw_kernel` over T tensors in one launch: block `pid` updates elements
    [start, start + BLOCK) of tensor i (`_block_of`), whose parameter and moments are at `base`
    in the flat buffers and whose gradient is at its own address (`grad_addrs`)."""
    i, block = _block_of(first_ptr, T, STEPS)
    n, base, grad_ptr = tl.load(numel_ptr + i), tl.load(base_ptr + i), tl.load(grad_addrs_ptr + i)
    grad_ptr = grad_ptr.to(tl.pointer_type(GRAD_DTYPE))
    if ALIGNED:  # what the per-tensor kernel's arguments tell the compiler: vector loads and stores
        n, base, grad_ptr = tl.multiple_of(n, 16), tl.multiple_of(base, 16), tl.multiple_of(grad_ptr, 16)
    local = tl.multiple_of(block * BLOCK, BLOCK) + tl.arange(0, BLOCK)
    mask = local < n
    if HAS_SKIP:
        mask = mask & (tl.load(skip_ptr) == 0)
    g = tl.load(grad_ptr + local, mask=mask, other=0.0).to(tl.float32)
    offs = base + local
    _adamw_block(
        p_ptr, lo_ptr, g, m_ptr, v_ptr, offs, mask, corr_ptr, coef_ptr, beta1, beta2, eps, decay,
        SPLIT, LOW_MOMENTS, HAS_COEF,
    )  # fmt: skip


def bias_corrections(step: torch.Tensor, lr: float | torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """[lr / (1 − β₁ᵗ), √(1 − β₂ᵗ), lr] for step count t (0-d device tensor) as an fp32 device
    tensor: the kernel's `corrections`, computed once per optimizer step. `lr`: a number, or a
    0-d device tensor (the learning rate a CUDA graph reads at each replay, src/moetrain/train/cuda_graphs.py);
    the quotient is taken in float64 either way."""
    t = step.double()
    lr_t = lr.double() if isinstance(lr, torch.Tensor) else torch.full((), lr, dtype=torch.float64, device=step.device)
    return torch.stack([lr_t / (1 - beta1**t), (1 - beta2**t).sqrt(), lr_t]).float()


def adamw_triton(
    param: torch.Tensor,
    lo: torch.Tensor | None,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    corrections: torch.Tensor,
    *,
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


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
"""The gradients' dtypes the address-table kernels read, as Triton's pointer element types."""


TABLE_ARENA_BYTES = 1 << 20
"""Device memory set aside before a capture for the tables first needed inside it: 1 MiB holds
the four address tables a step's update asks for (the clipping norm's and AdamW's, per gradient
dtype) of up to 30,000 parameters."""
TABLE_ALIGN = 64
"""Bytes each table of the arena starts on (Triton's kernels load 16 bytes at a time where the
address allows)."""


class GraphTables:
    """What `tables_for_graph` collects over one capture.

    A table first needed inside the capture (the addresses of gradients the captured backward
    allocates) is filled once, after the capture, and read by every replay. It must not come
    from the graph's own memory: there a block is reused by whatever the capture allocates after
    the block's last use in the captured order, so an activation of the next replay's forward
    could sit where the table sits. Such tables are cut from `arena`, allocated before the
    capture and kept with the graph."""

    def __init__(self, device: torch.device | None = None, arena_bytes: int = TABLE_ARENA_BYTES):
        self.kept: list[torch.Tensor] = []
        """Every device table the captured launches read (the graph's owner keeps them)."""
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(device table, host values) of the tables first needed inside the capture: cut from
        `arena` there, filled by `upload_pending` after the capture ends."""
        self.arena = torch.empty(arena_bytes, dtype=torch.uint8, device=device) if device is not None else None
        """Memory outside the graph's pool for those tables (None: none may be made)."""
        self.used = 0

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """A device table shaped and typed like the host tensor `values`, cut from `arena`; it is
        filled by `upload_pending`."""
        nbytes = values.numel() * values.element_size()
        if self.arena is None or self.used + nbytes > self.arena.numel():
            room = 0 if self.arena is None else self.arena.numel()
            raise RuntimeError(
                f"an optimizer kernel's table of {nbytes} bytes does not fit the {room} bytes set aside for tables "
                "made inside a CUDA graph capture (TABLE_ARENA_BYTES, src/moetrain/optim/triton_kernels.py)"
            )
        table = self.arena[self.used : self.used + nbytes].view(values.dtype).view(values.shape)
        self.used += -(-nbytes // TABLE_ALIGN) * TABLE_ALIGN
        self.pending.append((table, values))
        return table

    def upload_pending(self) -> None:
        """Fill the tables made inside the capture, on the current stream (before any replay)."""
        for table, values in self.pending:
            table.copy_(pinned_for(values, table.device), non_blocking=True)
        self.pending = []


_graph_tables: GraphTables | None = None
"""While `tables_for_graph` captures: what the captured kernels read."""


@contextlib.contextmanager
def tables_for_graph(device: torch.device | None = None):
    """Around a CUDA graph's capture (src/moetrain/train/cuda_graphs.py), entered before the
    capture's stream: yields the `GraphTables` of every device table (addresses, sizes, first
    blocks) the captured launches read. The graph reads them at each replay, so its owner keeps
    them (and the arena): the caches below may drop them. A table first needed inside the
    capture (the addresses of gradients the captured backward allocates) is cut from the arena
    allocated here on `device`, outside the graph's memory, and filled after the capture
    (`GraphTables.upload_pending`): a capture records no copy from host memory, whose pinned
    buffer would be freed."""
    global _graph_tables
    _graph_tables = tables = GraphTables(device)
    try:
        yield tables
    except BaseException:
        if tables.pending:  # cached tables that will never be filled
            _int64_table_cached.cache_clear()
            _first_blocks_cached.cache_clear()
        raise
    finally:
        _graph_tables = None


def _kept(t: torch.Tensor) -> torch.Tensor:
    if _graph_tables is not None:
        _graph_tables.kept.append(t)
    return t


def _first_blocks(numels: tuple[int, ...], block: int, device: torch.device) -> tuple[torch.Tensor, int, int]:
    first, blocks, steps = _first_blocks_cached(numels, block, device)
    return _kept(first), blocks, steps


@functools.lru_cache(maxsize=64)
def _first_blocks_cached(numels: tuple[int, ...], block: int, device: torch.device) -> tuple[torch.Tensor, int, int]:
    """(the first block of each tensor and, last, the number of blocks, int32 on `device`; that
    number; the bisection steps `_block_of` needs): blocks of `block` elements over tensors of
    `numels` elements, in order, each inside one tensor. A table per tensor, not per block, so it
    takes bytes, not megabytes, of the device memory; built once per list of sizes (the
    parameters' sizes do not change from step to step)."""
    first = [0, *itertools.accumulate(triton.cdiv(n, block) for n in numels)]
    assert first[-1] < 2**31, "more blocks than an int32 program id counts"
    return _upload(torch.tensor(first, dtype=torch.int32), device), first[-1], max(1, len(numels).bit_length())


def _int64_table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`, built once per tuple: sizes and offsets, which
    repeat every step, and the gradients' addresses, which a capture of the update alone finds
    in the cache where the eager update before it put them (a capture of the whole step makes
    them: its backward allocates the gradients)."""
    return _kept(_int64_table_cached(values, device))


@functools.lru_cache(maxsize=64)
def _int64_table_cached(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return _upload(torch.tensor(values, dtype=torch.int64), device)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without the host waiting: copied from pinned memory, which
    torch's host allocator keeps until the copy has run. Inside a CUDA graph's capture the table
    is only allocated, and filled once the capture has ended (`tables_for_graph`)."""
    if device.type != "cuda":
        return t.to(device)
    if torch.cuda.is_current_stream_capturing():
        if _graph_tables is None:
            raise RuntimeError(
                "an optimizer kernel's table was needed inside a CUDA graph capture outside tables_for_graph "
                "(src/moetrain/train/cuda_graphs.py)"
            )
        return _graph_tables.take(t)
    return to_device(t, device)


def _aligned(tensors: list[torch.Tensor], counts: tuple[int, ...]) -> bool:
    """Whether every tensor starts on 16 bytes and every size or offset is a multiple of 16
    elements: the table kernels may then load and store 16 bytes at a time, as the per-tensor
    kernels do where Triton sees the same of their arguments."""
    return all(t.data_ptr() % 16 == 0 for t in tensors) and all(c % 16 == 0 for c in counts)


def _addresses(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' data addresses, on their device (the gradients are allocated anew each step)."""
    return _int64_table(tuple(t.data_ptr() for t in tensors), tensors[0].device)


def adamw_triton_flat(
    param: torch.Tensor,
    lo: torch.Tensor | None,
    grads: list[torch.Tensor],
    bases: list[int],
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    corrections: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_coef: torch.Tensor | None,
    skip: torch.Tensor | None,
) -> None:
    """`adamw_triton` of many tensors in one launch per gradient dtype (bf16, fp32): tensor i's
    parameter (fp32, or split halves `param` and `lo`) and moments are elements [bases[i],
    bases[i] + grads[i].numel()) of the flat buffers; its gradient, contiguous, lies anywhere.
    The same arithmetic as `adamw_triton`, element by element (`_adamw_block`)."""
    low = exp_avg.dtype != torch.float32
    assert all(g.is_contiguous() for g in grads) and all(t.is_contiguous() for t in (param, exp_avg, exp_avg_sq))
    for dtype in (torch.bfloat16, torch.float32):
        chosen = [i for i, g in enumerate(grads) if g.dtype == dtype]
        if not chosen:
            continue
        group = [grads[i] for i in chosen]
        numels = tuple(g.numel() for g in group)
        first, blocks, steps = _first_blocks(numels, BLOCK, param.device)
        _adamw_table_kernel[(blocks,)](
            param.view(torch.int16) if lo is not None else param,
            lo if lo is not None else param,
            _addresses(group),
            exp_avg.view(torch.int16) if low else exp_avg,
            exp_avg_sq.view(torch.int16) if low else exp_avg_sq,
            first, len(numels), _int64_table(numels, param.device),
            _int64_table(tuple(bases[i] for i in chosen), param.device),
            corrections,
            grad_coef if grad_coef is not None else corrections,
            skip if skip is not None else corrections,
            beta1, beta2, eps, weight_decay,
            GRAD_DTYPE=_TL_DTYPES[dtype], SPLIT=lo is not None, LOW_MOMENTS=low,
            HAS_COEF=grad_coef is not None, HAS_SKIP=skip is not None,
            ALIGNED=_aligned(group, numels + tuple(bases[i] for i in chosen)), STEPS=steps, BLOCK=BLOCK,
        )  # fmt: skip


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
def _sum_squares_table_kernel(
    addrs_ptr, numel_ptr, first_ptr, T, slot_ptr, out_ptr,
    DTYPE: tl.constexpr, ALIGNED: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[slot] = Σ x² over block `pid`'s elements (of tensor i, `_block_of`, from its address),
    in fp32; a tensor's blocks fill its slots from `slot[i]` on, in order."""
    i, block = _block_of(first_ptr, T, STEPS)
    start = tl.multiple_of(block * BLOCK, BLOCK)
    n, x_ptr = tl.load(numel_ptr + i), tl.load(addrs_ptr + i).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        n, x_ptr = tl.multiple_of(n, 16), tl.multiple_of(x_ptr, 16)
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.load(slot_ptr + i) + block, tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=0))


def sum_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ‖t‖² over `tensors` (contiguous, bf16 or fp32), in fp32, as a device scalar: one pass per
    dtype that writes a partial sum per block of SQ_BLOCK elements (the tensors' blocks in
    order), then one sum of the partials (a fixed order: the same bits on every call, no
    atomics). The clipping norm's pass over every gradient: torch's `_foreach_norm` read bf16
    gradients at 2.17 TB/s on an H200 (benchmarks/step_bytes_probe.py), under half the bandwidth;
    one launch per dtype, not per tensor, keeps the host ahead of the GPU."""
    assert all(t.is_contiguous() and t.dtype in (torch.bfloat16, torch.float32) for t in tensors)
    device = tensors[0].device
    counts = [triton.cdiv(t.numel(), SQ_BLOCK) for t in tensors]
    slots = [0, *itertools.accumulate(counts)][:-1]  # each tensor's first partial
    partials = torch.empty(sum(counts), dtype=torch.float32, device=device)
    for dtype in (torch.bfloat16, torch.float32):
        chosen = [i for i, t in enumerate(tensors) if t.dtype == dtype and counts[i]]
        if not chosen:
            continue
        group = [tensors[i] for i in chosen]
        numels = tuple(t.numel() for t in group)
        first, blocks, steps = _first_blocks(numels, SQ_BLOCK, device)
        _sum_squares_table_kernel[(blocks,)](
            _addresses(group), _int64_table(numels, device), first, len(numels),
            _int64_table(tuple(slots[i] for i in chosen), device), partials,
            DTYPE=_TL_DTYPES[dtype], ALIGNED=_aligned(group, numels), STEPS=steps, BLOCK=SQ_BLOCK, num_warps=8,
        )  # fmt: skip
    return partials.sum()


SYMMETRIC_LAUNCH = (128, 64, 8, 3)
"""`symmetric_product`'s (tile, tile along L, warps, stages): within 4% of the best of four tried on
every shape of benchmarks/probes/ns_symmetric_probe.py (docs/measurements.md, "Muon's floor on an
expert-parallel rank")."""


@triton.jit
def _symmetric_kernel(
    y_ptr, z_ptr, out_ptr, stride_yk, stride_ys, stride_zk, stride_ok, alpha, beta,
    S: tl.constexpr, L: tl.constexpr, HAS_Z: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Tile (i, j), i ≤ j, of alpha·Y·Yᵀ + beta·Z for matrix pid 2 of the batch, written at (i, j)
    and mirrored to (j, i); fp32 accumulation. S and L are compile-time (the interpreter cannot
    loop to a runtime bound): one compilation per shape."""
    i, j, k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if i > j:
        return
    rows, cols = i * BLOCK + tl.arange(0, BLOCK), j * BLOCK + tl.arange(0, BLOCK)
    y = y_ptr + k.to(tl.int64) * stride_yk
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for l0 in range(0, L, BLOCK_K):
        ls = l0 + tl.arange(0, BLOCK_K)
        along = (ls < L)[None, :]
        a = tl.load(y + rows[:, None] * stride_ys + ls[None, :], mask=(rows < S)[:, None] & along, other=0.0)
        b = tl.load(y + cols[:, None] * stride_ys + ls[None, :], mask=(cols < S)[:, None] & along, other=0.0)
        acc += tl.dot(a, tl.trans(b))
    acc = acc * alpha
    inside = (rows < S)[:, None] & (cols < S)[None, :]
    if HAS_Z:
        z = tl.load(z_ptr + k.to(tl.int64) * stride_zk + rows[:, None] * S + cols[None, :], mask=inside, other=0.0)
        acc += beta * z.to(tl.float32)
    out = out_ptr + k.to(tl.int64) * stride_ok
    value = acc.to(out_ptr.dtype.element_ty)
    tl.store(out + rows[:, None] * S + cols[None, :], value, mask=inside)
    if i != j:
        tl.store(out + cols[None, :] * S + rows[:, None], value, mask=inside)


def symmetric_product(
    y_kSL: torch.Tensor, alpha: float, z_kSS: torch.Tensor | None, beta: float, launch=SYMMETRIC_LAUNCH
) -> torch.Tensor:
    """alpha·Y·Yᵀ + beta·Z for each matrix of the batch (Y's rows contiguous; Z symmetric and
    contiguous, or None), computing only the tiles on and above the diagonal: half the FLOPs of
    the full product. Newton–Schulz's A = X·Xᵀ and b·A + c·A² (A·A = A·Aᵀ: A is symmetric)."""
    block, block_k, warps, stages = launch
    k, S, L = y_kSL.shape
    assert y_kSL.stride(2) == 1 and (z_kSS is None or z_kSS.is_contiguous()), "rows must be contiguous"
    out = torch.empty(k, S, S, dtype=y_kSL.dtype, device=y_kSL.device)
    z = out if z_kSS is None else z_kSS
    tiles = triton.cdiv(S, block)
    _symmetric_kernel[(tiles, tiles, k)](
        y_kSL, z, out, y_kSL.stride(0), y_kSL.stride(1), z.stride(0), out.stride(0), alpha, beta, S=S, L=L,
        HAS_Z=z_kSS is not None, BLOCK=block, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
