"""How much does a transfer running beside the experts' GEMMs slow them, on one GPU? A proxy for
the planner's `overlap_slowdown` (src/moetrain/plan/calibration.py) until an 8-GPU machine measures NCCL's
all-to-all itself.

An NVLink all-to-all under compute costs the compute what NCCL's kernels take from it: the SMs its
channels hold for the transfer's whole duration (one CTA per channel, spinning or copying) and the
HBM bandwidth its copies use (each byte sent is read once and each byte received written once:
at sweep-8l's ~150 GB/s a direction per GPU, ~0.3 TB/s of HBM). The probe stands a Triton copy
kernel in for it: `sms` persistent programs (one per SM) copying between two buffers larger than
L2 for longer than the compute runs, on a second stream. It times one MoE layer's expert GEMMs
(sweep-8l-128's per-rank share at ep 8: 16 experts of 4096 × 4096, 65,536 rows, forward and
backward: the six grouped GEMMs) alone and beside it, and prints the compute's slowdown
((beside − alone) / beside: the fraction of the transfer's duration the compute loses, the
planner's unit) with the copy's own bandwidth.

Caveats, stated with the figures: a real all-to-all waits on its peers (its SMs may idle rather
than copy) and moves its bytes at NVLink's rate, not the copy kernel's; NCCL picks its channel
count itself (`NCCL_MAX_NCHANNELS` and its tuning; 16–32 CTAs on one NVLink node is typical).

    python benchmarks/interference_probe.py [--sms 8,16,24,32] [--reps 10]     (CUDA only)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_bytes_probe import _expert_layer  # noqa: E402


@triton.jit
def _copy_loop(src_ptr, dst_ptr, per_program: tl.constexpr, iters: tl.constexpr, BLOCK: tl.constexpr):
    """Program p copies its own stretch [p·per_program, (p+1)·per_program) `iters` times."""
    base = tl.program_id(0).to(tl.int64) * per_program
    for _ in range(iters):
        for start in range(0, per_program, BLOCK):
            offs = base + start + tl.arange(0, BLOCK)
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs))


def events_ms(fn, stream=None) -> float:
    """Milliseconds of `fn` on `stream` (default: the current one), by CUDA events."""
    stream = stream or torch.cuda.current_stream()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    fn()
    b.record(stream)
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", default="8,16,24,32", help="programs (SMs) the copy kernel holds")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    E, D, F, M = 16, 4096, 4096, 65536
    x, dy = torch.randn(M, D, device=dev, dtype=bf16), torch.randn(M, D, device=dev, dtype=bf16)
    h, a = torch.randn(M, 2 * F, device=dev, dtype=bf16), torch.randn(M, F, device=dev, dtype=bf16)
    w1 = torch.randn(E, D, 2 * F, device=dev, dtype=bf16) * D**-0.5
    w2 = torch.randn(E, F, D, device=dev, dtype=bf16) * F**-0.5
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (M // E)
    compute = partial(_expert_layer, x, dy, h, a, w1, w2, offs)
    for _ in range(3):
        compute()
    alone = statistics.median(events_ms(compute) for _ in range(args.reps))
    per_program, block = 4 * 2**20, 4096  # 8 MB of bf16 per program: the stretches outrun L2
    side = torch.cuda.Stream()
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "compute_alone_ms": alone}))
    rows = []
    for sms in (int(s) for s in args.sms.split(",")):
        src = torch.randn(sms * per_program, device=dev, dtype=bf16)
        dst = torch.empty_like(src)
        hog = partial(_copy_loop[(sms,)], src, dst, per_program, 1, BLOCK=block, num_warps=8)
        hog()
        one = statistics.median(events_ms(hog) for _ in range(5))
        iters = max(1, int(3 * alone / one))  # outlasts the compute
        long_hog = partial(_copy_loop[(sms,)], src, dst, per_program, iters, BLOCK=block, num_warps=8)
        beside = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            start_side = torch.cuda.Event(enable_timing=True)
            end_side = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                start_side.record(side)
                long_hog()
                end_side.record(side)
            ms = events_ms(compute)
            torch.cuda.synchronize()
            assert start_side.elapsed_time(end_side) > ms, "the copy ended before the compute"
            beside.append(ms)
        with_copy = statistics.median(beside)
        # The same with the GEMMs told to leave `sms` SMs alone (torch's experimental SM carveout,
        # which async tensor parallelism sets for its transfers): alone, then beside the copy.
        torch._C._set_sm_carveout_experimental(sms)
        try:
            compute()
            carved = statistics.median(events_ms(compute) for _ in range(args.reps))
            carved_beside = []
            for _ in range(args.reps):
                torch.cuda.synchronize()
                with torch.cuda.stream(side):
                    long_hog()
                carved_beside.append(events_ms(compute))
                torch.cuda.synchronize()
        finally:
            torch._C._set_sm_carveout_experimental(None)
        carved_with_copy = statistics.median(carved_beside)
        row = {
            "sms": sms,
            "copy_tb_s_alone": round(2 * src.numel() * 2 / one / 1e9, 3),
            "compute_ms_alone": round(alone, 3),
            "compute_ms_beside": round(with_copy, 3),
            "slowdown": round((with_copy - alone) / with_copy, 3),
            "carveout_ms_alone": round(carved, 3),
            "carveout_ms_beside": round(carved_with_copy, 3),
            "carveout_slowdown": round((carved_with_copy - alone) / carved_with_copy, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del src, dst
    print(
        f"\n{'SMs':>4} {'copy TB/s':>10} {'alone ms':>9} {'beside ms':>10} {'slowdown':>9}"
        "  carveout alone, beside, slowdown"
    )
    for r in rows:
        print(
            f"{r['sms']:>4} {r['copy_tb_s_alone']:>10} {r['compute_ms_alone']:>9} "
            f"{r['compute_ms_beside']:>10} {r['slowdown']:>9}  {r['carveout_ms_alone']:>9} "
            f"{r['carveout_ms_beside']:>9} {r['carveout_slowdown']:>9}"
        )


if __name__ == "__main__":
    main()
