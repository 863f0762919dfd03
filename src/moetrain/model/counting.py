"""Parameter and FLOP counts of a config, from the shapes of the modules its model builds (the
multi-token-prediction modules included), without torch: `moetrain presets` and `params` answer
at once; tests/model/test_counting.py holds them equal to the built models.

FLOPs follow Olmo-core's formula, so that figures and MFU compare directly (docs/architecture.md,
"Counting and FLOPs"; `causal_halved` halves the attention term):
    flops_per_token = 6 × active non-embedding parameters      (LM head included)
                    + 12 × layers × heads × head_dim × seq_len  (attention scores and values)
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.model.config import TransformerConfig


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int
    """Parameters a token touches: everything but the routed experts it is not sent to."""
    embedding: int
    """Input embedding (excluded from FLOPs; the LM head is not excluded)."""


def count_params(cfg: TransformerConfig) -> ParamCounts:
    """The parameters of the modules src/moetrain/model/ builds for `cfg` (transformer.py, block.py,
    attention.py or mla.py, mlp.py, moe.py, router.py, experts.py, mtp.py)."""
    D, V, moe = cfg.d_model, cfg.vocab_size, cfg.moe
    block = attention_params(cfg) + 2 * D * (cfg.pre_norm + cfg.peri_norm)  # its norms
    dense_block = block + 3 * D * cfg.resolved_dense_hidden
    experts = moe.num_experts * 3 * D * moe.expert_hidden
    moe_block = block + moe.num_experts * D + experts + 3 * D * moe.shared_hidden
    mtp = cfg.mtp_depth * (2 * D + 2 * D * D + dense_block)  # two norms, the 2D → D projection, a dense block
    embedding = V * D + D * cfg.embedding_norm
    total = embedding + cfg.num_dense_layers * dense_block + cfg.num_moe_layers * moe_block + D + V * D + mtp
    idle = cfg.num_moe_layers * experts * (moe.num_experts - moe.top_k) // moe.num_experts
    return ParamCounts(total=total, active=total - idle, embedding=V * D)


def attention_params(cfg: TransformerConfig) -> int:
    """One block's attention: GQA's q, k, v, o (and QK-norm), or MLA's latents, their norms and
    expansions (src/moetrain/model/mla.py); and a sink per head (model.attention_sinks)."""
    D, H = cfg.d_model, cfg.n_heads
    sinks = H * cfg.attention_sinks
    if not cfg.is_mla:
        hd = cfg.resolved_head_dim
        return D * hd * (2 * H + 2 * cfg.n_kv_heads) + 2 * hd * cfg.qk_norm + sinks
    Q, C, K, V = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim
    queries = D * Q + Q + Q * H * K if Q else D * H * K
    keys_values = D * (C + cfg.qk_rope_head_dim) + C + C * H * (cfg.qk_nope_head_dim + V)
    return queries + keys_values + H * V * D + sinks


def flops_per_token(cfg: TransformerConfig, seq_len: int, causal_halved: bool = False, attention: bool = True) -> int:
    """Training FLOPs (forward + backward) per token, Olmo-core's formula (`attention=False`:
    without its attention term)."""
    counts = count_params(cfg)
    layers, mtp_heads = cfg.n_layers + cfg.mtp_depth, cfg.mtp_depth * cfg.vocab_size * cfg.d_model
    keys = sum(attended_keys(cfg, i, seq_len) for i in range(layers))
    attention = 6 * cfg.n_heads * (cfg.qk_head_dim + cfg.value_head_dim) * keys if attention else 0
    if causal_halved:
        attention //= 2
    return 6 * (counts.active - counts.embedding + mtp_heads) + attention


def attended_keys(cfg: TransformerConfig, layer: int, seq_len: int) -> int:
    """The keys per query the formula's attention term counts for block `layer`: seq_len (twice
    the causal mean, as Olmo-core counts), or for a local block twice the window's, at most that."""
    window = cfg.window_of(layer)
    return min(seq_len, 2 * window) if window else seq_len


# Dense BF16 tensor-core peaks (FLOP/s, no sparsity) for MFU. Matched by substring of the CUDA
# device name, first match wins.
PEAK_BF16_FLOPS = {
    **dict.fromkeys(["H200", "H100", "GH200", "H800"], 989.4e12),
    "H20": 148e12,
    **dict.fromkeys(["B300", "B200"], 2250e12),
    "GB200": 2500e12,
    **dict.fromkeys(["A100", "A800"], 312e12),
    "L40S": 362.05e12,
    "L4": 121e12,
    "A10G": 70e12,
    "RTX 4090": 165.2e12,
}


def peak_flops(device_name: str | None) -> float | None:
    """The device's dense BF16 peak, or None (CPU, unknown GPU): MFU is then reported as null."""
    if not device_name:
        return None
    for key, peak in sorted(PEAK_BF16_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in device_name:
            return peak
    return None
