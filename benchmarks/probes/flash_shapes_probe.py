"""FlashAttention through aten on the shapes of one context-parallel chunk, forward and backward
timed apart: L queries against an S-key prefix, causal aligned to the lower right, against the
same work split into its non-causal L × (S − L) part and its causal L × L diagonal; and the whole
sequence's causal attention for the rate one GPU reaches.

    python benchmarks/probes/flash_shapes_probe.py --seq 65536 --chunk 8192

One JSON line per case: forward ms, forward + backward ms, TFLOP/s of each (causal FLOPs)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_timing import timed  # noqa: E402

FLASH = torch.ops.aten._scaled_dot_product_flash_attention


def case(name: str, L: int, S: int, causal: bool, H: int, G: int, Dh: int) -> None:
    q = torch.randn(1, H, L, Dh, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, G, S, Dh, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    pairs = L * (S - L) + L * L / 2 if causal else L * S
    flops = 4 * H * Dh * pairs

    def fwd():
        with torch.no_grad():
            FLASH(q, k, v, 0.0, is_causal=causal)

    def both():
        out = FLASH(q, k, v, 0.0, is_causal=causal)[0]
        out.backward(torch.ones_like(out))

    f, b = timed(fwd, reps=5, warmup=2), timed(both, reps=5, warmup=2)
    record = {"case": name, "L": L, "S": S, "causal": causal, "fwd_ms": round(f, 2), "fwd_bwd_ms": round(b, 2)}
    record.update(fwd_tflops=round(flops / f / 1e9, 1), bwd_tflops=round(2.5 * flops / (b - f) / 1e9, 1))
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=65536)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args()
    T, L, H, G = args.seq, args.chunk, args.heads, args.kv_heads
    case("whole sequence, causal", T, T, True, H, G, 128)
    case("last chunk over its prefix, lower-right causal", L, T, True, H, G, 128)
    case("last chunk over the earlier keys, no mask", L, T - L, False, H, G, 128)
    case("last chunk's diagonal block, causal", L, L, True, H, G, 128)


if __name__ == "__main__":
    main()
