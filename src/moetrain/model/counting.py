"""Parameter and FLOP counts, computed from the config alone (no model is built, so the
trillion-parameter presets count instantly).

FLOPs follow Olmo-core's formula so figures compare directly:
    flops_per_token = 6 × active non-embedding parameters      (LM head included)
                    + 12 × layers × heads × head_dim × seq_len  (attention scores and values)
The attention term counts the full T×T score matrix; a causal-aware count halves it
(`causal_halved=True`). MFU is always reported with the full (Olmo-core's) count.
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
    D, hd, moe = cfg.d_model, cfg.resolved_head_dim, cfg.moe
    attn = D * cfg.n_heads * hd * 2 + D * cfg.n_kv_heads * hd * 2
    if cfg.qk_norm:
        attn += 2 * hd
    norms = D * (4 if cfg.peri_norm else 2)
    dense_block = attn + norms + 3 * D * cfg.resolved_dense_hidden
    expert = 3 * D * moe.expert_hidden
    shared = 3 * D * moe.shared_hidden
    router = moe.num_experts * D
    moe_block_total = attn + norms + router + shared + moe.num_experts * expert
    moe_block_active = attn + norms + router + shared + moe.top_k * expert
    embedding = cfg.vocab_size * D
    outside = embedding + D + cfg.vocab_size * D  # embedding, final norm, LM head
    n_dense, n_moe = cfg.num_dense_layers, cfg.num_moe_layers
    total = outside + n_dense * dense_block + n_moe * moe_block_total
    active = outside + n_dense * dense_block + n_moe * moe_block_active
    return ParamCounts(total=total, active=active, embedding=embedding)


def flops_per_token(cfg: TransformerConfig, seq_len: int, causal_halved: bool = False, attention: bool = True) -> int:
    """Training FLOPs (forward + backward) per token, Olmo-core's formula (`attention=False`:
    without its attention term)."""
    counts = count_params(cfg)
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len if attention else 0
    if causal_halved:
        attention //= 2
    return 6 * (counts.active - counts.embedding) + attention


# Dense BF16 tensor-core peaks (FLOP/s, no sparsity) for MFU. Matched by substring of the CUDA
# device name, first match wins.
PEAK_BF16_FLOPS = {
    "H200": 989.4e12,
    "H100": 989.4e12,
    "GH200": 989.4e12,
    "H800": 989.4e12,
    "H20": 148e12,
    "B300": 2250e12,
    "B200": 2250e12,
    "GB200": 2500e12,
    "A100": 312e12,
    "A800": 312e12,
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
