"""The rates the planner charges for a step's per-parameter passes and its grouped GEMMs, measured
on one GPU.

What grows with the experts a rank holds is memory-bound work over every local parameter — the
optimizer step, the gradient norm, the gradients' copies and accumulation — and grouped GEMMs
whose rows per expert shrink. This probe times each of those kernels, as moetrain calls them,
and prints its achieved bandwidth (bytes read plus written over the time) or FLOP rate:

- copy: a device-to-device copy (the bandwidth ceiling, and a gradient copied into its bucket);
- adamw_split: the Triton AdamW kernel (`adamw_triton`, src/moetrain/optim/triton_kernels.py) over
  split masters, fp32 or bf16 moments, fp32 or bf16 gradients, with a clipping factor and skip
  flag; over one flat buffer and over per-parameter tensors as `adamw_update` runs it on a
  `SplitMaster`'s;
- torch_adamw_fused: torch's fused AdamW over fp32 parameters (the embedding and the rest);
- grad_add_bf16 / accumulate_fp32: a gradient added in place
  in bf16 (optim.grad_dtype=bf16), and added into an fp32 sum (`accumulate_grad`);
- group_join: `GroupGrads`' copy of n groups' slices into one gradient;
- grad_norm: the clipping norm's pass, `_foreach_norm` in fp32 against moetrain's `sum_squares`;
- grouped_mm: one expert layer's six grouped GEMMs (forward gate/up and down, and backward's
  input and weight gradients of both) at a fixed number of rows per rank, as the experts a rank
  holds grow; TFLOP/s against the rows each expert gets.

Timings: CUDA events, median of `--reps` after warm-ups (`cuda_timing.timed`), on random data.

    python benchmarks/step_bytes_probe.py [--elements 1e9] [--out DIR]     (CUDA only)
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from cuda_timing import timed  # noqa: E402

from moetrain.optim.split_master import split_fp32  # noqa: E402
from moetrain.optim.triton_kernels import (  # noqa: E402
    accumulate_grad,
    adamw_triton,
    bias_corrections,
    sum_squares,
)

ROWS = []


def record(kind: str, name: str, ms: float, *, bytes_moved: float = 0.0, flops: float = 0.0, **extra) -> None:
    row = {"kind": kind, "name": name, "ms": round(ms, 4), **extra}
    if bytes_moved:
        row["bytes"] = bytes_moved
        row["tb_s"] = round(bytes_moved / ms / 1e9, 3)
        row["hbm_frac"] = round(bytes_moved / ms / 1e9 / 4.8, 3)
    if flops:
        row["tflop_s"] = round(flops / ms / 1e9, 1)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def passes(n: int, reps: int) -> None:
    """The gradients' passes: copies, in-place adds, the fp32 accumulation, the join, the norm."""
    dev, bf16, fp32 = "cuda", torch.bfloat16, torch.float32
    g = torch.randn(n, device=dev, dtype=bf16)
    acc = torch.randn(n, device=dev, dtype=bf16)
    record(
        "pass",
        "copy bf16 (the ceiling; a gradient into its bucket)",
        timed(partial(acc.copy_, g), reps),
        bytes_moved=4 * n,
    )
    record("pass", "grad_add_bf16 (acc += g, bf16)", timed(partial(acc.add_, g), reps), bytes_moved=6 * n)
    acc32 = torch.randn(n, device=dev, dtype=fp32)
    record(
        "pass", "accumulate_fp32 (fp32 += bf16)", timed(partial(accumulate_grad, acc32, g), reps), bytes_moved=10 * n
    )
    # GroupGrads: n groups' gradient slices copied into one buffer (by experts: 4 groups)
    k = n // 4
    pieces = list(torch.randn(4, k, device=dev, dtype=bf16).unbind(0))
    targets = list(acc[: 4 * k].view(4, k).unbind(0))
    record(
        "pass", "group_join (4 slices into one)", timed(partial(_each_copy, targets, pieces), reps), bytes_moved=16 * k
    )
    # the clipping norm over bf16 gradients, in fp32, as tensors of ~50M elements
    parts = list(g.split(50_331_648))
    record("pass", "grad_norm (_foreach_norm bf16 -> fp32)", timed(partial(_norm, parts), reps), bytes_moved=2 * n)
    parts32 = list(acc32.split(50_331_648))
    record("pass", "grad_norm (_foreach_norm fp32)", timed(partial(_norm, parts32), reps), bytes_moved=4 * n)
    record("pass", "grad_norm (sum_squares bf16)", timed(partial(sum_squares, parts), reps), bytes_moved=2 * n)
    record("pass", "grad_norm (sum_squares fp32)", timed(partial(sum_squares, parts32), reps), bytes_moved=4 * n)


def _each_copy(targets: list[torch.Tensor], pieces: list[torch.Tensor]) -> None:
    """`GroupGrads`' join: each group's gradient copied into its slice of one buffer."""
    for t, p in zip(targets, pieces):
        t.copy_(p)


def _norm(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(parts, 2, dtype=torch.float32)).square().sum()


