"""The overlapped expert exchange (parallel.overlap_chunks) on one GPU, through NCCL.

One process, a 1-rank NCCL group: the all-to-alls are NCCL kernels copying within the GPU (no
link), but the streams, the waits and the GEMMs are the real ones. One MoE layer at the shape of
sweep-8l-128's per-GPU share (d_model 4096, 16 local experts of hidden 4096, top-4, a shared
expert of 4096; 4 sequences of 4096 tokens), bf16 autocast, fp32 parameters, eager.

For overlap_chunks 0 (dispatch/combine), 1, 2 and 4:
- fwd+bwd ms per layer (CUDA events, median of --iters after --warmup);
- outputs and gradients against overlap_chunks 0: bit for bit (1 chunk) or the max relative
  difference (chunks by experts: the same sums, in kernels tiled for other row counts);
- a profiled iteration: NCCL busy time, the part of it no compute kernel covers (exposed), and
  the share of NCCL time under compute (benchmarks/trace_overlap.py's interval arithmetic).
Then the interference proxy: the same layer's fwd+bwd without exchange (the experts and shared
expert alone), alone and while a side stream runs NCCL all-to-alls of the layer's buffer back to
back: how much continuous NCCL traffic slows the compute (an upper bound: HBM-to-HBM copies
move far more bytes per second than an NVLink transfer does).

Usage: python benchmarks/overlap_probe.py [--tokens 16384] [--iters 20] [--bf16-weights] [--out DIR]
Prints one JSON line per measurement. `--device cpu` (gloo, small shapes: `--tokens 256
--d-model 64 --hidden 64`) checks the script and the numerics only: no timing there means much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timing import timed as cuda_ms  # noqa: E402
from trace_overlap import analyse  # noqa: E402

from moetrain.model.experts import GroupedExperts  # noqa: E402
from moetrain.model.mlp import SwiGLU  # noqa: E402
from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher  # noqa: E402
from moetrain.parallel.overlapped_dispatcher import OverlappedDispatcher  # noqa: E402

CHUNKS = (0, 1, 2, 4)


def dispatchers(E, group, capacity, spill, min_rows):
    """{chunks: the plain sync-free dispatcher (0) or the overlapped one with that many chunks}."""
    sizes = (capacity, spill, min_rows)
    return {
        n: OverlappedDispatcher(E, group, None, *sizes, chunks=n) if n else NoSyncDispatcher(E, group, None, *sizes)
        for n in CHUNKS
    }


def layer(D, E, H, Hs, device="cuda", seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    experts = GroupedExperts(E, D, H).to(device, dtype)
    shared = SwiGLU(D, Hs).to(device, dtype)
    with torch.no_grad():
        for p in [*experts.parameters(), *shared.parameters()]:
            p.normal_(0, 0.02)
    return experts, shared


def step(disp, experts, shared, x, ids, w, g):
    """One forward and backward of the exchange + experts + shared expert; the outputs."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    counts = torch.zeros(disp.num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
    route = SimpleNamespace(topk_ids_NK=ids, topk_weights_NK=w, tokens_per_expert_E=counts)
    with torch.autocast(x.device.type, torch.bfloat16):
        y = disp.expert_step(x, route, experts, shared)
    (y.float() * g).sum().backward()
    return [y.detach(), x.grad, w.grad, *[p.grad for p in experts.parameters()], *[p.grad for p in shared.parameters()]]


def inputs(N, D, E, K, device):
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(N, D, device=device, generator=gen)
    ids = torch.rand(N, E, device=device, generator=gen).topk(K, dim=1).indices  # random routing, distinct
    w = torch.rand(N, K, device=device, generator=gen)
    return x, ids, w, torch.randn(N, D, device=device, generator=gen)


def compare(disps, experts, shared, x, ids, w, g):
    """{chunks: the check against overlap_chunks 0} for 1, 2 and 4 chunks."""
    zero(experts, shared)  # the parameters' gradients accumulate: each run starts from none
    ref = step(disps[0], experts, shared, x, ids, w, g)
    out = {}
    for chunks in CHUNKS[1:]:
        zero(experts, shared)
        got = step(disps[chunks], experts, shared, x, ids, w, g)
        if chunks == 1:
            out[chunks] = {"bit_for_bit": all(torch.equal(a, b) for a, b in zip(got, ref))}
        else:
            out[chunks] = {"max_rel_diff": max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))}
    return out


def dry_run(args) -> None:
    dist.init_process_group("gloo", rank=0, world_size=1)
    N, D, E, H, K = args.tokens, args.d_model, args.experts, args.hidden, args.top_k
    experts, shared = layer(D, E, H, H, "cpu")
    x, ids, w, g = inputs(N, D, E, K, "cpu")
    disps = dispatchers(E, dist.group.WORLD, 1.25, 0.125, 1024)
    for chunks, check in compare(disps, experts, shared, x, ids, w, g).items():
        print(json.dumps({"probe": "dry-run", "device": "cpu", "overlap_chunks": chunks, **check}), flush=True)
    dist.destroy_process_group()


def zero(experts, shared):
    for p in [*experts.parameters(), *shared.parameters()]:
        p.grad = None


