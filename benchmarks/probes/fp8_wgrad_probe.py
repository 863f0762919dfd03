"""What an FP8 expert weight gradient could save: the bf16 grouped GEMM moetrain runs today for
dW[e] = dy_eᵀ · x_e against `torch._scaled_grouped_mm`'s 2-D × 2-D form (row-wise scales per
expert and feature over that expert's tokens, every token block padded to a multiple of 16 rows).

Times the GEMMs alone (CUDA events, median of 20 after 5 warm-up runs) on the expert shapes of
bench-8e and bench-sweep-64, and checks the FP8 product against the dequantized fp32 one.
Run on a GPU: `python benchmarks/probes/fp8_wgrad_probe.py`; one JSON line per (shape, GEMM).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import timed as _median_ms  # noqa: E402  (CUDA events, median of 20 after 5 warm-ups)

E4M3 = torch.float8_e4m3fn


def _segment_quantize_t(x_MK: torch.Tensor, starts, ends, pstarts, m_pad: int):
    """x (M, K) bf16 -> (q (K, m_pad) e4m3 row-major, scale (E*K,)): per expert and column over
    the expert's rows, written at the padded row positions (padding zero)."""
    E, K = len(starts), x_MK.shape[1]
    q = torch.zeros(K, m_pad, dtype=E4M3, device=x_MK.device)
    scale = torch.ones(E, K, device=x_MK.device)
    for e in range(E):
        blk = x_MK[starts[e] : ends[e]].float()
        if blk.numel():
            amax = blk.abs().amax(0)
            m, ex = torch.frexp(amax / 448)
            s = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), ex - (m == 0.5).int()), 1.0)
            scale[e] = s
            q[:, pstarts[e] : pstarts[e] + blk.shape[0]] = (blk / s).t().to(E4M3)
    return q, scale.reshape(-1)


def probe(name: str, E: int, M: int, D: int, F: int) -> None:
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    counts = torch.full((E,), M // E, dtype=torch.int64)
    counts[: M % E] += 1
    counts[0] += 7  # uneven blocks, as learned routing gives
    counts[-1] -= 7
    ends = counts.cumsum(0)
    starts = ends - counts
    padded = ((counts + 15) // 16 * 16).clamp(min=16)
    pends = padded.cumsum(0)
    pstarts = pends - padded
    m_pad = int(pends[-1])
    offs = ends.to(torch.int32).to(dev)
    poffs = pends.to(torch.int32).to(dev)
    for gemm, n_out, k_in in (("gate_up", 2 * F, D), ("down", D, F)):
        dy = torch.randn(M, n_out, device=dev, generator=g).to(torch.bfloat16)
        x = torch.randn(M, k_in, device=dev, generator=g).to(torch.bfloat16)
        bf16_ms = _median_ms(lambda dy=dy, x=x: torch._grouped_mm(dy.t(), x, offs=offs))
        aq, sa = _segment_quantize_t(dy, starts.tolist(), ends.tolist(), pstarts.tolist(), m_pad)  # (N, Mp)
        bq_t, sb = _segment_quantize_t(x, starts.tolist(), ends.tolist(), pstarts.tolist(), m_pad)  # (K, Mp)
        bq = bq_t.t()  # (Mp, K) column-major
        row = {"shape": name, "gemm": gemm, "E": E, "M": M, "N": n_out, "K": k_in, "bf16_ms": round(bf16_ms, 3)}
        for fast in (False, True):

            def f8(fast=fast, aq=aq, bq=bq, sa=sa, sb=sb):
                return torch._scaled_grouped_mm(
                    aq, bq, sa, sb, offs=poffs, out_dtype=torch.bfloat16, use_fast_accum=fast
                )

            try:
                out = f8()
                row[f"fp8{'_fast' if fast else ''}_ms"] = round(_median_ms(f8), 3)
                if not fast:
                    ref = torch.stack(
                        [
                            (aq[:, pstarts[e] : pends[e]].float() * sa.view(E, -1)[e, :, None])
                            @ (bq[pstarts[e] : pends[e]].float() * sb.view(E, -1)[e])
                            for e in range(E)
                        ]
                    )
                    row["rel_err"] = float((out.float() - ref).norm() / ref.norm())
            except Exception as exc:  # the probe's job is to say what does not work
                row[f"fp8{'_fast' if fast else ''}_error"] = repr(exc)[:300]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    probe("bench-8e", 8, 32768, 4096, 4096)
    probe("bench-sweep-64", 64, 32768, 2048, 1024)
    probe("bench-sweep-8", 8, 32768, 2048, 1024)
