"""Grouped-query attention with per-head QK-norm and RoPE, through PyTorch SDPA, global or within a
sliding window (src/moetrain/model/local_attention.py), with attention sinks where the config
asks (src/moetrain/model/sinks.py).

Legend: B batch, T sequence, D model dim, H query heads, G key/value heads, Dh head dim.
"""

import torch
from torch import nn

from moetrain.model.config import TransformerConfig
from moetrain.model.kv_cache import LayerCache
from moetrain.model.norm import RMSNorm
from moetrain.model.rope import apply_rope
from moetrain.model.sequence_layout import SequenceLayout, WholeSequence


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig, window: int = 0):
        super().__init__()
        d_model, n_heads, n_kv_heads, head_dim = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.window = window
        """Sliding window in positions (0: global attention; src/moetrain/model/local_attention.py)."""
        self.wq = nn.Linear(d_model, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(d_model, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, d_model, bias=False)
        # Per-head norm (one weight of size Dh shared by all heads), as Qwen3 does.
        self.q_norm = RMSNorm(head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if cfg.attention_sinks else None
        """model.attention_sinks: one logit per query head (src/moetrain/model/sinks.py)."""
        self.sequence: SequenceLayout = WholeSequence()
        """Where the sequence's positions live: x holds this rank's, `attend` sees them all
        (src/moetrain/model/sequence_layout.py; context parallelism sets another)."""

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_TD: torch.Tensor,
        sin_TD: torch.Tensor,
        masks: object = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """With `cache` (generation), the T positions continue those the cache holds: their keys
        and values join it and the queries attend over all of them; `cos_TD`/`sin_TD` are then
        the new positions' and `masks` is unused."""
        B, T, _ = x_BTD.shape
        q_BTHD = self.wq(x_BTD).view(B, T, self.n_heads, self.head_dim)
        k_BTGD = self.wk(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        v_BTGD = self.wv(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BTHD, k_BTGD = self.q_norm(q_BTHD), self.k_norm(k_BTGD)
        q_BHTD = apply_rope(q_BTHD.transpose(1, 2), cos_TD, sin_TD)
        k_BGTD = apply_rope(k_BTGD.transpose(1, 2), cos_TD, sin_TD)
        v_BGTD = v_BTGD.transpose(1, 2)
        if cache is None:
            o_BHTD = self.sequence.attend(q_BHTD, k_BGTD, v_BGTD, masks, self.window, self.sinks)
        else:
            o_BHTD = cache.attend(q_BHTD, k_BGTD, v_BGTD, self.window, self.sinks)
        return self.wo(o_BHTD.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
