"""A transformer block: attention (grouped-query, or multi-head latent with model.attention=mla) and
an FFN (dense SwiGLU or MoE), each around a residual.

Pre-norm: x + f(norm(x)). Peri-norm (`peri_norm=True`, as Olmo-core's Tiny/Small references):
x + norm_out(f(norm_in(x))), which bounds what each sublayer adds to the residual stream. Without
the input norm (`pre_norm=False`, Olmo-core's moe_8l): x + norm_out(f(x)).
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.model.attention import Attention
from moetrain.model.config import TransformerConfig
from moetrain.model.kv_cache import LatentCache, LayerCache
from moetrain.model.mla import LatentAttention
from moetrain.model.mlp import SwiGLU
from moetrain.model.moe import MoE
from moetrain.model.norm import RMSNorm
from moetrain.model.runtime import ModelRuntime


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_id: int, dense: bool = False, runtime: ModelRuntime | None = None):
        """Block `layer_id`: MoE (reading the model's `runtime`) from model.num_dense_layers on,
        unless `dense` (the multi-token prediction modules' blocks, src/moetrain/model/mtp.py)."""
        super().__init__()
        self.layer_id = layer_id
        D = cfg.d_model
        self.attn_norm = RMSNorm(D, cfg.norm_eps) if cfg.pre_norm else nn.Identity()
        window = cfg.window_of(layer_id)
        self.attn: Attention | LatentAttention = (LatentAttention if cfg.is_mla else Attention)(cfg, window)
        self.ffn_norm = RMSNorm(D, cfg.norm_eps) if cfg.pre_norm else nn.Identity()
        self.is_moe = layer_id >= cfg.num_dense_layers and not dense
        self.ffn: nn.Module = MoE(D, cfg.moe, runtime) if self.is_moe else SwiGLU(D, cfg.resolved_dense_hidden)
        self.attn_out_norm = RMSNorm(D, cfg.norm_eps) if cfg.peri_norm else nn.Identity()
        self.ffn_out_norm = RMSNorm(D, cfg.norm_eps) if cfg.peri_norm else nn.Identity()

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_TD: torch.Tensor,
        sin_TD: torch.Tensor,
        masks: object = None,
        cache: LayerCache | LatentCache | None = None,
    ) -> torch.Tensor:
        """`masks`: the document masks of the model's `SequenceLayout.attention_inputs` (None:
        plain causal attention). `cache`: this layer's keys and values of earlier positions
        (generation; `Transformer.decode`)."""
        x_BTD = x_BTD + self.attn_out_norm(self.attn(self.attn_norm(x_BTD), cos_TD, sin_TD, masks, cache))
        return x_BTD + self.ffn_out_norm(self.ffn(self.ffn_norm(x_BTD)))