def timed(fn, warmup, iters):
    return cuda_ms(fn, reps=iters, warmup=warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--kernels", type=int, default=0, help="print the profiled run's top N kernels")
    ap.add_argument(
        "--capacity", type=float, default=1.25, help="the bounded dispatcher's capacity factor (spill: a tenth of it)"
    )
    ap.add_argument(
        "--bf16-weights", action="store_true", help="bf16 parameters, as optim.bf16_weights trains (CUDA's default)"
    )
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    if args.device == "cpu":
        return dry_run(args)
    if not torch.cuda.is_available():
        sys.exit("overlap_probe needs a CUDA GPU (it measures NCCL streams against compute); --device cpu checks it.")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    group = dist.group.WORLD
    N, D, E, H, K = args.tokens, args.d_model, args.experts, args.hidden, args.top_k
    experts, shared = layer(D, E, H, H, dtype=torch.bfloat16 if args.bf16_weights else torch.float32)
    x, ids, w, g = inputs(N, D, E, K, "cuda")
    # Chunks by experts (n divides the 16 local experts). With one rank the plain exchange's C and
    # W are capped at M (all of a rank's rows) from capacity 1 on, while each chunk's 1/n share
    # is not: capacity < 1 compares equal buffers (and drops alike).
    disps = dispatchers(E, group, args.capacity, args.capacity / 10, 1024)
    probe_chunks(args, disps, experts, shared, x, ids, w, g, N)
    interference(args, experts, shared, x, N, D, E, K, group)
    dist.destroy_process_group()


def probe_chunks(args, disps, experts, shared, x, ids, w, g, N):
    commit = os.environ.get("MOETRAIN_COMMIT", "unknown")
    base = {
        "commit": commit,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "tokens": N,
        "bf16_weights": args.bf16_weights,
        "chunking": "experts",
        "capacity": disps[0].capacity_factor,
    }

    checks = {0: {}, **compare(disps, experts, shared, x, ids, w, g)}
    for chunks, check in checks.items():

        def run(chunks=chunks):
            zero(experts, shared)
            step(disps[chunks], experts, shared, x, ids, w, g)

        ms = timed(run, args.warmup, args.iters)
        trace = args.out / f"overlap-trace-{chunks}.json"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace))
        if args.kernels:  # where the device time goes, by kernel
            table = prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=args.kernels, max_name_column_width=70
            )
            print(f"# chunks={chunks}\n{table}", flush=True)
        t = analyse(trace, 1)
        events = json.loads(trace.read_text()).get("traceEvents", [])
        memcpy_ms = sum(float(ev["dur"]) for ev in events if ev.get("cat") == "gpu_memcpy" and "dur" in ev) / 1e3
        trace.unlink()
        hidden = 1 - t["exposed_nccl_ms"] / t["nccl_ms"] if t["nccl_ms"] else 0.0
        print(
            json.dumps(
                {
                    **base,
                    "probe": "pipelined",
                    "overlap_chunks": chunks,
                    "fwd_bwd_ms": round(ms, 3),
                    "nccl_ms": t["nccl_ms"],
                    "exposed_nccl_ms": t["exposed_nccl_ms"],
                    "nccl_under_compute": round(hidden, 3),
                    "compute_ms": t["compute_ms"],
                    "memcpy_ms": round(memcpy_ms, 3),  # a 1-rank group's exchange may be a copy, not a kernel
                    **check,
                }
            ),
            flush=True,
        )


def interference(args, experts, shared, x, N, D, E, K, group):
    """The compute alone, then beside back-to-back NCCL all-to-alls on a side stream."""
    commit = os.environ.get("MOETRAIN_COMMIT", "unknown")
    base = {"commit": commit, "gpu": torch.cuda.get_device_name(), "tokens": N, "bf16_weights": args.bf16_weights}
    rows = torch.randn(int(1.375 * N * K), D, device="cuda", dtype=torch.bfloat16)
    recv = torch.empty_like(rows)
    x_local = torch.randn(int(1.25 * N * K), D, device="cuda")
    offsets = torch.linspace(0, x_local.shape[0], E + 1, device="cuda")[1:].to(torch.int32)

    def compute():
        zero(experts, shared)
        xx = x_local.detach().requires_grad_()
        xs = x.detach().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            out = experts(xx, offsets).float().sum() + shared(xs).float().sum()
        out.backward()

    alone = timed(compute, args.warmup, args.iters)
    side = torch.cuda.Stream()
    a2a_ms = timed(lambda: dist.all_to_all_single(recv, rows, group=group), args.warmup, args.iters)
    busy = max(1, int(alone / max(a2a_ms, 1e-3)) + 2)  # enough exchanges to outlast one compute

    def compute_beside_nccl():
        """The compute's own time (events on its stream) while the side stream's exchanges run."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(busy):
                dist.all_to_all_single(recv, rows, group=group)
        compute()
        b.record()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        return a.elapsed_time(b)

    for _ in range(args.warmup):
        compute_beside_nccl()
    beside = statistics.median(compute_beside_nccl() for _ in range(args.iters))
    print(
        json.dumps(
            {
                **base,
                "probe": "interference",
                "compute_alone_ms": round(alone, 3),
                "a2a_ms": round(a2a_ms, 3),
                "a2a_bytes": rows.numel() * rows.element_size(),
                "exchanges_beside": busy,
                "compute_beside_nccl_ms": round(beside, 3),
                "nccl_alone_ms": round(busy * a2a_ms, 3),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
