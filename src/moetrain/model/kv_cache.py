"""The key/value cache of generation: each attention layer keeps the keys and values of the
positions it has seen, so that a new token costs one position's work instead of the whole
context's.

Legend: B batch, T new positions, S positions the cache can hold, H query heads, G key/value
heads, Dh head dim; multi-head latent attention's: C key/value latent, X = C + R its latent and
rotary key.

Inference only: training attends through its `SequenceLayout`, so its numerics do not depend on
this file. A context that outgrows the cache is the caller's to handle (src/moetrain/generation.py).
"""

from __future__ import annotations

import torch

from moetrain.model.config import TransformerConfig
from moetrain.model.local_attention import window_mask
from moetrain.model.sinks import sdpa


class LayerCache:
    """One attention layer's keys and values of positions 0 … `length` − 1, in buffers of S
    positions allocated once."""

    def __init__(self, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor):
        self.k_BGSD, self.v_BGSD = k_BGSD, v_BGSD
        self.length = 0
        """Positions held (the next new position's index)."""

    def attend(
        self,
        q_BHTD: torch.Tensor,
        k_BGTD: torch.Tensor,
        v_BGTD: torch.Tensor,
        window: int = 0,
        sink_H: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append the T new positions' keys and values, then causal attention (B, H, T, Dh) of
        their queries over every position held (with `window`, over the last `window` up to each;
        `sink_H`: attention sinks, src/moetrain/model/sinks.py)."""
        start, T = self.length, q_BHTD.shape[2]
        end = start + T
        assert end <= self.k_BGSD.shape[2], "KVCache overflow: the caller must start a new cache"
        self.k_BGSD[:, :, start:end] = k_BGTD
        self.v_BGSD[:, :, start:end] = v_BGTD
        self.length = end
        return attend_held(q_BHTD, self.k_BGSD[:, :, :end], self.v_BGSD[:, :, :end], start, window, sink_H=sink_H)


class LatentCache:
    """One multi-head latent attention layer's positions 0 … `length` − 1 (src/moetrain/model/mla.py):
    per position its normalized key/value latent and its rotary key, [c | kr] (C + R numbers),
    in a buffer of S positions allocated once. Its queries attend over them absorbed: keys
    [c | kr] and values c, one head all query heads share."""

    def __init__(self, kv_BSX: torch.Tensor, kv_rank: int):
        self.kv_BSX, self.kv_rank = kv_BSX, kv_rank
        self.length = 0
        """Positions held (the next new position's index)."""

    def attend(
        self, q_BHTX: torch.Tensor, kv_BTX: torch.Tensor, window: int, scale: float, sink_H: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Append the T new positions' [c | kr], then causal attention (B, H, T, C) of the latent
        queries `q_BHTX` ([q_nope·W_uk | RoPE(q_rope)]) over every position held, scores × `scale`."""
        start, T = self.length, q_BHTX.shape[2]
        end = start + T
        assert end <= self.kv_BSX.shape[1], "KVCache overflow: the caller must start a new cache"
        self.kv_BSX[:, start:end] = kv_BTX
        self.length = end
        k_B1SX = self.kv_BSX[:, None, :end]
        return attend_held(q_BHTX, k_B1SX, k_B1SX[..., : self.kv_rank], start, window, scale, sink_H)


def attend_held(
    q_BHTD: torch.Tensor,
    k_BGSD: torch.Tensor,
    v_BGSD: torch.Tensor,
    start: int,
    window: int = 0,
    scale: float | None = None,
    sink_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the T queries at positions start … start + T − 1 over the keys and
    values of positions 0 … start + T − 1 (with `window`, the last `window` up to each);
    `scale`: SDPA's (None: 1/√ of the queries' width); `sink_H`: attention sinks or None."""
    end, T = k_BGSD.shape[2], q_BHTD.shape[2]
    if not (window and end > window):  # the window reaches every position held
        if T == 1:  # one new position sees every position held: no mask
            return sdpa(q_BHTD, k_BGSD, v_BGSD, scale=scale, sink_H=sink_H)
        if start == 0:  # the prompt of an empty cache: plain causal attention
            return sdpa(q_BHTD, k_BGSD, v_BGSD, causal=True, scale=scale, sink_H=sink_H)
        window = end
    # New position start + t sees positions 0 … start + t within the window (SDPA's is_causal
    # would align the queries to the first keys, not to their own positions).
    pos_S = torch.arange(end, device=q_BHTD.device)
    return sdpa(q_BHTD, k_BGSD, v_BGSD, window_mask(pos_S[start:], pos_S, window), scale=scale, sink_H=sink_H)


class KVCache:
    """Every attention layer's `LayerCache`, for B sequences of up to `max_len` positions."""

    def __init__(
        self,
        cfg: TransformerConfig,
        max_len: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        G, Dh = cfg.n_kv_heads, cfg.resolved_head_dim
        self.max_len = max_len

        def layer() -> LayerCache | LatentCache:
            if cfg.is_mla:
                X = cfg.kv_lora_rank + cfg.qk_rope_head_dim
                return LatentCache(torch.zeros(batch, max_len, X, dtype=dtype, device=device), cfg.kv_lora_rank)
            return LayerCache(
                torch.zeros(batch, G, max_len, Dh, dtype=dtype, device=device),
                torch.zeros(batch, G, max_len, Dh, dtype=dtype, device=device),
            )

        self.layers = [layer() for _ in range(cfg.n_layers)]
        """Indexed by layer (the model's block keys)."""

    @property
    def length(self) -> int:
        """Positions held: every layer holds the same ones."""
        return self.layers[0].length
