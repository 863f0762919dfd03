"""Local (sliding-window) attention: in the blocks `model.attention_pattern` makes local, the query
at position i attends to the keys at positions i − w + 1 … i (w = `model.sliding_window`).

Legend: B batch, T query positions, S key positions, H query heads, G key/value heads, Dh head dim.

Two paths, the same function up to the kernels' rounding: `_LocalFlash` (CUDA, bf16/fp16, head
dim a multiple of 8 up to 256, no document mask or sinks), FlashAttention-2's own window, which
skips the key blocks wholly outside it, so a local block costs time in proportion to T·w, not
T²/2; everywhere else `window_mask`, a boolean mask for SDPA, which computes every score.
"""

from __future__ import annotations

import torch

from moetrain.model.sinks import sdpa


def window_mask(q_pos_T: torch.Tensor, k_pos_S: torch.Tensor, window: int) -> torch.Tensor:
    """(T, S) bool: query position q sees key position k when q − window < k ≤ q."""
    d_TS = q_pos_T.unsqueeze(1) - k_pos_S.unsqueeze(0)
    return (d_TS >= 0) & (d_TS < window)


def local_attention(
    q_BHTD: torch.Tensor,
    k_BGTD: torch.Tensor,
    v_BGTD: torch.Tensor,
    window: int,
    mask_BTT: torch.Tensor | None,
    sink_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention within `window` positions (B, H, T, Dh); `mask_BTT`: the document mask
    (which contains causality), or None; `sink_H`: attention sinks (src/moetrain/model/sinks.py)."""
    Dh, T = q_BHTD.shape[-1], q_BHTD.shape[2]
    flash = q_BHTD.is_cuda and q_BHTD.dtype in (torch.bfloat16, torch.float16) and Dh % 8 == 0 and Dh <= 256
    if mask_BTT is None and sink_H is None and flash:
        o_BTHD = _LocalFlash.apply(q_BHTD.transpose(1, 2), k_BGTD.transpose(1, 2), v_BGTD.transpose(1, 2), window)
        return o_BTHD.transpose(1, 2)
    pos_T = torch.arange(T, device=q_BHTD.device)
    local_TT = window_mask(pos_T, pos_T, window)
    mask = local_TT if mask_BTT is None else (mask_BTT & local_TT).unsqueeze(1)
    return sdpa(q_BHTD, k_BGTD, v_BGTD, mask, sink_H=sink_H)


class _LocalFlash(torch.autograd.Function):
    """FlashAttention-2 with a causal window, forward and backward (its grouped-query heads as
    they are: G key/value heads serve H query heads)."""

    @staticmethod
    def forward(ctx, q_BTHD, k_BTGD, v_BTGD, window):
        B, T, H, Dh = q_BTHD.shape
        cu_B1 = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q_BTHD.device)
        q, k, v = (t.reshape(B * T, t.shape[2], Dh).contiguous() for t in (q_BTHD, k_BTGD, v_BTGD))
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_B1, cu_B1, T, T, 0.0, True, False, window_size_left=window - 1, window_size_right=0
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_B1, rng, unused)
        ctx.window, ctx.T = window, T
        return out.view(B, T, H, Dh)

    @staticmethod
    def backward(ctx, grad_BTHD):
        q, k, v, out, lse, cu_B1, rng, unused = ctx.saved_tensors
        T, (B, _, H, Dh) = ctx.T, grad_BTHD.shape
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_BTHD.reshape(B * T, H, Dh).contiguous(), q, k, v, out, lse, cu_B1, cu_B1, T, T, 0.0, True, rng,
            unused, window_size_left=ctx.window - 1, window_size_right=0,
        )  # fmt: skip
        G = k.shape[1]
        return dq.view(B, T, H, Dh), dk.view(B, T, G, Dh), dv.view(B, T, G, Dh), None
