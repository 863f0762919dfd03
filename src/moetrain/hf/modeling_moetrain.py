"""moetrain's decoder-only mixture-of-experts transformer as a transformers model, for
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`.

`moetrain export-hf --remote-code` copies this file beside the weights of a model that no native
transformers class represents exactly (softmax routing with a shared expert, peri-norm, a
non-zero aux-loss-free bias under softmax, no QK-norm under softmax): it needs only torch and
transformers, and computes what src/moetrain/model/ computes, parameter names included:

    embed [→ × √d_model → RMSNorm] → blocks ([RMSNorm] → GQA attention with per-head QK-norm,
    rotate-half RoPE [and attention sinks] → [RMSNorm] → residual; [RMSNorm] → SwiGLU or MoE →
    [RMSNorm] → residual) → RMSNorm → LM head

MoE: fp32 router logits; softmax or sigmoid scores; the top-k of scores + the selection bias;
the chosen scores as weights, normalized to sum to one and × k where the config says so; each
routed expert a SwiGLU; the shared expert's output added. Experts run one after another over the
tokens routed to them: slow for large models, exact for every one. No KV cache: generation
recomputes the whole sequence at every step (`use_cache` is false).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

CONFIG_DEFAULTS = {
    "vocab_size": 8192,
    "d_model": 128,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "head_dim": 32,
    "num_dense_layers": 0,
    "dense_hidden": 512,
    "qk_norm": True,
    "pre_norm": True,
    "peri_norm": False,
    "embedding_norm": False,
    "sliding_window": 0,
    "attention_pattern": "",
    "attention_sinks": False,
    "norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "expert_hidden": 128,
    "shared_hidden": 0,
    "gating": "softmax",
    "normalize_weights": True,
    "restore_weight_scale": False,
    "max_position_embeddings": 4096,
}
"""MoetrainConfig's fields and their defaults: the names of model.* (config.json's keys)."""


class MoetrainConfig(PretrainedConfig):
    model_type = "moetrain"

    def __init__(self, **kwargs):
        for name, default in CONFIG_DEFAULTS.items():
            setattr(self, name, kwargs.pop(name, default))
        # the names transformers' generic code reads (k is num_experts_per_tok: `top_k` is a
        # generation setting there)
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = self.d_model, self.n_layers, self.n_heads
        self.num_key_value_heads = self.n_kv_heads
        kwargs.setdefault("use_cache", False)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Embedding(nn.Embedding):
    """The token embedding, RMS-normalized where the config says so (`embed.norm.weight`)."""

    def __init__(self, vocab_size: int, dim: int, norm: RMSNorm | None):
        super().__init__(vocab_size, dim)
        self.norm = norm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = super().forward(tokens)
        return x if self.norm is None else self.norm(x * self.embedding_dim**0.5)


def rope_tables(positions_BT: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, 1, T, Dh) in fp32 for each token's position."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions_BT.device)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    angles = positions_BT.float().unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
    return angles.cos(), angles.sin()


def apply_rope(x_BHTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x = x_BHTD.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x_BHTD.dtype)


class Attention(nn.Module):
    def __init__(self, c: MoetrainConfig, window: int):
        super().__init__()
        self.c, self.window = c, window
        self.wq = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(c.n_heads)) if c.attention_sinks else None

    def forward(self, x_BTD: torch.Tensor, cos, sin, mask_B1TT: torch.Tensor | None) -> torch.Tensor:
        c, (B, T, _) = self.c, x_BTD.shape
        q = self.wq(x_BTD).view(B, T, c.n_heads, c.head_dim)
        k = self.wk(x_BTD).view(B, T, c.n_kv_heads, c.head_dim)
        v = self.wv(x_BTD).view(B, T, c.n_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        groups = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.transpose(1, 2).repeat_interleave(groups, dim=1)
        if self.window:  # a local block: keys within `window` positions up to the query's
            d_TT = torch.arange(T, device=x_BTD.device).unsqueeze(1) - torch.arange(T, device=x_BTD.device)
            local_TT = (d_TT >= 0) & (d_TT < self.window)
            mask_B1TT = local_TT if mask_B1TT is None else mask_B1TT & local_TT
        if self.sinks is not None:  # gpt-oss's sinks: a logit per head joins the softmax and adds no value
            keep = mask_B1TT if mask_B1TT is not None else torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            scores = (q.float() @ k.float().transpose(-1, -2) * c.head_dim**-0.5).masked_fill(~keep, float("-inf"))
            sink = self.sinks.float().view(1, -1, 1, 1).expand(B, -1, T, 1)
            o = (torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1] @ v.float()).to(v.dtype)
        elif mask_B1TT is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TT)
        return self.wo(o.transpose(1, 2).reshape(B, T, c.n_heads * c.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Expert(nn.Module):
    """One routed expert: its gate and up projections stacked (2F, D), its down one (D, F)."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(2 * hidden, d_model))
        self.w_down = nn.Parameter(torch.empty(d_model, hidden))

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x_ND, self.w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down)


