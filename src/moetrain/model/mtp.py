"""Multi-token prediction (`model.mtp_depth`): DeepSeek-V3's sequential modules, each predicting
one token further ahead than the one before, sharing the model's embedding and LM head
(docs/architecture.md, "Multi-token prediction").

Legend: B batch, T sequence, D model dim, K = model.mtp_depth, λ = model.mtp_loss_weight.

    h⁰ = the main blocks' output (before the final norm)
    hᵏ_i = Blockₖ(Projₖ([RMSNorm(hᵏ⁻¹_i); RMSNorm(Embed(t_{i+k}))]))      Projₖ: 2D → D
    Lᵏ = mean over i < T − k of CE(LMHead(Norm(hᵏ_i)), t_{i+k+1})
    loss = L_main + λ/K · Σₖ Lᵏ

Every depth runs over all T positions, the token ids rolled by k (static shapes: compiled blocks,
pipeline buffers); the last k positions' predictions are left out of Lᵏ. Each module's block is
dense, so the expert machinery stays the main blocks'. `Transformer.forward` returns L_main, bit
for bit as without MTP: λ/K · Σₖ Lᵏ joins it in backward only (`AttachAuxLoss`, as the MoE
layers' auxiliary losses do).
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.model.block import Block
from moetrain.model.config import TransformerConfig
from moetrain.model.loss import lm_loss
from moetrain.model.moe import AttachAuxLoss
from moetrain.model.norm import RMSNorm
from moetrain.model.runtime import ModelRuntime


class MTPModule(nn.Module):
    """Depth k: norms of the two inputs, their projection, one dense block."""

    def __init__(self, cfg: TransformerConfig, depth: int):
        super().__init__()
        D = cfg.d_model
        self.depth = depth
        self.hidden_norm = RMSNorm(D, cfg.norm_eps)
        self.embed_norm = RMSNorm(D, cfg.norm_eps)
        self.proj = nn.Linear(2 * D, D, bias=False)
        self.block = Block(cfg, cfg.n_layers + depth - 1, dense=True)

    def forward(
        self, h_BTD: torch.Tensor, e_BTD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor, masks: object
    ) -> torch.Tensor:
        x_BTD = self.proj(torch.cat([self.hidden_norm(h_BTD), self.embed_norm(e_BTD)], dim=-1))
        return self.block(x_BTD, cos_TD, sin_TD, masks)


class MultiTokenPrediction(nn.Module):
    """The K modules and their loss (module docstring)."""

    def __init__(self, cfg: TransformerConfig, runtime: ModelRuntime | None = None):
        super().__init__()
        self.runtime = runtime or ModelRuntime()
        self.depths = nn.ModuleList([MTPModule(cfg, k) for k in range(1, cfg.mtp_depth + 1)])
        self.weight = cfg.mtp_loss_weight
        self._sums: torch.Tensor | None = None
        self._count = 0

    @staticmethod
    def shifted_embeddings(embed: nn.Embedding, tokens_BT: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Embed(t_{i+k}) for k = 1 … depth: the token ids rolled left by k (the last k wrap)."""
        return [embed(torch.roll(tokens_BT, -k, dims=1)) for k in range(1, depth + 1)]

    def loss(
        self,
        h_BTD: torch.Tensor,
        e_kBTD: list[torch.Tensor],
        targets_BT: torch.Tensor,
        norm: nn.Module,
        head: nn.Linear,
        attention: tuple[torch.Tensor, torch.Tensor, object],
        chunk_tokens: int,
    ) -> torch.Tensor:
        """λ/K · Σₖ Lᵏ (fp32 scalar) from the main blocks' output `h_BTD`, the shifted
        embeddings `e_kBTD` and the next-token `targets_BT` (t_{i+1} at i); records each Lᵏ.
        `attention`: the main blocks' (cos, sin, masks)."""
        T = h_BTD.shape[1]
        losses = []
        for module, e_BTD in zip(self.depths, e_kBTD):
            k = module.depth
            h_BTD = module(h_BTD, e_BTD, *attention)
            losses.append(lm_loss(head, norm(h_BTD[:, : T - k]), targets_BT[:, k:], chunk_tokens))
        losses_K = torch.stack(losses)
        detached_K = losses_K.detach().float()
        self._sums = detached_K if self._sums is None else self._sums + detached_K
        self._count += 1
        return self.weight * losses_K.mean()

    def attach(self, out: torch.Tensor, mtp_loss: torch.Tensor) -> torch.Tensor:
        """`out` unchanged, with `mtp_loss` receiving gradient `runtime.backward_scale` in backward."""
        return AttachAuxLoss.apply(out, mtp_loss, self.runtime.backward_scale)

    def end_step(self) -> torch.Tensor | None:
        """Each depth's Lᵏ averaged over the forwards since the last call (device tensor (K,)),
        None if there were none; then reset."""
        out = None if self._sums is None else self._sums / self._count
        self._sums, self._count = None, 0
        return out
