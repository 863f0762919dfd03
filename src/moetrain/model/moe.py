"""The mixture-of-experts layer: route → dispatch → grouped experts → combine (+ shared expert).

Legend: B batch, T sequence, N = B·T tokens, D model dim, E experts.

Auxiliary losses (load balancing, z-loss) are not returned: `AttachAuxLoss` attaches them to the
layer's output with the LM loss's gradient factor (`ModelRuntime.backward_scale`), so they work
unchanged under gradient accumulation and pipeline parallelism, where a stage only returns
activations. Detached copies accumulate on the device, for the logs and the aux-free bias
(`update_bias`, called by an optimizer step post-hook; `end_step`).
"""

from __future__ import annotations

import torch
from torch import nn

from moetrain.model.config import MoEConfig
from moetrain.model.experts import GroupedExperts
from moetrain.model.mlp import SwiGLU
from moetrain.model.router import Router
from moetrain.model.runtime import ModelRuntime
from moetrain.model.token_dispatcher import LocalTokenDispatcher, TokenDispatcher


class MoE(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, runtime: ModelRuntime | None = None):
        super().__init__()
        self.cfg = cfg
        self.runtime = runtime or ModelRuntime()
        self.router = Router(d_model, cfg)
        self.experts = GroupedExperts(cfg.num_experts, d_model, cfg.expert_hidden, runtime=self.runtime)
        self.shared_expert = SwiGLU(d_model, cfg.shared_hidden) if cfg.shared_hidden > 0 else None
        self.dispatcher: TokenDispatcher = LocalTokenDispatcher(cfg.num_experts)
        # Per-optimizer-step accumulators, this module's only own buffers (`end_step` resets them
        # all; not checkpointed).
        E = cfg.num_experts
        self.register_buffer("step_tokens_per_expert_E", torch.zeros(E, dtype=torch.int64), persistent=False)
        self.register_buffer("step_lb_loss", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("step_z_loss", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("step_dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("step_calls", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        route = self.router(x_ND, self.dispatcher.reduce_counts)

        y_ND = self.dispatcher.expert_step(x_ND, route, self.experts, self.shared_expert)

        aux_loss = self.cfg.lb_loss_weight * route.lb_loss + self.cfg.z_loss_weight * route.z_loss
        if self.training and aux_loss.requires_grad:
            y_ND = AttachAuxLoss.apply(y_ND, aux_loss, self.runtime.backward_scale)
        if self.training and not self.runtime.recomputing:  # once: not again when recompute re-runs this
            self._accumulate(route, self.dispatcher.dropped_tokens())
        return y_ND.view(B, T, D)

    @torch.no_grad()
    def _accumulate(self, route, dropped: torch.Tensor | None) -> None:
        self.step_tokens_per_expert_E += route.global_tokens_per_expert_E
        self.step_lb_loss += route.lb_loss.detach()
        self.step_z_loss += route.z_loss.detach()
        self.step_calls += 1
        if dropped is not None:
            self.step_dropped += dropped

    @torch.no_grad()
    def update_bias(self, skip: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing after an optimizer step: move the router's selection bias
        towards uniform load by the step's global token counts. A skipped step (`skip` true; see
        src/moetrain/train/guard.py) moves nothing: rate × 0. No-op when bias_update_rate is 0."""
        if self.cfg.bias_update_rate > 0:
            rate = self.cfg.bias_update_rate if skip is None else self.cfg.bias_update_rate * (~skip).float()
            update_expert_bias(self.router.expert_bias_E, self.step_tokens_per_expert_E, rate)

    @torch.no_grad()
    def end_step(self) -> dict[str, torch.Tensor]:
        """Close an optimizer step: return this step's routing statistics (device tensors; token
        counts over the global batch, losses averaged over micro-batches) and reset the
        accumulators."""
        calls = self.step_calls.clamp(min=1)
        stats = {
            "tokens_per_expert": self.step_tokens_per_expert_E.clone(),
            "lb_loss": self.step_lb_loss / calls,
            "z_loss": self.step_z_loss / calls,
            "dropped": self.step_dropped.clone(),
        }
        for buf in self.buffers(recurse=False):
            buf.zero_()
        return stats


def update_expert_bias(bias_E: torch.Tensor, tokens_per_expert_E: torch.Tensor, rate: float | torch.Tensor) -> None:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower it for over-loaded
    ones, by `rate` each (the sign of the load error), in place and outside autograd."""
    load_E = tokens_per_expert_E.float()
    bias_E += rate * torch.sign(load_E.mean() - load_E)


class AttachAuxLoss(torch.autograd.Function):
    """Identity on `x` that makes `aux_loss` receive gradient `scale` during backward.

    The output is a copy, not a view of `x`: in a compiled block, a view's gradient would skip
    this backward (AOTAutograd rebuilds an output aliasing an intermediate outside the graph;
    tests/model/test_aux_loss_compiled.py). Inductor fuses the copy into the producing kernel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(aux_loss, ctx.scale), None
