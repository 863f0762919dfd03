"""Where the time of Muon's step goes on one GPU: its parts timed apart over a preset's matrices.

Builds fp32 weights, gradients and momenta of every matrix Muon updates in PRESET (the shapes
`muon_matrices` gives: one tensor per parameter, experts stacked) on the GPU and times, summed
over them, each part as `Muon.step` runs it:
  momentum_direction — M ← β·M + c·G and U = c·G + β·M (fp32 arithmetic, U written in bf16),
                       one compiled kernel as moetrain runs it; *_eager: torch's element-wise
                       ops one by one, U in fp32 (the same arithmetic);
  newton_schulz      — the 5 bf16 iterations with the epilogues in the GEMMs (baddbmm), at its
                       FLOP rate (4·S²·L + 2·S³ per iteration and matrix, S the short side, L the
                       long one);
  newton_schulz_plain— the same iterations with b·A + c·A² and a·X + B·X as separate
                       element-wise ops on a transposed X (the textbook form), for comparison;
  apply_update       — W ← W·(1 − lr·wd) − lr·s·O (fp32 arithmetic, O read in bf16), compiled;
                       *_eager: element by element ops with O in fp32.
Timings: CUDA events, median of --reps after warm-ups (`cuda_timing.timed`), random data.
Prints one JSON line.

    python benchmarks/probes/muon_step_probe.py [--preset bench-tiny64e-l6] [--reps 5]   (CUDA only)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from cuda_timing import timed  # noqa: E402

from moetrain.model.transformer import Transformer  # noqa: E402
from moetrain.optim.muon import (  # noqa: E402
    NS_COEFFICIENTS,
    _apply_update,
    _momentum_direction,
    apply_update,
    momentum_direction,
    muon_matrices,
    newton_schulz,
)
from moetrain.presets import preset  # noqa: E402


def plain_newton_schulz(u_kMN: torch.Tensor, steps: int) -> torch.Tensor:
    """The textbook form: wide orientation by transposing, element-wise epilogues."""
    a, b, c = NS_COEFFICIENTS
    x = u_kMN.to(torch.bfloat16)
    tall = x.shape[-2] > x.shape[-1]
    x = x.mT if tall else x
    x = x / (torch.linalg.matrix_norm(x.float(), keepdim=True) + 1e-7).to(torch.bfloat16)
    for _ in range(steps):
        a_kMM = x @ x.mT
        x = a * x + (b * a_kMM + c * a_kMM @ a_kMM) @ x
    return (x.mT if tall else x).float()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="bench-tiny64e-l6")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ns-only", action="store_true", help="Newton–Schulz alone (no fp32 state: fits 80 GB)")
    parser.add_argument("--dry-run", action="store_true", help="tiny, on CPU, untimed: checks the script runs")
    args = parser.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    timer = (lambda fn, reps, warmup: (fn(), 0.0)[1] + 1.0) if args.dry_run else timed
    with torch.device("meta"):
        model = Transformer(preset(args.preset).model)
    shapes = list(muon_matrices(model).values())
    coef, skip = torch.ones((), device=dev), torch.zeros((), dtype=torch.bool, device=dev)
    bf16, fp32 = torch.bfloat16, torch.float32
    if args.ns_only:
        us = [torch.randn(s.count, s.rows, s.cols, device=dev, dtype=bf16) for s in shapes]
        parts = {}
    else:
        mats = [(s, torch.randn(s.count, s.rows, s.cols, device=dev) * 0.02) for s in shapes]
        grads = [torch.randn_like(w) * 1e-3 for _, w in mats]
        moms = [torch.zeros_like(w) for _, w in mats]
        us = [momentum_direction(m, g, 0.95, coef, skip, bf16) for m, g in zip(moms, grads)]
        os_ = [newton_schulz(u, 5, bf16) for u in us]
        os32 = [o.float() for o in os_]
        pairs = list(zip(moms, grads))
        parts = {
            "momentum_direction": lambda: [momentum_direction(m, g, 0.95, coef, skip, bf16) for m, g in pairs],
            "momentum_direction_eager": lambda: [_momentum_direction(m, g, 0.95, coef, skip, fp32) for m, g in pairs],
            "apply_update": lambda: [apply_update(w, o, s.scale, 1e-3, 0.1, skip) for (s, w), o in zip(mats, os_)],
            "apply_update_eager": lambda: [
                _apply_update(w, o, s.scale, 1e-3, 0.1, skip) for (s, w), o in zip(mats, os32)
            ],
        }
    flops = 0
    for s in shapes:
        short, long = min(s.rows, s.cols), max(s.rows, s.cols)
        flops += s.count * 5 * (4 * short * short * long + 2 * short**3)
    ms = {name: timer(fn, args.reps, 2) for name, fn in parts.items()}
    ms["newton_schulz"] = timer(lambda: [newton_schulz(u, 5, torch.bfloat16) for u in us], args.reps, 2)
    ms["newton_schulz_plain"] = timer(lambda: [plain_newton_schulz(u, 5) for u in us], args.reps, 2)
    max_err = max((newton_schulz(u, 5, torch.bfloat16) - plain_newton_schulz(u, 5)).abs().max().item() for u in us)
    print(
        json.dumps(
            {
                "preset": args.preset,
                "matrices": sum(s.count for s in shapes),
                "elements": sum(u.numel() for u in us),
                "ns_tflop": flops / 1e12,
                "ms": {k: round(v, 2) for k, v in ms.items()},
                "ns_tflops_per_s": round(flops / ms["newton_schulz"] / 1e9, 1),
                "ns_plain_tflops_per_s": round(flops / ms["newton_schulz_plain"] / 1e9, 1),
                "ns_forms_max_abs_diff": max_err,
                "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)",
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
