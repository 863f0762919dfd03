"""Can the expert-parallel rank's regroup gathers fold into its grouped GEMMs? (issue 53)

After the exchange, a rank's received rows are source-major; `torch._grouped_mm` needs each
expert's rows contiguous, so the nosync dispatcher gathers them into expert order before the
gate/up product (`_Regroup`) and gathers the down product's rows back into the received order
after it (`_Ungroup`): 9.1 ms a step on sweep-8l-128's busiest dp8·ep8 rank
(docs/measurements.md, "The projected 8-GPU sweep"). ScatterMoE's way out is a grouped GEMM that
reads its A rows through the index and writes its C rows through the inverse. This probe times,
at that rank's shapes (one MoE layer's forward, one exchange or four chunks), for each product:

  gather + torch   — `x[idx]` then `torch._grouped_mm` (what the rank runs), and torch alone;
  triton           — a Triton grouped GEMM over the same contiguous rows (its kernel's own speed);
  triton, fused    — the same kernel with the gather in its A load (gate/up) or the scatter in its
                     C store (down), over each launch configuration of CONFIGS.

The fused kernel pays for the rank only if it beats gather + torch; its speed against torch's
alone says how far Triton's GEMM is from CUTLASS's at these shapes.

Legend: S received rows, M rows the experts get (padding after the last offset, never
computed), G experts of the exchange, K the reduction, N the output columns.

    python benchmarks/probes/gather_gemm_probe.py                      # time it (CUDA)
    TRITON_INTERPRET=1 python benchmarks/probes/gather_gemm_probe.py --check   # CPU

Prints one JSON line per product and exchange.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = [
    (128, 128, 64, 8, 4, 8), (128, 256, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8), (64, 256, 64, 4, 4, 8),
    (128, 256, 64, 8, 4, 8), (128, 256, 64, 8, 3, 16), (256, 128, 64, 8, 3, 8), (128, 256, 32, 8, 5, 8),
]  # fmt: skip
"""(BM, BN, BK, warps, stages, GROUP_M) tried on the GPU."""


@triton.jit
def _grouped_kernel(
    a_ptr, a_idx_ptr, b_ptr, c_ptr, c_idx_ptr, offs_ptr, stride_am, stride_bg, stride_cm,
    N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One (BM, BN) tile of C = A·Bᵀ[g] for the rows [offs[g-1], offs[g]) its row tile falls in:
    A's rows read through a_idx (GATHER_A), C's written through c_idx (SCATTER_C). B is (G, N, K)
    (nn.Linear's layout per expert). Row tiles count each expert's rows apart (no tile spans two
    experts); the grid holds the most there can be, and the ones past the last expert return."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    num_m = tl.num_programs(0) // num_n
    width = GROUP_M * num_n  # GROUP_M row tiles share B's column tiles in L2
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    tile_m = first_m + (pid % width) % size_m
    tile_n = (pid % width) // size_m
    start = tl.zeros((), tl.int32)
    before = tl.zeros((), tl.int32)
    grp = tl.full((), -1, tl.int32)
    row0 = tl.zeros((), tl.int32)
    row_end = tl.zeros((), tl.int32)
    for g in tl.static_range(G):
        end = tl.load(offs_ptr + g)
        tiles = tl.cdiv(end - start, BM)
        hit = (tile_m >= before) & (tile_m < before + tiles)
        grp = tl.where(hit, g, grp)
        row0 = tl.where(hit, start + (tile_m - before) * BM, row0)
        row_end = tl.where(hit, end, row_end)
        before += tiles
        start = end
    if grp >= 0:
        rows = row0 + tl.arange(0, BM)
        in_rows = rows < row_end
        src = tl.load(a_idx_ptr + rows, mask=in_rows, other=0) if GATHER_A else rows
        cols = tile_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        a_ptrs = a_ptr + src.to(tl.int64)[:, None] * stride_am + ks[None, :]
        b_ptrs = b_ptr + grp.to(tl.int64) * stride_bg + cols.to(tl.int64)[None, :] * K + ks[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, K, BK):  # K a multiple of BK
            a = tl.load(a_ptrs, mask=in_rows[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=cols[None, :] < N, other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
        dst = tl.load(c_idx_ptr + rows, mask=in_rows, other=0) if SCATTER_C else rows
        c_ptrs = c_ptr + dst.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=in_rows[:, None] & (cols[None, :] < N))


def grouped_mm(a_SK, b_GNK, offsets_G, c_rows, a_idx_M=None, c_idx_M=None, config=CONFIGS[0]):
    """C (c_rows, N): row r of expert g's rows (offsets_G: int32 ends) is A[a_idx[r]]·B[g]ᵀ,
    written at row c_idx[r]; rows past the last offset untouched. M = len(a_idx or c_idx)."""
    BM, BN, BK, warps, stages, group_m = config
    G, N, K = b_GNK.shape
    M = (a_idx_M if a_idx_M is not None else c_idx_M if c_idx_M is not None else a_SK).shape[0]
    c = torch.empty((c_rows, N), dtype=a_SK.dtype, device=a_SK.device)
    dummy = offsets_G  # an index never read when its flag is off
    grid = ((triton.cdiv(M, BM) + G) * triton.cdiv(N, BN),)
    _grouped_kernel[grid](
        a_SK, a_idx_M if a_idx_M is not None else dummy, b_GNK, c, c_idx_M if c_idx_M is not None else dummy,
        offsets_G, a_SK.stride(0), b_GNK.stride(0), c.stride(0),
        N=N, K=K, G=G, GATHER_A=a_idx_M is not None, SCATTER_C=c_idx_M is not None,
        BM=BM, BN=BN, BK=BK, GROUP_M=group_m, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return c


def exchange(S: int, M: int, filled: int, G: int, K: int, N: int, dtype, device, seed: int = 0):
    """A received buffer x (S, K), the gather index of the M rows the experts get (distinct rows
    of x), G experts' int32 end offsets over the first `filled` (uneven sizes, one empty expert
    when G > 2), weights (G, N, K)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, K, generator=g).to(dtype).to(device)
    idx = torch.randperm(S, generator=g)[:M].to(device)
    sizes = torch.rand(G, generator=g) + 0.5
    if G > 2:
        sizes[1] = 0
    ends = (sizes.cumsum(0) / sizes.sum() * filled).round().to(torch.int32)
    ends[-1] = filled
    w = (torch.randn(G, N, K, generator=g) / K**0.5).to(dtype).to(device)
    return x, idx, ends.to(device), w


