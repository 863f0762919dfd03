"""Context parallelism (`parallel.cp`): each sequence split over cp ranks, attention over the
whole sequence through an all-gather of its keys and values (docs/architecture.md, "Context
parallelism").

Legend: B sequences, T sequence length, t = T / cp this rank's positions, L = T / (2·cp) one
chunk, H query heads, G key/value heads, Dh head dim (Dk keys, Dv values where they differ), X = Dk + Dv.

Sharding. A sequence is cut into 2·cp chunks of L positions; cp rank i holds chunks i and
2·cp − 1 − i, in that order (`ContextShard.shard`). Under causal attention the queries of chunk
c see the c + 1 chunks up to their own, so rank i's two chunks see (i + 1) + (2·cp − i) =
2·cp + 1 chunks of keys: every rank does the same attention work. Everything else in the model
treats each position by itself and runs unchanged on the t local positions.

Exchange. Each attention layer all-gathers its keys and values (side by side: one collective)
over the cp group; autograd's backward of the gather reduce-scatters their gradients. Each rank
then attends each of its two query chunks to the key prefix that chunk can see
(`prefix_attention`), causality aligned to the lower right, or with each chunk's document mask;
a local block (`model.sliding_window`) attends each chunk's queries to the keys of their window.

Not torch's `context_parallel` (ring attention): its SDPA path takes no mask and runs only CUDA
kernels, while gathering keys and values is cheap beside the queries' work under grouped-query
attention and any mask applies unchanged (docs/architecture.md, "Context parallelism"). MLA
gathers its expanded keys and values: its latents would be 1/71 of them at DeepSeek-V3's shape,
at the price of the expansion's products repeated on each rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from moetrain.model.local_attention import window_mask
from moetrain.model.rope import RotaryEmbedding
from moetrain.model.sinks import sdpa

_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
"""The autograd-aware all-gather (its backward reduce-scatters, summing); torch ≥ 2.13 renamed it."""

Masks = tuple[torch.Tensor | None, torch.Tensor | None]
"""Per local chunk: its (B, L, (c + 1)·L) document mask, or None for plain causal attention."""


class ContextShard:
    """Rank `rank` of a context-parallel group of `cp` ranks (`group`; None only when a test
    calls the pieces alone): which positions it holds and how its attention sees the rest. A
    `SequenceLayout` (src/moetrain/model/sequence_layout.py)."""

    def __init__(self, cp: int, rank: int, group: dist.ProcessGroup | None):
        self.cp, self.rank, self.group = cp, rank, group
        self.chunks = (rank, 2 * cp - 1 - rank)
        """The global indices of the two chunks this rank holds, in local order."""

    def shard(self, x_BT: torch.Tensor) -> torch.Tensor:
        """This rank's positions of `x_BT` (B, T, …): its two chunks along dim 1, concatenated."""
        L = x_BT.shape[1] // (2 * self.cp)
        return torch.cat([x_BT[:, c * L : (c + 1) * L] for c in self.chunks], dim=1)

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """The global positions (t,) of this rank's t local positions."""
        L = t // 2
        return torch.cat([torch.arange(c * L, (c + 1) * L, device=device) for c in self.chunks])

    def attention_inputs(
        self, rope: RotaryEmbedding, t: int, doc_ids_BT: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, Masks]:
        """RoPE's cos/sin at this rank's t positions (rows of the whole sequence's tables, so
        the values are the single-device ones) and, with `doc_ids_BT` (B, T: the whole
        sequences'), each local chunk's document mask."""
        T = t * self.cp
        cos_TD, sin_TD = rope.cos_sin(T)
        pos_t = self.positions(t, device)
        cos_tD, sin_tD = cos_TD[pos_t], sin_TD[pos_t]
        if doc_ids_BT is None:
            return cos_tD, sin_tD, (None, None)
        L = t // 2
        masks = []
        for c in self.chunks:
            # Query rows c·L … (c + 1)·L − 1 against keys 0 … (c + 1)·L − 1: same document, not later.
            same_BLS = doc_ids_BT[:, c * L : (c + 1) * L].unsqueeze(2) == doc_ids_BT[:, : (c + 1) * L].unsqueeze(1)
            causal_LS = torch.ones(L, (c + 1) * L, dtype=torch.bool, device=device).tril(diagonal=c * L)
            masks.append(same_BLS & causal_LS)
        return cos_tD, sin_tD, (masks[0], masks[1])

    def gather_kv(self, k_BGtD: torch.Tensor, v_BGtD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole sequence's keys and values (B, G, T, Dk and Dv, contiguous) in position
        order, from every rank's local ones: one all-gather (autograd: the backward
        reduce-scatters). The values may be narrower than the keys (multi-head latent attention)."""
        B, G, t, Dk = k_BGtD.shape
        L = t // 2
        kv_tBGX = torch.cat([k_BGtD, v_BGtD], dim=-1).permute(2, 0, 1, 3).contiguous()
        gathered = _all_gather(kv_tBGX, 0, self.group)  # (cp · t, B, G, Dk + Dv), rank-major
        # Rank r sent chunks r and 2·cp − 1 − r: the first halves in rank order, then the second
        # halves in reverse rank order, are the chunks in position order.
        halves = gathered.view(self.cp, 2, L, B, G, -1)
        kv_TBGX = torch.cat([halves[:, 0], halves[:, 1].flip(0)]).flatten(0, 1)
        k_BGTD, v_BGTD = kv_TBGX.permute(1, 2, 0, 3).split([Dk, v_BGtD.shape[-1]], dim=-1)
        return k_BGTD.contiguous(), v_BGTD.contiguous()

    def attend(
        self,
        q_BHtD: torch.Tensor,
        k_BGtD: torch.Tensor,
        v_BGtD: torch.Tensor,
        masks: Masks,
        window: int = 0,
        sink_H: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of this rank's queries over the whole sequence (module docstring); with
        `window`, each chunk's queries over the keys of their window alone. Each query meets
        all its keys in one call, so attention sinks (`sink_H`) apply there as on one device."""
        k_BGTD, v_BGTD = self.gather_kv(k_BGtD, v_BGtD)
        L = q_BHtD.shape[2] // 2
        outs = []
        for j, (c, mask_BLS) in enumerate(zip(self.chunks, masks)):
            S = (c + 1) * L
            q_BHLD = q_BHtD[:, :, j * L : (j + 1) * L]
            if window:
                outs.append(_window_attention(q_BHLD, k_BGTD, v_BGTD, c * L, window, mask_BLS, sink_H))
            else:
                outs.append(prefix_attention(q_BHLD, k_BGTD[:, :, :S], v_BGTD[:, :, :S], mask_BLS, sink_H))
        return torch.cat(outs, dim=2)


