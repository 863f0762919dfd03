"""Context-parallel attention against whole-sequence attention on one GPU: forward + backward
milliseconds and TFLOP/s (causal FLOPs: 4 · heads · head_dim · T²/2 forward, 2.5× that with the
backward) of

    whole      SDPA over the whole sequence, is_causal (what one GPU runs without cp)
    rank r     one cp rank's `ContextShard.attend` (src/moetrain/parallel/context_parallel.py): its two
               chunks against their key prefixes, the all-gather replaced by the whole
               sequence's keys and values laid out as the gather leaves them; and the same
               chunks through SDPA with `causal_lower_right` (its backend choice printed)
    cudnn      the whole sequence through SDPA's cuDNN backend, where it takes the shapes

    python benchmarks/probes/cp_attention_probe.py --seq 65536 --cp 4 --heads 8 --kv-heads 2

One JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_timing import timed  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from moetrain.parallel.context_parallel import ContextShard  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=65536)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    T, cp, H, G, Dh = args.seq, args.cp, args.heads, args.kv_heads, args.head_dim
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(1, H, T, Dh, device=dev, dtype=bf16, requires_grad=True)
    k = torch.randn(1, G, T, Dh, device=dev, dtype=bf16, requires_grad=True)
    v = torch.randn(1, G, T, Dh, device=dev, dtype=bf16, requires_grad=True)
    flops_whole = 4 * H * Dh * T * T / 2 * 3.5  # forward 1×, backward 2.5×

    def report(case: str, ms: float, flops: float) -> None:
        record = {"case": case, "seq": T, "ms": round(ms, 2), "tflops": round(flops / ms / 1e9, 1)}
        print(json.dumps(record), flush=True)

    def whole():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))

    report("whole", timed(whole, reps=5, warmup=2), flops_whole)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                kk, vv = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
                out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
                out.backward(torch.ones_like(out))

        report("cudnn (keys repeated to H heads)", timed(cudnn, reps=5, warmup=2), flops_whole)
    except RuntimeError as e:
        print(json.dumps({"case": "cudnn", "error": str(e)[:300]}), flush=True)
    t = T // cp
    L = t // 2
    for rank in (0, cp - 1):
        shard = ContextShard(cp, rank, None)
        c0, c1 = shard.chunks
        flops = 4 * H * Dh * L * ((c0 + 0.5) + (c1 + 0.5)) * L * 3.5
        q_local = shard.shard(q.detach().transpose(1, 2)).transpose(1, 2).contiguous().requires_grad_()
        kv = torch.stack([k.detach(), v.detach()]).contiguous().requires_grad_()  # as gather_kv returns
        shard.gather_kv = lambda a, b, kv=kv: (kv[0], kv[1])

        def attend(shard=shard, q_local=q_local):
            out = shard.attend(q_local, None, None, (None, None))
            out.backward(torch.ones_like(out))

        report(f"cp{cp} rank {rank}: ContextShard.attend", timed(attend, reps=5, warmup=2), flops)

        def causal_bias(shard=shard, q_local=q_local, kv=kv):
            outs = []
            for j, c in enumerate(shard.chunks):
                S = (c + 1) * L
                qq = q_local[:, :, j * L : (j + 1) * L]
                bias = causal_lower_right(L, S)
                outs.append(
                    F.scaled_dot_product_attention(
                        qq, kv[0][:, :, :S], kv[1][:, :, :S], attn_mask=bias, enable_gqa=True
                    )
                )
            out = torch.cat(outs, dim=2)
            out.backward(torch.ones_like(out))

        report(f"cp{cp} rank {rank}: SDPA with causal_lower_right", timed(causal_bias, reps=5, warmup=2), flops)
        from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

        S = (c1 + 1) * L
        params = SDPAParams(q_local[:, :, L:], kv[0][:, :, :S], kv[1][:, :, :S], None, 0.0, False, True)
        print(
            "chunk",
            c1,
            "can_use_flash:",
            can_use_flash_attention(params, True),
            "can_use_efficient:",
            can_use_efficient_attention(params, True),
            flush=True,
        )


if __name__ == "__main__":
    main()
