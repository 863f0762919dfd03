"""Can a weight-gradient GEMM accumulate straight into an fp32 buffer on this GPU, and what does it
cost against today's bf16 GEMM + cast + add? (Weight gradients accumulated in fp32 once per step:
Megatron's gradient-accumulation fusion.)

For a dense weight (out × in) and a stacked expert weight (E × out × in), per micro-batch:
  today:  dW_bf16 = dyᵀ·x (bf16 out), then .grad_fp32 += dW_bf16.float()   (autocast's cast + accumulate)
  fused:  torch.addmm(grad_fp32, dyᵀ, x, out_dtype=fp32, out=grad_fp32)    (one GEMM, fp32 C and D)
  grouped: torch._grouped_mm(dyᵀ, x, offs, out_dtype=fp32) then add        (if the kernel takes fp32 out)
Prints one JSON line per probe: whether it ran, its max error against an fp64 reference, and
milliseconds per call (CUDA events, median of 20 after 5 warm-ups).

    python benchmarks/probes/wgrad_probe.py            (CUDA only)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import timed  # noqa: E402


def report(name: str, fn, check=None) -> None:
    try:
        ms = timed(fn)
        err = check() if check else None
        print(json.dumps({"probe": name, "ok": True, "ms": round(ms, 4), "max_rel_err": err}), flush=True)
    except Exception as e:  # a probe: record what failed and go on
        print(json.dumps({"probe": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    # bench-8e's attention output projection: 8192 tokens, 4096 × 4096
    T, D_out, D_in = 8192, 4096, 4096
    dy = torch.randn(T, D_out, device=dev, dtype=torch.bfloat16)
    x = torch.randn(T, D_in, device=dev, dtype=torch.bfloat16)
    grad = torch.zeros(D_out, D_in, device=dev, dtype=torch.float32)
    ref = (dy.double().t() @ x.double()).float()

    def rel(a):
        return float((a - ref).abs().max() / ref.abs().max())

    report("dense bf16 mm + cast + add (today)", lambda: grad.add_((dy.t() @ x).float()))
    grad.zero_()
    report(
        "dense addmm out_dtype=fp32 into grad", lambda: torch.addmm(grad, dy.t(), x, out_dtype=torch.float32, out=grad)
    )
    g2 = torch.zeros_like(grad)
    torch.addmm(g2, dy.t(), x, out_dtype=torch.float32, out=g2)
    print(json.dumps({"probe": "dense addmm out_dtype=fp32 accuracy", "max_rel_err": rel(g2)}), flush=True)
    report("dense mm out_dtype=fp32", lambda: torch.mm(dy.t(), x, out_dtype=torch.float32))

    # bench-tiny64e-l6's experts: 64 experts, 16384 tokens × top-4 rows, d 2048, hidden 2048
    E, M, D, F = 64, 16384 * 4, 2048, 2048
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (M // E)
    dy_e = torch.randn(M, D, device=dev, dtype=torch.bfloat16)
    h_e = torch.randn(M, F, device=dev, dtype=torch.bfloat16)
    grad_e = torch.zeros(E, D, F, device=dev, dtype=torch.float32)
    report(
        "grouped bf16 (dyᵀ·h per expert) + cast + add (today)",
        lambda: grad_e.add_(torch._grouped_mm(dy_e.t(), h_e, offs=offs).float()),
    )
    report(
        "grouped out_dtype=fp32 + add",
        lambda: grad_e.add_(torch._grouped_mm(dy_e.t(), h_e, offs=offs, out_dtype=torch.float32)),
    )
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