def _window_attention(q_BHLD, k_BGTD, v_BGTD, first: int, window: int, mask_BLS, sink_H) -> torch.Tensor:
    """The L queries at positions first … first + L − 1 over the keys of their windows (positions
    first − window + 1 … first + L − 1), within `mask_BLS` (document masks, whose keys start at 0)."""
    L = q_BHLD.shape[2]
    lo, hi = max(0, first - window + 1), first + L
    device = q_BHLD.device
    mask = window_mask(torch.arange(first, hi, device=device), torch.arange(lo, hi, device=device), window)
    if mask_BLS is not None:
        mask = (mask_BLS[:, :, lo:] & mask).unsqueeze(1)
    return sdpa(q_BHLD, k_BGTD[:, :, lo:hi], v_BGTD[:, :, lo:hi], mask, sink_H=sink_H)


def prefix_attention(
    q_BHLD: torch.Tensor,
    k_BGSD: torch.Tensor,
    v_BGSD: torch.Tensor,
    mask_BLS: torch.Tensor | None,
    sink_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of L queries, the last L positions of an S-position prefix, over that prefix:
    causal aligned to the lower right of the (L, S) scores, or `mask_BLS` (document masking,
    which contains causality). bf16/fp16 on CUDA runs FlashAttention-2 directly, whose causal
    flag means the lower-right alignment for L < S, on contiguous keys and values; elsewhere
    SDPA with `causal_lower_right`. With attention sinks (`sink_H`), SDPA with the boolean mask
    of the lower-right causality (src/moetrain/model/sinks.py)."""
    L, S = q_BHLD.shape[2], k_BGSD.shape[2]
    if mask_BLS is None and sink_H is not None:
        mask_BLS = torch.ones(1, L, S, dtype=torch.bool, device=q_BHLD.device).tril(S - L)
    if mask_BLS is not None:
        return sdpa(q_BHLD, k_BGSD, v_BGSD, mask_BLS.unsqueeze(1), sink_H=sink_H)
    Dh = q_BHLD.shape[-1]
    if q_BHLD.is_cuda and q_BHLD.dtype in (torch.bfloat16, torch.float16) and Dh % 8 == 0 and Dh <= 256:
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        return flash(q_BHLD, k_BGSD.contiguous(), v_BGSD.contiguous(), 0.0, is_causal=True)[0]
    return F.scaled_dot_product_attention(q_BHLD, k_BGSD, v_BGSD, attn_mask=causal_lower_right(L, S), enable_gqa=True)
