"""Does Newton–Schulz get cheaper when its symmetric products compute one triangle? Muon's iteration
(src/moetrain/optim/muon.py) makes A = X·Xᵀ and B = b·A + c·A² each step, both symmetric: a
kernel that computes only the tiles on and above the diagonal and mirrors them does those two
products in about half their FLOPs, a third of the iteration's at square matrices. Muon's share of
a dp8·ep8 bench-8e rank is bounded by the iteration's FLOPs (docs/measurements.md, "Muon's floor
on an expert-parallel rank"); this probe says what the triangle saves before moetrain uses it.

Legend: k matrices of a batch, S the short side (A is S × S), L the long side.

`sym_product(Y, alpha, Z, beta)` = alpha·Y·Yᵀ + beta·Z for each matrix of the batch (Z symmetric or
None), one Triton program per tile (i, j) with i ≤ j, written at (i, j) and mirrored to (j, i);
programs below the diagonal return at once. A·A = A·Aᵀ because A is symmetric, so B is
sym_product(A, c, A, b). X ← a·X + B·X stays torch.baddbmm.

    python benchmarks/probes/ns_symmetric_probe.py                    # time it (CUDA)
    TRITON_INTERPRET=1 python benchmarks/probes/ns_symmetric_probe.py --check   # CPU

Prints one JSON line per shape: today's `newton_schulz` ms, the triangle's ms per configuration and
the best, both at their FLOP rates (the iteration's full count, so the rates compare), and the
largest difference of the two results relative to the largest element of today's.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from moetrain.optim.muon import NS_COEFFICIENTS, newton_schulz  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CONFIGS = [(128, 64, 8, 3), (128, 64, 4, 4), (64, 64, 4, 4), (128, 128, 8, 3)]
"""(BLOCK, BLOCK_K, warps, stages) tried on the GPU."""
SHAPES = [(64, 1024, 1024), (32, 1024, 1024), (21, 4096, 4096), (3, 4096, 4096), (1, 4096, 4096), (2, 1024, 4096)]
"""(k, S, L): bench-small32e's experts (gate and up apart, down), a dp8·ep8 bench-8e rank's expert
matrices batched over its 7 MoE layers, one of its layers, one matrix, bench-8e's k/v projections."""


@triton.jit
def _sym_kernel(
    y_ptr, z_ptr, out_ptr, stride_yk, stride_ys, stride_zk, stride_ok, alpha, beta,
    S: tl.constexpr, L: tl.constexpr, HAS_Z: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Tile (i, j), i ≤ j, of alpha·Y·Yᵀ + beta·Z for matrix pid 2 of the batch; fp32 accumulation
    (`UPCAST`: operands in fp32 first, for the interpreter, whose bf16 dot is wrong). S and L are
    compile-time (the interpreter cannot loop to a runtime bound): one compilation per shape."""
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
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
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


def sym_product(y_kSL: torch.Tensor, alpha: float, z_kSS: torch.Tensor | None, beta: float, config) -> torch.Tensor:
    """alpha·Y·Yᵀ + beta·Z per matrix (rows of Y contiguous; Z, the output: contiguous S × S)."""
    block, block_k, warps, stages = config
    k, S, L = y_kSL.shape
    out = torch.empty(k, S, S, dtype=y_kSL.dtype, device=y_kSL.device)
    z = out if z_kSS is None else z_kSS
    tiles = triton.cdiv(S, block)
    _sym_kernel[(tiles, tiles, k)](
        y_kSL, z, out, y_kSL.stride(0), y_kSL.stride(1), z.stride(0), out.stride(0), alpha, beta, S=S, L=L,
        HAS_Z=z_kSS is not None, BLOCK=block, BLOCK_K=block_k, UPCAST=INTERPRETED, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def newton_schulz_sym(u_kSL: torch.Tensor, steps: int, dtype: torch.dtype, config) -> torch.Tensor:
    """`newton_schulz` for S ≤ L with A and B from `sym_product`."""
    a, b, c = NS_COEFFICIENTS
    x = u_kSL.to(dtype)
    x = x / (torch.linalg.matrix_norm(x.float(), keepdim=True) + 1e-7).to(dtype)
    for _ in range(steps):
        a_kSS = sym_product(x, 1.0, None, 0.0, config)
        b_kSS = sym_product(a_kSS, c, a_kSS, b, config)
        x = torch.baddbmm(x, b_kSS, x, beta=a)
    return x


def flops(k: int, S: int, L: int, steps: int = 5) -> int:
    return k * steps * (4 * S * S * L + 2 * S**3)


def check() -> None:
    """The triangle against fp64 and the iteration against today's, in fp32 (interpreter-sized)."""
    torch.manual_seed(0)
    config = (16, 16, 4, 1)
    for k, S, L in [(2, 40, 72), (1, 32, 32), (3, 17, 50)]:
        y, z = torch.randn(k, S, L), torch.randn(k, S, S)
        z = z + z.mT
        want = 0.7 * y.double() @ y.double().mT - 1.3 * z.double()
        got = sym_product(y, 0.7, z, -1.3, config)
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err < 1e-5, f"sym_product {k, S, L}: {err}"
        assert torch.equal(got, got.mT), "not symmetric"
        o = newton_schulz_sym(y, 5, torch.float32, config)
        ref = newton_schulz(y, 5, torch.float32)
        err = (o - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-4, f"newton_schulz_sym {k, S, L}: {err}"
    print(json.dumps({"check": "ok"}))


def timed_ms(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="correctness only (CPU, TRITON_INTERPRET=1)")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if args.check:
        return check()
    torch.manual_seed(0)
    for k, S, L in SHAPES:
        u = torch.randn(k, S, L, device="cuda", dtype=torch.float32)
        ref = newton_schulz(u, 5, torch.bfloat16)
        row = {"k": k, "S": S, "L": L, "today_ms": timed_ms(lambda u=u: newton_schulz(u, 5, torch.bfloat16), args.reps)}
        row["today_tflops"] = flops(k, S, L) / row["today_ms"] / 1e9
        for config in CONFIGS:
            ms = timed_ms(lambda u=u, config=config: newton_schulz_sym(u, 5, torch.bfloat16, config), args.reps)
            row[f"sym_ms_{'x'.join(map(str, config))}"] = ms
        best = min((v, key) for key, v in row.items() if key.startswith("sym_ms_"))
        config = tuple(int(v) for v in best[1].removeprefix("sym_ms_").split("x"))
        o = newton_schulz_sym(u, 5, torch.bfloat16, config)
        row.update(best_sym_ms=best[0], best_config=best[1], speedup=row["today_ms"] / best[0],
                   sym_tflops_equivalent=flops(k, S, L) / best[0] / 1e9,
                   rel_diff=((o.float() - ref.float()).abs().max() / ref.float().abs().max()).item())  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
