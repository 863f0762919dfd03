"""Newton–Schulz with its symmetric products one triangle at a time, against torch's products.
Muon's iteration (src/moetrain/optim/muon.py) makes A = X·Xᵀ and B = b·A + c·A² each step, both
symmetric: `symmetric_product` (src/moetrain/optim/triton_kernels.py) computes only the tiles on
and above the diagonal and mirrors them, half those two products' FLOPs, a third of the
iteration's at square matrices. Muon's share of a dp8·ep8 bench-8e rank is bounded by the
iteration's FLOPs (docs/measurements.md, "Muon's floor on an expert-parallel rank").

Legend: k matrices of a batch, S the short side (A is S × S), L the long side.

    python benchmarks/probes/ns_symmetric_probe.py                    # time it (CUDA)
    TRITON_INTERPRET=1 python benchmarks/probes/ns_symmetric_probe.py --check   # CPU

Prints one JSON line per shape: the iteration with torch's products (`torch_ms`), moetrain's
`newton_schulz` (`moetrain_ms`: the triangle from 1,024 rows), the triangle's ms per launch
configuration and the best, at the iteration's full FLOP count (so the rates compare), and the
largest difference of the triangle's result from torch's relative to torch's largest element.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from moetrain.optim.muon import NS_COEFFICIENTS, newton_schulz  # noqa: E402
from moetrain.optim.triton_kernels import symmetric_product  # noqa: E402

CONFIGS = [(128, 64, 8, 3), (128, 64, 4, 4), (64, 64, 4, 4), (128, 128, 8, 3)]
"""(BLOCK, BLOCK_K, warps, stages) tried on the GPU."""
SHAPES = [(64, 1024, 1024), (32, 1024, 1024), (21, 4096, 4096), (3, 4096, 4096), (1, 4096, 4096), (2, 1024, 4096)]
"""(k, S, L): bench-small32e's experts (gate and up apart, down), a dp8·ep8 bench-8e rank's expert
matrices batched over its 7 MoE layers, one of its layers, one matrix, bench-8e's k/v projections."""


def newton_schulz_torch(u_kSL: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton–Schulz for S ≤ L with torch's products only (moetrain's below 1,024 rows)."""
    a, b, c = NS_COEFFICIENTS
    x = u_kSL.to(dtype)
    x = x / (torch.linalg.matrix_norm(x.float(), keepdim=True) + 1e-7).to(dtype)
    for _ in range(steps):
        a_kSS = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(a_kSS, a_kSS, a_kSS, beta=b, alpha=c), x, beta=a)
    return x


def newton_schulz_sym(u_kSL: torch.Tensor, steps: int, dtype: torch.dtype, config) -> torch.Tensor:
    """Newton–Schulz for S ≤ L with A and B from `symmetric_product` launched as `config`."""
    a, b, c = NS_COEFFICIENTS
    x = u_kSL.to(dtype)
    x = x / (torch.linalg.matrix_norm(x.float(), keepdim=True) + 1e-7).to(dtype)
    for _ in range(steps):
        a_kSS = symmetric_product(x, 1.0, None, 0.0, config)
        b_kSS = symmetric_product(a_kSS, c, a_kSS, b, config)
        x = torch.baddbmm(x, b_kSS, x, beta=a)
    return x


def flops(k: int, S: int, L: int, steps: int = 5) -> int:
    return k * steps * (4 * S * S * L + 2 * S**3)


def check() -> None:
    """The triangle against fp64 and the iteration against torch's products, in fp32
    (interpreter-sized)."""
    torch.manual_seed(0)
    config = (16, 16, 4, 1)
    for k, S, L in [(2, 40, 72), (1, 32, 32), (3, 17, 50)]:
        y, z = torch.randn(k, S, L), torch.randn(k, S, S)
        z = z + z.mT
        want = 0.7 * y.double() @ y.double().mT - 1.3 * z.double()
        got = symmetric_product(y, 0.7, z, -1.3, config)
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err < 1e-5, f"symmetric_product {k, S, L}: {err}"
        assert torch.equal(got, got.mT), "not symmetric"
        o = newton_schulz_sym(y, 5, torch.float32, config)
        ref = newton_schulz_torch(y, 5, torch.float32)
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
        ref = newton_schulz_torch(u, 5, torch.bfloat16)
        row = {"k": k, "S": S, "L": L}
        row["torch_ms"] = timed_ms(lambda u=u: newton_schulz_torch(u, 5, torch.bfloat16), args.reps)
        row["moetrain_ms"] = timed_ms(lambda u=u: newton_schulz(u, 5, torch.bfloat16), args.reps)
        row["torch_tflops"] = flops(k, S, L) / row["torch_ms"] / 1e9
        for config in CONFIGS:
            ms = timed_ms(lambda u=u, config=config: newton_schulz_sym(u, 5, torch.bfloat16, config), args.reps)
            row[f"sym_ms_{'x'.join(map(str, config))}"] = ms
        best = min((v, key) for key, v in row.items() if key.startswith("sym_ms_"))
        config = tuple(int(v) for v in best[1].removeprefix("sym_ms_").split("x"))
        o = newton_schulz_sym(u, 5, torch.bfloat16, config)
        row.update(best_sym_ms=best[0], best_config=best[1], speedup=row["torch_ms"] / best[0],
                   rel_diff=((o.float() - ref.float()).abs().max() / ref.float().abs().max()).item())  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
