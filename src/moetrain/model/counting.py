"""Parameter and FLOP counts of a config, counted on a meta-device build of its model (no memory
is allocated: the trillion-parameter presets count in a fraction of a second), so every module
the model has counts, the multi-token-prediction modules included.

FLOPs follow Olmo-core's formula so figures compare directly:
    flops_per_token = 6 × active non-embedding parameters      (LM head included)
                    + 12 × layers × heads × head_dim × seq_len  (attention scores and values)
The attention term counts the full T×T score matrix; a causal-aware count halves it
(`causal_halved=True`). MFU is always reported with the full (Olmo-core's) count. With
model.mtp_depth = K, each token also runs K more blocks and K more passes of the shared LM head
(src/moetrain/model/mtp.py): they count as layers and as active parameters K times more.
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


_COUNTED: dict[str, ParamCounts] = {}
"""Counts by the config's repr (the planner asks for one config's many times)."""


def count_params(cfg: TransformerConfig) -> ParamCounts:
    key = repr(cfg)
    if key not in _COUNTED:
        if len(_COUNTED) >= 64:
            _COUNTED.clear()
        _COUNTED[key] = _count(cfg)
    return _COUNTED[key]


def _count(cfg: TransformerConfig) -> ParamCounts:
    model = cfg.build(device="meta")
    total = sum(p.numel() for p in model.parameters())
    idle = 0  # each MoE layer's routed experts a token is not sent to
    for moe in model.moe_layers():
        per_expert = sum(p.numel() for p in moe.experts.parameters()) // moe.cfg.num_experts
        idle += (moe.cfg.num_experts - moe.cfg.top_k) * per_expert
    return ParamCounts(total=total, active=total - idle, embedding=model.embed.weight.numel())


def flops_per_token(cfg: TransformerConfig, seq_len: int, causal_halved: bool = False, attention: bool = True) -> int:
    """Training FLOPs (forward + backward) per token, Olmo-core's formula (`attention=False`:
    without its attention term)."""
    counts = count_params(cfg)
    layers, mtp_heads = cfg.n_layers + cfg.mtp_depth, cfg.mtp_depth * cfg.vocab_size * cfg.d_model
    attention = 12 * layers * cfg.n_heads * cfg.resolved_head_dim * seq_len if attention else 0
    if causal_halved:
        attention //= 2
    return 6 * (counts.active - counts.embedding + mtp_heads) + attention


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
