"""Where row-wise FP8 pays: every matrix product of a preset's step timed in bf16 and in FP8,
forward and backward, with the quantizers, in isolation and inside the compiled model.

Products (one JSON line each, "part": "product"): the attention's q/k/v/o linears, the shared
expert's and dense MLP's linears, the experts' layer (gate/up, SwiGLU, down as the package runs
it: `GroupedExperts.forward`), and the LM head, at the preset's micro-batch (expert rows as
balanced routing gives them). CUDA events, median of 20 after 5 warm-ups.

Model (one JSON line per variant, "part": "model", with --model): the preset's whole model in
bf16 with compiled blocks, forward and backward of one micro-batch, with FP8 on none, on the
linear layers only, on the experts only, or on all of them — what the graph breaks around the
FP8 islands add is in these and not in the products.

Run on a GPU: `python benchmarks/probes/fp8_choice_probe.py bench-8e bench-tiny64e-l6 --model`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import timed  # noqa: E402

from moetrain.model.experts import GroupedExperts, expert_mlp  # noqa: E402
from moetrain.model.fp8 import Fp8Linear, fp8_expert_mlp, fp8_linear  # noqa: E402
from moetrain.presets import PRESETS  # noqa: E402

BF16 = torch.bfloat16


def _products(preset: str) -> list[dict]:
    cfg = PRESETS[preset]()
    m = cfg.model
    M = cfg.train.micro_batch_size * cfg.data.seq_len
    hd = m.head_dim or m.d_model // m.n_heads
    D, moe = m.d_model, m.moe
    out = [
        dict(kind="linear", name="wq", M=M, K=D, N=m.n_heads * hd),
        dict(kind="linear", name="wk/wv", M=M, K=D, N=m.n_kv_heads * hd),
        dict(kind="linear", name="wo", M=M, K=m.n_heads * hd, N=D),
        dict(kind="experts", name="experts", M=M * moe.top_k, K=D, N=moe.expert_hidden, E=moe.num_experts),
        dict(kind="linear", name="lm_head", M=M, K=D, N=m.vocab_size),
    ]
    dense = m.resolved_dense_hidden
    if m.num_dense_layers:
        out += [
            dict(kind="linear", name="dense gate/up", M=M, K=D, N=dense),
            dict(kind="linear", name="dense down", M=M, K=dense, N=D),
        ]
    shared = moe.shared_hidden
    if shared:
        out += [
            dict(kind="linear", name="shared gate/up", M=M, K=D, N=shared),
            dict(kind="linear", name="shared down", M=M, K=shared, N=D),
        ]
    return out


def _time_linear(M: int, K: int, N: int) -> tuple[float, float]:
    x = torch.randn(M, K, device="cuda", dtype=BF16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda", dtype=BF16) * K**-0.5).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=BF16)

    def run(fn):
        def step():
            x.grad = w.grad = None
            fn(x, w).backward(dy)

        return timed(step)

    return run(F.linear), run(fp8_linear)


def _time_experts(M: int, K: int, N: int, E: int) -> tuple[float, float]:
    experts = GroupedExperts(E, K, N).cuda().to(BF16)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.02)
    x = torch.randn(M, K, device="cuda", dtype=BF16, requires_grad=True)
    counts = torch.full((E,), M // E, dtype=torch.int64)
    counts[: M % E] += 1
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    dy = torch.randn(M, K, device="cuda", dtype=BF16)

    def run(mlp):
        experts.mlp = mlp

        def step():
            x.grad = None
            experts.zero_grad()
            experts(x, offsets).backward(dy)

        return timed(step)

    return run(expert_mlp), run(fp8_expert_mlp)


def products(presets: list[str]) -> None:
    seen = {}
    for preset in presets:
        for p in _products(preset):
            key = (p["kind"], p["M"], p["K"], p["N"], p.get("E"))
            if key not in seen:
                if p["kind"] == "experts":
                    seen[key] = _time_experts(p["M"], p["K"], p["N"], p["E"])
                else:
                    seen[key] = _time_linear(p["M"], p["K"], p["N"])
                torch.cuda.empty_cache()
            bf16_ms, fp8_ms = seen[key]
            times = dict(bf16_ms=round(bf16_ms, 4), fp8_ms=round(fp8_ms, 4), speedup=round(bf16_ms / fp8_ms, 3))
            print(json.dumps(dict(part="product", preset=preset, **p, **times)), flush=True)


def _apply(model: nn.Module, variant: str) -> None:
    """FP8 on the variant's products (the package's `apply_fp8` applies "all")."""
    for name, module in list(model.named_modules()):
        if isinstance(module, GroupedExperts) and variant in ("experts", "all"):
            module.mlp = fp8_expert_mlp
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and ".blocks." in f".{name}." and variant in ("linears", "all"):
                module.register_module(child_name, Fp8Linear(child))


def _time_model(preset: str, variant: str, steps: int) -> dict:
    cfg = PRESETS[preset]()
    model = cfg.model.build(device="cuda")
    model.init_weights(seed=0)
    model.to(BF16)
    _apply(model, variant)
    for block in model.blocks.values():
        block.compile(dynamic=False)
    B, T = cfg.train.micro_batch_size, cfg.data.seq_len
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (B, T + 1), device="cuda", generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        model.zero_grad(set_to_none=True)
        model(inputs, None, targets, 16384).backward()

    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    ms = timed(step, reps=steps, warmup=2)
    peak = torch.cuda.max_memory_allocated() / 2**30
    return dict(fwd_bwd_ms=round(ms, 2), tokens=B * T, compile_s=round(compile_s, 1), peak_gib=round(peak, 2))


def model_variants(preset: str, variants: list[str], steps: int) -> None:
    for variant in variants:
        torch._dynamo.reset()
        record = _time_model(preset, variant, steps)
        print(json.dumps(dict(part="model", preset=preset, variant=variant, **record)), flush=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def profile_linear(M: int, K: int, N: int) -> None:
    """The kernels of one FP8 linear's forward and backward, and its host time per call."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(M, K, device="cuda", dtype=BF16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda", dtype=BF16) * K**-0.5).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=BF16)

    def step():
        fp8_linear(x, w).backward(dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    host_ms = (time.perf_counter() - t0) / 20 * 1000
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"fp8_linear {M}x{K}x{N}: host {host_ms:.3f} ms per call (launch only, no wait)")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("presets", nargs="+")
    ap.add_argument("--model", action="store_true", help="also time the compiled model per FP8 variant")
    ap.add_argument("--variants", default="none,linears,experts,all")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile", nargs=3, type=int, metavar=("M", "K", "N"), help="profile one FP8 linear instead")
    args = ap.parse_args()
    if args.profile:
        profile_linear(*args.profile)
        return
    products(args.presets)
    if args.model:
        for preset in args.presets:
            model_variants(preset, args.variants.split(","), args.steps)


if __name__ == "__main__":
    main()
