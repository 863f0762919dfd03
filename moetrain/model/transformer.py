"""The decoder-only transformer: embedding → blocks → final norm → untied LM head.

Legend: B batch, T sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moetrain.model.block import Block
from moetrain.model.config import TransformerConfig
from moetrain.model.experts import GroupedExperts
from moetrain.model.moe import MoE
from moetrain.model.norm import RMSNorm
from moetrain.model.rope import RotaryEmbedding


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.resolved_head_dim, cfg.rope_theta)
        # A ModuleDict keyed by layer index keeps parameter names stable when a pipeline stage
        # holds only some of the blocks.
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V). With `doc_ids_BT`, tokens attend only within their document."""
        T = tokens_BT.shape[1]
        cos_TD, sin_TD = self.rope.cos_sin(T)
        mask_BTT = None
        if doc_ids_BT is not None:
            causal_TT = torch.ones(T, T, dtype=torch.bool, device=tokens_BT.device).tril()
            mask_BTT = (doc_ids_BT.unsqueeze(2) == doc_ids_BT.unsqueeze(1)) & causal_TT
        x_BTD = self.embed(tokens_BT)
        for block in self.blocks.values():
            x_BTD = block(x_BTD, cos_TD, sin_TD, mask_BTT)
        return self.lm_head(self.norm(x_BTD))

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialize every parameter and buffer (also after building on the meta device and
        `to_empty()`). Truncated normal(0, init_std) for inputs, init_std / sqrt(2·layers) for
        output projections (attention out, MLP/expert down) so the residual stream's variance
        does not grow with depth; norms at 1; aux-free biases at 0."""
        if seed is not None:
            torch.manual_seed(seed)
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)

        def normal_(w: torch.Tensor, s: float) -> None:
            nn.init.trunc_normal_(w, mean=0.0, std=s, a=-3 * s, b=3 * s)

        for name, module in self.named_modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding)):
                module.init_weights()
            elif isinstance(module, nn.Embedding):
                normal_(module.weight, std)
            elif isinstance(module, nn.Linear):
                is_output = name.endswith(("attn.wo", "w_down"))
                normal_(module.weight, out_std if is_output else std)
            elif isinstance(module, GroupedExperts):
                normal_(module.w_gate_up_E2FD, std)
                normal_(module.w_down_EDF, out_std)
            elif isinstance(module, MoE):
                normal_(module.router.weight, std)
                module.router.expert_bias_E.zero_()
                for buf in module.buffers(recurse=False):
                    buf.zero_()