class Router(nn.Module):
    def __init__(self, c: MoetrainConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.d_model))
        self.register_buffer("expert_bias_E", torch.zeros(c.num_experts, dtype=torch.float32))


class MoE(nn.Module):
    def __init__(self, c: MoetrainConfig):
        super().__init__()
        self.c = c
        self.router = Router(c)
        self.experts = nn.ModuleList(Expert(c.d_model, c.expert_hidden) for _ in range(c.num_experts))
        self.shared_expert = SwiGLU(c.d_model, c.shared_hidden) if c.shared_hidden > 0 else None

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        c, (B, T, D) = self.c, x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        logits = F.linear(x_ND.float(), self.router.weight.float())
        scores = logits.softmax(dim=-1) if c.gating == "softmax" else logits.sigmoid()
        ids_NK = (scores + self.router.expert_bias_E).topk(c.num_experts_per_tok, dim=-1).indices
        weights_NK = scores.gather(-1, ids_NK)
        if c.normalize_weights:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        if c.restore_weight_scale:
            weights_NK = weights_NK * c.num_experts_per_tok
        y_ND = torch.zeros(B * T, D, dtype=torch.float32, device=x_ND.device)
        for e, expert in enumerate(self.experts):
            token, slot = (ids_NK == e).nonzero(as_tuple=True)
            if token.numel():
                out = expert(x_ND[token]).float() * weights_NK[token, slot].unsqueeze(-1)
                y_ND.index_add_(0, token, out)
        y_ND = y_ND.to(x_ND.dtype)
        if self.shared_expert is not None:
            y_ND = y_ND + self.shared_expert(x_ND)
        return y_ND.view(B, T, D)


class Block(nn.Module):
    def __init__(self, c: MoetrainConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps) if c.pre_norm else nn.Identity()
        pattern = c.attention_pattern or "L"
        self.attn = Attention(c, c.sliding_window if pattern[layer % len(pattern)] == "L" else 0)
        self.ffn_norm = RMSNorm(c.d_model, c.norm_eps) if c.pre_norm else nn.Identity()
        self.ffn = MoE(c) if layer >= c.num_dense_layers else SwiGLU(c.d_model, c.dense_hidden)
        self.attn_out_norm = RMSNorm(c.d_model, c.norm_eps) if c.peri_norm else None
        self.ffn_out_norm = RMSNorm(c.d_model, c.norm_eps) if c.peri_norm else None

    def forward(self, x: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        h = self.attn(self.attn_norm(x), cos, sin, mask)
        x = x + (self.attn_out_norm(h) if self.attn_out_norm is not None else h)
        h = self.ffn(self.ffn_norm(x))
        return x + (self.ffn_out_norm(h) if self.ffn_out_norm is not None else h)


class MoetrainForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MoetrainConfig
    base_model_prefix = "moetrain"
    _no_split_modules = ["Block"]
    _keep_in_fp32_modules_strict = ["router"]  # fp32 logits from fp32 weights: routing as trained

    def __init__(self, config: MoetrainConfig):
        super().__init__(config)
        c = config
        self.embed = Embedding(c.vocab_size, c.d_model, RMSNorm(c.d_model, c.norm_eps) if c.embedding_norm else None)
        self.blocks = nn.ModuleDict({str(i): Block(c, i) for i in range(c.n_layers)})
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Only for weights a checkpoint lacks (every export has them all)."""
        if isinstance(module, (nn.Linear, nn.Embedding, Expert, Router)):
            for weight in module.parameters(recurse=False):
                weight.data.normal_(0.0, 0.02)
        if isinstance(module, Router):
            module.expert_bias_E.data.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits (B, T, V) of every position; `attention_mask` (B, T) masks padding keys (and
        positions count from each row's first real token); `labels`: the mean next-token
        cross-entropy over the labels that are not -100."""
        B, T = input_ids.shape
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            keep = attention_mask.bool()
            causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()
            mask = ((causal & keep[:, None, :]) | torch.eye(T, dtype=torch.bool, device=input_ids.device)).unsqueeze(1)
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        c = self.config
        cos, sin = rope_tables(position_ids, c.head_dim, c.rope_theta)
        x = self.embed(input_ids)
        for block in self.blocks.values():
            x = block(x, cos, sin, mask)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)