def check() -> None:
    """The fused kernel against torch's products in fp32 at small uneven shapes: gathered A,
    scattered C, both, padding rows untouched."""
    x, idx, ends, w = exchange(S=150, M=120, filled=101, G=4, K=32, N=48, dtype=torch.float32, device="cpu")
    want = torch.zeros(120, 48)
    for g in range(4):
        lo, hi = (0 if g == 0 else int(ends[g - 1])), int(ends[g])
        want[lo:hi] = x[idx[lo:hi]] @ w[g].T
    config = (16, 16, 16, 4, 1, 2)
    got = grouped_mm(x, w, ends, 120, a_idx_M=idx, config=config)
    assert torch.allclose(got[:101], want[:101], atol=1e-4), (got[:101] - want[:101]).abs().max()
    inv = torch.randperm(150)[:120]
    out = grouped_mm(x[idx], w, ends, 150, c_idx_M=inv, config=config)
    assert torch.allclose(out[inv[:101]], want[:101], atol=1e-4)
    both = torch.full((150, 48), 7.0)
    got = grouped_mm(x, w, ends, 150, a_idx_M=idx, c_idx_M=inv, config=config)
    both[inv[:101]] = got[inv[:101]]
    assert torch.allclose(both[inv[:101]], want[:101], atol=1e-4)
    print(json.dumps({"check": "ok"}))


