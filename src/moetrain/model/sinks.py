"""Attention through SDPA, with gpt-oss's attention sinks where given (`model.attention_sinks`).

Legend: B batch, T query positions, S key positions, H query heads, G key/value heads, Dh head dim.

A sink is one learned logit per query head, sink_h: the softmax over a query's keys gets one more
term e^{sink_h} in its denominator that adds nothing to the output,

    out = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^{sink_h}) = out_sdpa · sigmoid(lse − sink_h),

s_j the scaled scores, lse = log Σ_j e^{s_j}. SDPA computes it exactly, with its own kernels and
autograd, as one virtual key in front of the real ones: the heads widen by a column (then zeros to
a multiple of 8, for the fused kernels) holding sink_h / scale in the queries, 0 in the real keys
and 1 in the virtual key, whose value is 0. Any mask, window, cache offset and context-parallel
chunk works as it is (the mask gains a first column of True), on any device, with no backward of
its own. The cost on a GPU: no FlashAttention (it takes no mask), up to 8 more dims per head, and
a dense (T, S + 1) mask even for plain causal attention (a T² bias: 8 GiB in bf16 at 65,536
positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(
    q_BHTD: torch.Tensor,
    k_BGSD: torch.Tensor,
    v_BGSD: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    sink_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with grouped-query heads (`mask`: boolean, True attends;
    `causal`: SDPA's is_causal, aligned to the upper left) and, with `sink_H` (H,), a sink per
    query head (module docstring). Without sinks, SDPA exactly as called directly."""
    if sink_H is None:
        return F.scaled_dot_product_attention(
            q_BHTD, k_BGSD, v_BGSD, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    (B, H, T, Dh), (G, S) = q_BHTD.shape, k_BGSD.shape[1:3]
    scale = Dh**-0.5 if scale is None else scale
    if causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q_BHTD.device).tril()
    extra = 8 - Dh % 8  # the widened heads stay a multiple of 8 (SDPA's fused kernels)
    sink_BHT1 = (sink_H.to(q_BHTD.dtype) / scale).view(1, H, 1, 1).expand(B, H, T, 1)
    q_BHTW = torch.cat([q_BHTD, F.pad(sink_BHT1, (0, extra - 1))], dim=-1)
    virtual_BG1W = F.pad(torch.ones(B, G, 1, 1, dtype=k_BGSD.dtype, device=k_BGSD.device), (Dh, extra - 1))
    k_BGSW = torch.cat([virtual_BG1W, F.pad(k_BGSD, (0, extra))], dim=2)
    v_BGSD = F.pad(v_BGSD, (0, 0, 1, 0))
    mask = None if mask is None else F.pad(mask, (1, 0), value=True)
    return F.scaled_dot_product_attention(q_BHTW, k_BGSW, v_BGSD, attn_mask=mask, scale=scale, enable_gqa=True)