def optimizer(n: int, reps: int) -> None:
    """The split AdamW kernel, flat and per parameter, and torch's fused fp32 AdamW."""
    dev, bf16, fp32 = "cuda", torch.bfloat16, torch.float32
    hi, lo = split_fp32(torch.randn(n, device=dev, dtype=fp32) * 0.02)
    corr = bias_corrections(torch.ones((), device=dev), 1e-4, 0.9, 0.95)
    hyper = dict(  # lr=1e-4 comes with the corrections
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        grad_coef=torch.full((), 0.5, device=dev),
        skip=torch.zeros((), dtype=torch.bool, device=dev),
    )
    # as adamw_update runs it on SplitMaster's parameters: one launch per parameter (sweep-8l-128's expert tensors
    # are 16 × 8192 × 4096 and 16 × 4096 × 4096 elements)
    size = 16 * 4096 * 4096
    for m_dtype in (fp32, bf16):
        for g_dtype in (fp32, bf16):
            g = torch.randn(n, device=dev, dtype=g_dtype)
            m = torch.randn(n, device=dev, dtype=m_dtype) * 1e-3
            v = torch.rand(n, device=dev, dtype=m_dtype) * 1e-6
            moved = n * (2 * 2 + 2 * 2 + g_dtype.itemsize + 4 * m_dtype.itemsize)  # hi, lo, m, v r+w; g r
            name = f"adamw_split moments {str(m_dtype)[6:]} grads {str(g_dtype)[6:]}"
            record(
                "optimizer",
                name + " (flat)",
                timed(partial(adamw_triton, hi, lo, g, m, v, corr, **hyper), reps),
                bytes_moved=moved,
            )
            calls = [
                partial(adamw_triton, *(t[i : i + size] for t in (hi, lo, g, m, v)), corr, **hyper)
                for i in range(0, n - size + 1, size)
            ]
            record(
                "optimizer",
                name + f" ({len(calls)} tensors of 268M)",
                timed(partial(_each, calls), reps),
                bytes_moved=moved * len(calls) * size / n,
            )
    # torch's fused AdamW over fp32 parameters (fp32 gradients and moments): 16 B read, 12 written
    k = n // 4
    p = torch.nn.Parameter(torch.randn(k, device=dev))
    p.grad = torch.randn(k, device=dev)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()
    record("optimizer", "torch_adamw_fused fp32", timed(opt.step, reps), bytes_moved=28 * k)


def _each(calls) -> None:
    for c in calls:
        c()


def _expert_layer(x, dy, h, a, w1, w2, offs) -> None:
    """The six grouped GEMMs of one expert layer: gate/up and down forward; backward, the input
    gradients of both (d a, d x) and their weight gradients (d w2, d w1)."""
    torch._grouped_mm(x, w1, offs=offs)
    torch._grouped_mm(a, w2, offs=offs)
    torch._grouped_mm(dy, w2.transpose(-2, -1), offs=offs)
    torch._grouped_mm(a.t(), dy, offs=offs)
    torch._grouped_mm(h, w1.transpose(-2, -1), offs=offs)
    torch._grouped_mm(x.t(), h, offs=offs)


def grouped(reps: int) -> None:
    """One expert layer's grouped GEMMs, forward and backward, at a fixed number of routed rows per
    rank, as the experts the rank holds grow."""
    dev, bf16 = "cuda", torch.bfloat16
    shapes = [
        # (label, D, F, rows per rank, local experts): sweep-8l at ep 8 (4 sequences of 4096 per
        # micro-batch, top-4: 65,536 rows), bench-sweep on one GPU (8192 tokens, top-4)
        ("sweep-8l ep8", 4096, 4096, 65536, (1, 2, 4, 8, 16)),
        ("bench-sweep", 2048, 1024, 32768, (8, 16, 32, 64)),
    ]
    for label, D, F, M, experts in shapes:
        x = torch.randn(M, D, device=dev, dtype=bf16)
        dy = torch.randn(M, D, device=dev, dtype=bf16)
        h = torch.randn(M, 2 * F, device=dev, dtype=bf16)
        a = torch.randn(M, F, device=dev, dtype=bf16)
        gen = torch.Generator().manual_seed(0)
        for E in experts:
            w1 = torch.randn(E, D, 2 * F, device=dev, dtype=bf16) * D**-0.5
            w2 = torch.randn(E, F, D, device=dev, dtype=bf16) * F**-0.5
            flops = 3 * 2 * M * D * 3 * F  # forward 2·M·D·3F, backward twice that
            # equal groups, then the group sizes of uniformly random routing (a multinomial draw
            # of the M rows over E experts): uneven sizes leave partial tiles in every group
            sizes = {
                "equal": torch.full((E,), M // E),
                "random": torch.multinomial(torch.ones(E), M, replacement=True, generator=gen).bincount(minlength=E),
            }
            for kind, size in sizes.items():
                offs = size.cumsum(0).to(device=dev, dtype=torch.int32)
                ms = timed(partial(_expert_layer, x, dy, h, a, w1, w2, offs), reps)
                name = f"{label} E={E} {kind} groups"
                record("grouped_mm", name, ms, flops=flops, rows_per_expert=M // E, D=D, F=F, max_rows=int(size.max()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=float, default=1e9, help="elements of the memory-bound passes")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="also write the rows to DIR/step_bytes.jsonl")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name()}), flush=True)
    passes(int(args.elements), args.reps)
    torch.cuda.empty_cache()
    optimizer(int(args.elements), args.reps)
    torch.cuda.empty_cache()
    grouped(args.reps)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_bytes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    print(f"\n{'kind':<11} {'name':<64} {'ms':>9} {'TB/s':>6} {'TFLOP/s':>8}")
    for r in ROWS:
        print(f"{r['kind']:<11} {r['name']:<64} {r['ms']:>9.3f} {r.get('tb_s', ''):>6} {r.get('tflop_s', ''):>8}")


if __name__ == "__main__":
    main()
