"""Multi-head latent attention (MLA, `model.attention=mla`), DeepSeek-V2/V3's: queries and
keys/values pass through low-rank latents, each normalized, and a narrow rotary part of every
query head meets one rotary key shared by all heads.

Legend: B batch, T positions, S positions a cache holds, D model dim, H heads, Q query latent
(model.q_lora_rank), C key/value latent (model.kv_lora_rank), N a head's part without position
(model.qk_nope_head_dim), R its rotary part (model.qk_rope_head_dim), K = N + R a query/key
head, V a value head (model.v_head_dim).

    q_BTHK   = wq_b(RMSNorm(wq_a(x)))  (or wq(x) with q_lora_rank 0) → [q_nope N | q_rope R]
    [c | kr] = wkv_a(x)                c_BTC the latent, kr_BTR the shared rotary key
    [k_nope N | v V] per head = wkv_b(RMSNorm(c))
    k_BHTK   = [k_nope | RoPE(kr) on every head],  q_rope → RoPE(q_rope)
    out      = wo(softmax(q·kᵀ / √K) v)            causal, through the model's SequenceLayout

Training runs this unabsorbed form: the latents are expanded to per-head keys and values and
attention is ordinary multi-head SDPA, since absorbing W_uk and W_uv would cost about 3× the
attention's FLOPs (docs/architecture.md, "Multi-head latent attention"). Absorption pays in
generation, where each new query meets S cached positions: the cache holds only [c | kr] (C + R
numbers per position and layer, `LatentCache` in src/moetrain/model/kv_cache.py) and `decode`
attends over them absorbed.

FlashAttention reads one head dim for q, k and v; MLA's values are narrower (V < K). Where SDPA
would otherwise leave flash for the memory-efficient kernel, the values are zero-padded to K and
the output's extra columns sliced off (`flash_pads_values`): the same attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.config import TransformerConfig
from moetrain.model.counting import flash_pads_widths
from moetrain.model.kv_cache import LatentCache
from moetrain.model.norm import RMSNorm
from moetrain.model.rope import apply_rope, softmax_factor
from moetrain.model.sequence_layout import SequenceLayout, WholeSequence


class LatentAttention(nn.Module):
    """MLA with the names of DeepSeek's reference model (wq_a, q_norm, wq_b or wq; wkv_a, kv_norm,
    wkv_b; wo). `window`: a sliding window in positions (0: global; src/moetrain/model/local_attention.py)."""

    def __init__(self, cfg: TransformerConfig, window: int = 0):
        super().__init__()
        D, H, Q, C = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        N, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.n_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = H, N, R, V, C
        self.window = window
        # The query latent (model.q_lora_rank > 0), or one projection from x.
        self.wq_a = nn.Linear(D, Q, bias=False) if Q else None
        self.q_norm = RMSNorm(Q, cfg.norm_eps) if Q else None
        self.wq_b = nn.Linear(Q, H * (N + R), bias=False) if Q else None
        self.wq = None if Q else nn.Linear(D, H * (N + R), bias=False)
        self.wkv_a = nn.Linear(D, C + R, bias=False)
        self.kv_norm = RMSNorm(C, cfg.norm_eps)
        self.wkv_b = nn.Linear(C, H * (N + V), bias=False)
        self.wo = nn.Linear(H * V, D, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H)) if cfg.attention_sinks else None
        """model.attention_sinks: one logit per head (src/moetrain/model/sinks.py)."""
        self.q_scale = softmax_factor(cfg.rope_scaling)
        """YaRN's factor of the softmax scale (DeepSeek-V3's mscale_all_dim), taken into the query."""
        self.sequence: SequenceLayout = WholeSequence()
        """Where the sequence's positions live (src/moetrain/model/sequence_layout.py)."""

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_TR: torch.Tensor,
        sin_TR: torch.Tensor,
        masks: object = None,
        cache: LatentCache | None = None,
    ) -> torch.Tensor:
        """As `Attention.forward` (src/moetrain/model/attention.py): with `cache` (generation) the
        T positions continue those it holds, attended in the absorbed form (module docstring)."""
        B, T, _ = x_BTD.shape
        H, N, R, V, C = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank
        q_BTHK = self.wq(x_BTD) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x_BTD)))
        q_BTHK = q_BTHK * self.q_scale if self.q_scale != 1 else q_BTHK
        q_nope_BHTN, q_rope_BHTR = q_BTHK.view(B, T, H, N + R).transpose(1, 2).split([N, R], dim=-1)
        q_rope_BHTR = apply_rope(q_rope_BHTR, cos_TR, sin_TR)
        c_BTC, k_rope_BTR = self.wkv_a(x_BTD).split([C, R], dim=-1)
        c_BTC = self.kv_norm(c_BTC)
        k_rope_B1TR = apply_rope(k_rope_BTR.unsqueeze(1), cos_TR, sin_TR)
        if cache is not None:
            o_BHTV = self._absorbed(q_nope_BHTN, q_rope_BHTR, c_BTC, k_rope_B1TR, cache)
        else:
            kv_BHTX = self.wkv_b(c_BTC).view(B, T, H, N + V).transpose(1, 2)
            k_nope_BHTN, v_BHTV = kv_BHTX.split([N, V], dim=-1)
            q_BHTK = torch.cat([q_nope_BHTN, q_rope_BHTR], dim=-1)
            k_BHTK = torch.cat([k_nope_BHTN, k_rope_B1TR.expand(B, H, T, R)], dim=-1)
            o_BHTV = self._attend(q_BHTK, k_BHTK, v_BHTV, masks)
        return self.wo(o_BHTV.transpose(1, 2).reshape(B, T, H * V))

    def _attend(self, q_BHTK, k_BHTK, v_BHTV, masks) -> torch.Tensor:
        """Causal attention through the sequence layout (scale 1/√K, SDPA's default for q's
        width), the values padded to K where FlashAttention needs it (module docstring)."""
        V = v_BHTV.shape[-1]
        if flash_pads_values(q_BHTK, v_BHTV):
            v_BHTK = F.pad(v_BHTV, (0, q_BHTK.shape[-1] - V))
            return self.sequence.attend(q_BHTK, k_BHTK, v_BHTK, masks, self.window, self.sinks)[..., :V]
        return self.sequence.attend(q_BHTK, k_BHTK, v_BHTV, masks, self.window, self.sinks)

    def _absorbed(self, q_nope_BHTN, q_rope_BHTR, c_BTC, k_rope_B1TR, cache: LatentCache) -> torch.Tensor:
        """Attention over the cached latents: q_nope·W_uk joins the query as a C-wide latent
        query, the scores are over [c | kr] (one head all heads share), the output's latent goes
        through W_uv; the same products as the unabsorbed form, regrouped."""
        H, N, C = self.n_heads, self.nope_dim, self.kv_rank
        w_HXC = self.wkv_b.weight.to(q_nope_BHTN.dtype).view(H, -1, C)
        w_uk_HNC, w_uv_HVC = w_HXC[:, :N], w_HXC[:, N:]
        q_lat_BHTC = torch.einsum("bhtn,hnc->bhtc", q_nope_BHTN, w_uk_HNC)
        kv_BTX = torch.cat([c_BTC, k_rope_B1TR.squeeze(1)], dim=-1)
        scale = (N + self.rope_dim) ** -0.5
        o_lat_BHTC = cache.attend(torch.cat([q_lat_BHTC, q_rope_BHTR], dim=-1), kv_BTX, self.window, scale, self.sinks)
        return torch.einsum("bhtc,hvc->bhtv", o_lat_BHTC, w_uv_HVC)


def flash_pads_values(q_BHTK: torch.Tensor, v_BHTV: torch.Tensor) -> bool:
    """Whether the values are zero-padded to the query/key width before attention: on CUDA in
    bf16/fp16 where FlashAttention takes the head dim (a multiple of 8, at most 256) but not the
    narrower values (its kernels read one head dim for q, k and v)."""
    half = q_BHTK.dtype in (torch.bfloat16, torch.float16)
    return q_BHTK.is_cuda and half and flash_pads_widths(q_BHTK.shape[-1], v_BHTV.shape[-1])
