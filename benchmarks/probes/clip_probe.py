"""Gradient clipping folded into fused AdamW vs applied to the gradients first.

Builds fp32 parameters and gradients with bench-8e's tensor shapes (4.58B parameters; ~73 GB of
parameters, gradients and AdamW state) on one GPU and times, per optimizer step:
  separate — torch._foreach_mul_(grads, coef) then the fused AdamW kernel (reads and writes every
             gradient once more);
  folded   — the fused AdamW kernel with grad_scale = 1 / coef (what ReplicatedAdamW does on CUDA).
Both include the global gradient norm (torch._foreach_norm). Prints one JSON line.
Usage: python benchmarks/probes/clip_probe.py [--steps 10]
"""

from __future__ import annotations

import argparse
import json

import torch

from moetrain.model.transformer import Transformer
from moetrain.optim.clip import clip_coefficient
from moetrain.presets import preset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--preset", default="bench-8e")
    args = parser.parse_args()
    with torch.device("meta"):
        shapes = [p.shape for p in Transformer(preset(args.preset).model).parameters()]
    params = [torch.randn(s, device="cuda") * 0.02 for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    grads = [p.grad for p in params]
    opt = torch.optim.AdamW([{"params": params}], lr=1e-4, fused=True)

    def step(folded: bool) -> None:
        norm = torch.stack(torch._foreach_norm(grads)).square().sum().sqrt()
        coef = clip_coefficient(norm, 1.0)
        if folded:
            opt.grad_scale = coef.reciprocal()
        else:
            torch._foreach_mul_(grads, coef)
        opt.step()
        opt.grad_scale = None

    out = {
        "preset": args.preset,
        "params": sum(p.numel() for p in params),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    for name, folded in (("separate", False), ("folded", True), ("separate_again", False), ("folded_again", True)):
        for _ in range(3):
            step(folded)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.steps):
            step(folded)
        end.record()
        torch.cuda.synchronize()
        out[f"{name}_ms"] = start.elapsed_time(end) / args.steps
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
