"""Can the experts' weight-gradient GEMM accumulate straight into the fp32 gradient, and does it
beat what moetrain runs today? Today, per micro-batch: dW = torch._grouped_mm(dyᵀ, x, offs) in bf16
(torch 2.11's grouped GEMM takes no fp32 output: wgrad_probe.py), then `accumulate_grad` adds it
into the fp32 gradient: the GEMM writes 2 bytes an element and the add moves 10. Fused: a Triton
grouped GEMM reads the fp32 gradient tile and writes it back with the product added (8 bytes an
element, no bf16 copy). bench-sweep-64's step spends 51.9 ms in that add (docs/benchmarks.md, "The
expert sweep"); this probe says what a fused kernel would save, per GEMM, before it is built.

Legend: M token-expert rows (sorted by expert), N output features, K input features, E experts.

    python benchmarks/probes/grouped_wgrad_accumulate_probe.py            # time it (CUDA)
    TRITON_INTERPRET=1 python benchmarks/probes/grouped_wgrad_accumulate_probe.py --check   # CPU

Prints one JSON line per (shape, GEMM): today's ms (GEMM + add), the fused kernel's ms per
configuration, the best one's, its ms writing instead of accumulating (the step's first
micro-batch), and its largest error against an fp64 reference. Its finding (docs/benchmarks.md,
"The expert sweep"): 14% faster than today at 64 experts, slower at 16 and fewer; Triton's
grouped GEMM runs at about half the rate of torch's CUTLASS one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rows_product(dy_ptr, x_ptr, m0, end, n, k, N, K, stride_dy, stride_x, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr):
    """dy[m0 : m0 + BLOCK_M, n]ᵀ · x[m0 : m0 + BLOCK_M, k] over the rows before `end`, in fp32
    (`UPCAST`: the operands in fp32 first, for the interpreter, whose bf16 dot is wrong)."""
    m = m0 + tl.arange(0, BLOCK_M)
    rows = m < end
    dy = tl.load(
        dy_ptr + m[:, None].to(tl.int64) * stride_dy + n[None, :], mask=rows[:, None] & (n < N)[None, :], other=0.0
    )
    x = tl.load(
        x_ptr + m[:, None].to(tl.int64) * stride_x + k[None, :], mask=rows[:, None] & (k < K)[None, :], other=0.0
    )
    if UPCAST:
        dy, x = dy.to(tl.float32), x.to(tl.float32)
    return tl.dot(tl.trans(dy), x)


@triton.jit
def _grouped_wgrad_acc_kernel(
    dy_ptr, x_ptr, offsets_ptr, out_ptr, N, K, stride_dy, stride_x,
    ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    INTERPRETED: tl.constexpr, PRELOAD: tl.constexpr = False,
):  # fmt: skip
    """out[e, n-tile, k-tile] (+)= dy[rows of e, n-tile]ᵀ · x[rows of e, k-tile], in fp32.
    A for loop over the expert's rows, which the compiler pipelines; `INTERPRETED` (Triton's CPU
    interpreter): the while form, the only one it takes with bounds read from memory. `PRELOAD`:
    the accumulator starts from the gradient's tile (its load overlaps the first products) instead
    of adding it after the loop."""
    e = tl.program_id(2)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets_ptr + e)
    out = out_ptr + e.to(tl.int64) * N * K + n[:, None].to(tl.int64) * K + k[None, :]
    mask = (n < N)[:, None] & (k < K)[None, :]
    if ACCUMULATE and PRELOAD:
        acc = tl.load(out, mask=mask, other=0.0)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if INTERPRETED:
        m0 = start
        while m0 < end:
            acc += _rows_product(dy_ptr, x_ptr, m0, end, n, k, N, K, stride_dy, stride_x, BLOCK_M, True)
            m0 += BLOCK_M
    else:
        for m0 in range(start, end, BLOCK_M):
            acc += _rows_product(dy_ptr, x_ptr, m0, end, n, k, N, K, stride_dy, stride_x, BLOCK_M, False)
    if ACCUMULATE and not PRELOAD:
        acc += tl.load(out, mask=mask, other=0.0)
    tl.store(out, acc, mask=mask)


CONFIGS = [  # (BLOCK_N, BLOCK_K, BLOCK_M, warps, stages, preload)
    (128, 128, 32, 4, 4, False),
    (128, 128, 32, 4, 4, True),
    (128, 128, 32, 4, 5, True),
    (128, 128, 32, 8, 4, True),
    (128, 128, 64, 4, 3, True),
    (128, 128, 64, 8, 3, True),
    (128, 256, 32, 8, 4, True),
    (128, 256, 64, 8, 3, True),
    (256, 128, 32, 8, 4, True),
    (64, 256, 32, 4, 4, True),
]


def grouped_wgrad_accumulate(dy_MN, x_MK, offsets_E, out_ENK, accumulate: bool, config=CONFIGS[0]) -> None:
    """out[e] (+)= dy_eᵀ · x_e over expert e's rows (rows past the last offset enter nothing)."""
    bn, bk, bm, warps, stages, preload = config
    E, N, K = out_ENK.shape
    grid = (triton.cdiv(N, bn), triton.cdiv(K, bk), E)
    _grouped_wgrad_acc_kernel[grid](
        dy_MN, x_MK, offsets_E, out_ENK, N, K, dy_MN.stride(0), x_MK.stride(0),
        ACCUMULATE=accumulate, BLOCK_N=bn, BLOCK_K=bk, BLOCK_M=bm, INTERPRETED=INTERPRETED, PRELOAD=preload,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _reference(dy, x, offsets) -> torch.Tensor:
    starts = [0, *offsets.tolist()[:-1]]
    return torch.stack([dy[s:e].double().t() @ x[s:e].double() for s, e in zip(starts, offsets.tolist())])


def check(device: str) -> None:
    """Small shapes (an empty expert, uneven blocks, garbage rows past the last offset): the
    kernel against fp64, written and accumulated."""
    g = torch.Generator().manual_seed(0)
    for counts, N, K in (([37, 0, 90, 1, 40], 48, 80), ([130], 32, 16)):
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
        M = int(offsets[-1]) + 13
        dy = torch.randn(M, N, generator=g).bfloat16()
        x = torch.randn(M, K, generator=g).bfloat16()
        dy[int(offsets[-1]) :], x[int(offsets[-1]) :] = float("nan"), float("nan")
        want = _reference(dy, x, offsets)
        prior = torch.randn(len(counts), N, K, generator=g)
        for config in (CONFIGS[0], CONFIGS[1], CONFIGS[4]):
            out = prior.clone().to(device)
            grouped_wgrad_accumulate(dy.to(device), x.to(device), offsets.to(device), out, True, config)
            err = (out.cpu().double() - (prior.double() + want)).abs().max().item()
            assert err < 1e-3, (counts, config, err)
            grouped_wgrad_accumulate(dy.to(device), x.to(device), offsets.to(device), out, False, config)
            assert (out.cpu().double() - want).abs().max().item() < 1e-3, (counts, config)
    print(json.dumps({"check": "ok", "device": device}))


def probe(name: str, E: int, M: int, N: int, K: int) -> None:
    from cuda_timing import timed

    from moetrain.optim.triton_kernels import accumulate_grad

    g = torch.Generator(device="cuda").manual_seed(0)
    offsets = (torch.arange(1, E + 1, device="cuda") * (M // E)).to(torch.int32)
    dy = torch.randn(M, N, device="cuda", generator=g).bfloat16()
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    grad = torch.zeros(E, N, K, device="cuda")
    flops = 2 * M * N * K
    row = {"shape": name, "E": E, "M": M, "N": N, "K": K}

    def today():
        accumulate_grad(grad, torch._grouped_mm(dy.t(), x, offs=offsets))

    row["today_ms"] = round(timed(today), 3)
    row["today_gemm_ms"] = round(timed(lambda: torch._grouped_mm(dy.t(), x, offs=offsets)), 3)
    want = _reference(dy[: M // E * E].cpu(), x[: M // E * E].cpu(), offsets.cpu()) if E * N * K < 2**27 else None
    best = None
    for config in CONFIGS:
        name = "x".join(str(int(v)) for v in config)
        try:
            ms = timed(lambda c=config: grouped_wgrad_accumulate(dy, x, offsets, grad, True, c))
            row[f"fused_ms_{name}"] = round(ms, 3)
            best = min(best or (ms, config), (ms, config))
        except Exception as exc:  # a configuration the GPU cannot run: say so, time the others
            row[f"fused_error_{name}"] = repr(exc)[:200]
    if best is not None:
        row["best"], row["best_ms"] = "x".join(str(int(v)) for v in best[1]), round(best[0], 3)
        row["best_tflops"] = round(flops / best[0] / 1e9, 1)
        # the step's first micro-batch: the product written (fp32), no gradient to add to
        row["best_write_ms"] = round(timed(lambda: grouped_wgrad_accumulate(dy, x, offsets, grad, False, best[1])), 3)
    if want is not None:
        out = torch.zeros_like(grad)
        grouped_wgrad_accumulate(dy, x, offsets, out, False)
        row["fused_max_rel_err"] = float(((out.cpu().double() - want).abs().max() / want.abs().max()).item())
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="correctness only, small shapes (CPU in the interpreter)")
    args = parser.parse_args()
    if args.check:
        check("cuda" if torch.cuda.is_available() else "cpu")
    else:
        # one expert layer's two weight gradients at bench-sweep-64, bench-sweep-8 and bench-8e
        for name, E, D, F in (
            ("bench-sweep-64", 64, 2048, 1024),
            ("bench-sweep-32", 32, 2048, 1024),
            ("bench-sweep-16", 16, 2048, 1024),
            ("bench-sweep-8", 8, 2048, 1024),
            ("bench-8e", 8, 4096, 4096),
        ):
            probe(f"{name} gate/up", E, 32768, 2 * F, D)
            probe(f"{name} down", E, 32768, D, F)
