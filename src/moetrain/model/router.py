"""The router: scores every token against every expert and picks k of them (docs/architecture.md,
"Routing and the losses").

Legend: N tokens (batch × sequence), D model dim, E experts, K top-k; with group-limited routing
L expert groups of G experts each.

Routing statistics are the *global micro-batch's* (`reduce_counts` sums the tokens per expert
over data-parallel ranks), so the load-balancing loss and the aux-free bias do not depend on the
parallel layout. Everything stays on the device: no `.item()`, `.tolist()` or `.cpu()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.config import Gating, MoEConfig, Routing


class RouterOutput(NamedTuple):
    topk_ids_NK: torch.Tensor
    """Selected experts per token (int64)."""
    topk_weights_NK: torch.Tensor
    """Their combine weights (fp32, differentiable through the router)."""
    tokens_per_expert_E: torch.Tensor
    """Assignments each expert received from this rank's tokens (int64, no grad)."""
    global_tokens_per_expert_E: torch.Tensor
    """The same summed over the global micro-batch (all data-parallel ranks)."""
    lb_loss: torch.Tensor
    """Switch-style load-balancing loss (scalar, fp32; 1.0 at perfect balance for softmax)."""
    z_loss: torch.Tensor
    """Router z-loss: mean over tokens of logsumexp(logits)² (scalar, fp32)."""


class Router(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, d_model))
        # Aux-loss-free balancing (DeepSeek-V3): a bias added to the scores for *selection only*,
        # moved outside autograd after each optimizer step. Persistent: checkpoints carry it.
        self.register_buffer("expert_bias_E", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.routing = Routing(cfg.routing)
        """How experts are selected (model.moe.routing); `Transformer.set_routing` switches it."""

    def forward(
        self, x_ND: torch.Tensor, reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> RouterOutput:
        cfg = self.cfg
        # fp32 logits: bf16 would round near-tied scores and make selection noisy. Autocast would
        # run the linear in bf16 whatever its inputs, so it is switched off here.
        with torch.autocast(x_ND.device.type, enabled=False):
            logits_NE = F.linear(x_ND.float(), self.weight.float())
        scores_NE = logits_NE.softmax(dim=-1) if cfg.gating == Gating.softmax else logits_NE.sigmoid()

        with torch.no_grad():
            if self.routing == Routing.random:
                # Top-k of iid uniform noise: a uniformly random k-subset per token (within random
                # groups when the experts are grouped, as the dispatch of grouped routing is).
                choice_NE = torch.rand(logits_NE.shape, device=logits_NE.device)
            else:
                choice_NE = scores_NE + self.expert_bias_E
            if cfg.n_groups > 1:
                choice_NE = limit_to_groups(choice_NE, cfg.n_groups, cfg.topk_groups)
            topk_ids_NK = choice_NE.topk(cfg.top_k, dim=-1).indices
            tokens_per_expert_E = torch.zeros(cfg.num_experts, dtype=torch.int64, device=x_ND.device)
            tokens_per_expert_E.scatter_add_(0, topk_ids_NK.flatten(), torch.ones_like(topk_ids_NK.flatten()))
            global_counts_E = reduce_counts(tokens_per_expert_E) if reduce_counts else tokens_per_expert_E

        topk_weights_NK = scores_NE.gather(-1, topk_ids_NK)
        if cfg.normalize_weights:
            topk_weights_NK = topk_weights_NK / topk_weights_NK.sum(dim=-1, keepdim=True)
        if cfg.weight_scale != 1:
            topk_weights_NK = topk_weights_NK * cfg.weight_scale

        lb_loss = load_balancing_loss(scores_NE, global_counts_E, cfg.gating)
        z_loss = torch.logsumexp(logits_NE, dim=-1).square().mean()
        return RouterOutput(topk_ids_NK, topk_weights_NK, tokens_per_expert_E, global_counts_E, lb_loss, z_loss)


def limit_to_groups(choice_NE: torch.Tensor, num_groups: int, kept_groups: int) -> torch.Tensor:
    """DeepSeek-V3's group-limited routing (transformers' DeepseekV3TopkRouter): `choice_NE` with
    every expert outside each token's best `kept_groups` groups of G consecutive experts set to
    -inf, a group ranked by the sum of its two best scores. With parallel.ep dividing `num_groups`
    a group lies on one rank, so a token's dispatch reaches at most `kept_groups` ranks."""
    num_tokens, num_experts = choice_NE.shape
    choice_NLG = choice_NE.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores_NL = choice_NLG.topk(2, dim=-1).values.sum(dim=-1)
    kept_ids_NL = group_scores_NL.topk(kept_groups, dim=-1).indices
    kept_NL = torch.zeros_like(group_scores_NL, dtype=torch.bool).scatter_(1, kept_ids_NL, True)
    return choice_NLG.masked_fill(~kept_NL.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)


def load_balancing_loss(scores_NE: torch.Tensor, tokens_per_expert_E: torch.Tensor, gating: Gating) -> torch.Tensor:
    """Switch-Transformer loss for top-k, E · Σ_e f_e · P_e: f_e the share of the global
    micro-batch's assignments expert e got (no gradient), P_e its mean probability over this rank's
    tokens (sigmoid scores normalized per token first). Averaged over data-parallel ranks, as
    gradients are, this is the global micro-batch's loss."""
    num_experts = scores_NE.shape[-1]
    if gating == Gating.sigmoid:
        scores_NE = scores_NE / scores_NE.sum(dim=-1, keepdim=True)
    f_E = tokens_per_expert_E.float() / tokens_per_expert_E.sum().clamp(min=1)
    p_E = scores_NE.mean(dim=0)
    return num_experts * (f_E * p_E).sum()