def rows_of(chunks: int) -> dict:
    """sweep-8l-128's busiest dp8·ep8 rank, one MoE layer's exchange (of `chunks`): 16,384 tokens
    a micro-batch, top 4, capacity 1.25 and spill 0.125 per source (ep_call11's run)."""
    M_all = 16384 * 4
    C = int(1.25 * M_all / 8) // chunks
    W = C + int(0.125 * M_all / 8) // chunks
    return {"S": 8 * W, "M": 8 * C, "filled": M_all // chunks, "G": 16 // chunks}


def fused_ms(name: str, config, x, x_M, idx, w, ends, shape: dict, want, reps: int) -> float:
    """The fused kernel's ms at one launch, its result checked against torch's (`want`, the filled rows)."""
    from cuda_timing import timed

    S, M, filled = shape["S"], shape["M"], shape["filled"]
    if name == "gate_up":
        fn = lambda: grouped_mm(x, w, ends, M, a_idx_M=idx, config=config)  # noqa: E731
        got = fn()[:filled].float()
    else:
        fn = lambda: grouped_mm(x_M, w, ends, S, c_idx_M=idx, config=config)  # noqa: E731
        got = fn()[idx[:filled]].float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-2, f"{config}: relative error {err}"
    return timed(fn, reps, 3)


def time_product(name: str, K: int, N: int, chunks: int, reps: int) -> dict:
    """One product of one exchange: torch alone, with its gather, Triton alone and fused."""
    from cuda_timing import timed

    shape = rows_of(chunks)
    x, idx, ends, w = exchange(K=K, N=N, dtype=torch.bfloat16, device="cuda", **shape)
    S, M = shape["S"], shape["M"]
    x_M, wt = x[idx].contiguous(), w.transpose(-2, -1)
    ms = {"torch": timed(lambda: torch._grouped_mm(x_M, wt, offs=ends), reps, 3)}
    if name == "gate_up":  # the regroup before the product
        ms["gather + torch"] = timed(lambda: torch._grouped_mm(x[idx], wt, offs=ends), reps, 3)
    else:  # the ungroup after it: rows back into the received order
        inv_S = torch.zeros(S, dtype=torch.int64, device="cuda").index_copy_(0, idx, torch.arange(M, device="cuda"))
        ms["gather + torch"] = timed(lambda: torch._grouped_mm(x_M, wt, offs=ends)[inv_S], reps, 3)
    want = torch._grouped_mm(x_M, wt, offs=ends)[: shape["filled"]].float()
    fused = {}
    for config in CONFIGS:
        try:
            ms[f"triton {config}"] = timed(lambda: grouped_mm(x_M, w, ends, M, config=config), reps, 3)  # noqa: B023
            fused[str(config)] = fused_ms(name, config, x, x_M, idx, w, ends, shape, want, reps)
        except Exception as e:  # noqa: BLE001 — a launch that does not fit reports, the rest run
            fused[str(config)] = f"{type(e).__name__}: {str(e)[:120]}"
    best = min((v for v in fused.values() if isinstance(v, float)), default=None)
    return {
        "product": name,
        "chunks": chunks,
        **shape,
        "K": K,
        "N": N,
        "ms": {k: round(v, 3) for k, v in ms.items()},
        "fused_ms": {k: round(v, 3) if isinstance(v, float) else v for k, v in fused.items()},
        "torch_tflops": round(2 * shape["filled"] * K * N / ms["torch"] / 1e9),
        "best_fused_ms": best,
        "fused_over_gather_torch": round(best / ms["gather + torch"], 3) if best else None,
        "device": torch.cuda.get_device_name(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="the fused kernel against torch in the interpreter")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if args.check:
        check()
        return
    for chunks in (1, 4):
        for name, K, N in (("gate_up", 4096, 8192), ("down", 4096, 4096)):
            print(json.dumps(time_product(name, K, N, chunks, args.reps)), flush=True)


if __name__ == "__main__":
    main()
