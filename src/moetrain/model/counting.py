"""What each component src/moetrain/model/ builds costs, declared once here, without torch (so
`moetrain presets` and `params` answer at once): parameters (tests/model/test_counting.py holds
each equal to its built module's), bytes saved for backward per token
(tests/test_plan_latent_attention.py measures attention's), FLOPs per token. The planner
(src/moetrain/plan/) sums what a block's components declare instead of reading their code.

FLOPs follow Olmo-core's formula, so that figures and MFU compare directly (docs/architecture.md,
"Counting and FLOPs"; `causal_halved` halves the attention term):
    flops_per_token = 6 × active non-embedding parameters      (LM head included)
                    + 12 × layers × heads × head_dim × seq_len  (attention scores and values)
"""

from __future__ import annotations

import dataclasses

from moetrain.model.config import MoEConfig, TransformerConfig


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int
    """Parameters a token touches: everything but the routed experts it is not sent to."""
    embedding: int
    """Input embedding (excluded from FLOPs; the LM head is not excluded)."""


def count_params(cfg: TransformerConfig) -> ParamCounts:
    """The parameters of the model `cfg` builds: the sum of its components'."""
    D, V, moe = cfg.d_model, cfg.vocab_size, cfg.moe
    embedding = embedding_params(cfg)
    blocks = cfg.num_dense_layers * block_params(cfg, False) + cfg.num_moe_layers * block_params(cfg, True)
    total = embedding + blocks + D + V * D + cfg.mtp_depth * mtp_module_params(cfg)  # D + V·D: final norm, head
    idle = cfg.num_moe_layers * experts_params(moe, D) * (moe.num_experts - moe.top_k) // moe.num_experts
    return ParamCounts(total=total, active=total - idle, embedding=V * D)


def embedding_params(cfg: TransformerConfig) -> int:
    """`Embedding`: its table and, with model.embedding_norm, its norm."""
    return cfg.vocab_size * cfg.d_model + cfg.d_model * cfg.embedding_norm


def block_params(cfg: TransformerConfig, moe_block: bool) -> int:
    """`Block`: its attention, its norms, and its MoE or dense MLP."""
    D = cfg.d_model
    ffn = moe_params(cfg.moe, D) if moe_block else swiglu_params(D, cfg.resolved_dense_hidden)
    return attention_params(cfg) + 2 * D * (cfg.pre_norm + cfg.peri_norm) + ffn


def attention_params(cfg: TransformerConfig) -> int:
    """`Attention`: GQA's q, k, v, o (and QK-norm), or `LatentAttention`: MLA's latents, their norms
    and expansions; and a sink per head (model.attention_sinks)."""
    norms = cfg.q_lora_rank + cfg.kv_lora_rank if cfg.is_mla else 2 * cfg.resolved_head_dim * cfg.qk_norm
    return sum(x.params for x in attention_matrices(cfg)) + norms + cfg.n_heads * cfg.attention_sinks


@dataclasses.dataclass(frozen=True)
class Matrix:
    """A kind of weight matrix in a block and the product a token's row makes with it,
    x (rows, d_in) · W (d_out, d_in)ᵀ: `copies` of that shape (either way round) in each block
    holding it. With `experts` > 0 an expert layer: each of E experts' gate and up (d_in → d_out,
    stacked as one (2·d_out, d_in) parameter) and down (d_out → d_in), grouped GEMMs over the
    token-expert assignments' rows. `fields`: the config fields that set d_in and d_out."""

    name: str
    copies: int
    d_in: int
    d_out: int
    fields: tuple[str, str]
    experts: int = 0

    @property
    def matrices(self) -> int:
        """The (d_in, d_out) matrices in a block: each expert's gate, up and down for an expert layer."""
        return self.copies * (3 * self.experts if self.experts else 1)

    @property
    def params(self) -> int:
        return self.matrices * self.d_in * self.d_out


def attention_matrices(cfg: TransformerConfig) -> list[Matrix]:
    """The linears of `Attention` (q and o, k and v) or of `LatentAttention` (each one apart)."""
    D, H, d = cfg.d_model, cfg.n_heads, "model.d_model"
    if not cfg.is_mla:
        hd = cfg.resolved_head_dim
        return [
            Matrix("attention q/o", 2, D, H * hd, (d, "model.n_heads × head_dim")),
            Matrix("attention k/v", 2, D, cfg.n_kv_heads * hd, (d, "model.n_kv_heads × head_dim")),
        ]
    Q, C, R, N, V = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    q, k = "model.q_lora_rank", "model.n_heads × (qk_nope_head_dim + qk_rope_head_dim)"
    c, nv = "model.kv_lora_rank", "model.n_heads × (qk_nope_head_dim + v_head_dim)"
    queries = [Matrix("attention wq_a", 1, D, Q, (d, q)), Matrix("attention wq_b", 1, Q, H * (N + R), (q, k))]
    return (queries if Q else [Matrix("attention wq", 1, D, H * (N + R), (d, k))]) + [
        Matrix("attention wkv_a", 1, D, C + R, (d, f"{c} + qk_rope_head_dim")),
        Matrix("attention wkv_b", 1, C, H * (N + V), (c, nv)),
        Matrix("attention wo", 1, H * V, D, ("model.n_heads × v_head_dim", d)),
    ]


def block_matrices(cfg: TransformerConfig, moe_block: bool) -> list[Matrix]:
    """The matrices of a `Block`: its attention's, and its dense MLP's (gate, up, down) or its MoE's
    routed and shared experts' (the router stays fp32 and out of Muon: not one of them)."""
    D, moe, d, S = cfg.d_model, cfg.moe, "model.d_model", cfg.moe.shared_hidden
    mlp = Matrix("dense MLP", 3, D, cfg.resolved_dense_hidden, (d, "model.dense_hidden"))
    experts = Matrix("experts", 1, D, moe.expert_hidden, (d, "model.moe.expert_hidden"), moe.num_experts)
    shared = [Matrix("shared expert", 3, D, S, (d, "model.moe.shared_hidden"))] * (S > 0)
    return attention_matrices(cfg) + ([experts, *shared] if moe_block else [mlp])


def mtp_matrices(cfg: TransformerConfig) -> list[Matrix]:
    """The matrices of an `MTPModule`: its 2D → D projection and its dense block's."""
    D, fields = cfg.d_model, ("2 × model.d_model", "model.d_model")
    return [Matrix("MTP projection", 1, 2 * D, D, fields), *block_matrices(cfg, False)]


def swiglu_params(d_model: int, hidden: int) -> int:
    """`SwiGLU` (a dense MLP, the shared expert): gate, up and down."""
    return 3 * d_model * hidden


def moe_params(moe: MoEConfig, d_model: int) -> int:
    """`MoE`: its router, its routed experts and its shared expert."""
    return moe.num_experts * d_model + experts_params(moe, d_model) + swiglu_params(d_model, moe.shared_hidden)


def experts_params(moe: MoEConfig, d_model: int) -> int:
    """`GroupedExperts`, all of them: each expert's gate, up and down."""
    return moe.num_experts * swiglu_params(d_model, moe.expert_hidden)


def mtp_module_params(cfg: TransformerConfig) -> int:
    """`MTPModule`: its two input norms, its 2D → D projection and its dense block."""
    D = cfg.d_model
    return 2 * D + 2 * D * D + block_params(cfg, False)


def flash_pads_widths(qk_head_dim: int, v_head_dim: int) -> bool:
    """Whether heads of these widths have their values padded in bf16/fp16 on CUDA
    (`mla.flash_pads_values`; `attention_saved_bytes` asks it of a config)."""
    return v_head_dim < qk_head_dim <= 256 and qk_head_dim % 8 == 0


def attention_saved_bytes(cfg: TransformerConfig, a: int, kv_copies: int, selective: bool) -> tuple[int, int]:
    """(Bytes a token's attention keeps for backward besides its input, the fp32 norm inputs an
    uncompiled one keeps too), at `a` bytes per matmul element. `kv_copies`: the keys and values
    held, cp + 1 under context parallelism (each chunk's key prefix). GQA: q, k, v and the SDPA
    output and log-sum-exp, and without selective recompute q and k before QK-norm. MLA: the
    latents (wq_a's and wkv_a's outputs), q, k and v as FlashAttention keeps them with its output
    and log-sum-exp (for selective recompute they stand for wq_b's and wkv_b's outputs), and
    without selective recompute the latent norms' outputs."""
    H, hd = cfg.n_heads, cfg.resolved_head_dim
    if not cfg.is_mla:
        q_k_v = a * (H + 2 * kv_copies * cfg.n_kv_heads) * hd
        attn_out = a * H * hd + 4 * H  # SDPA output + log-sum-exp
        q_k = (H + cfg.n_kv_heads) * hd  # before QK-norm
        return q_k_v + attn_out + (0 if selective else a * q_k), 4 * q_k
    Q, C, K, N, V = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    if a == 2 and flash_pads_widths(K, V):  # bf16: q, k, v padded to K, the padded output, wo's V-wide copy
        heads = H * K * (2 + 2 * kv_copies) + H * V
    elif kv_copies > 1:  # the gathered keys and values, the output (wo's input is a view of it)
        heads = H * K + kv_copies * H * (K + V) + H * V
    else:  # v, a view of wkv_b's output, keeps all of it: k_nope's part too
        heads = 2 * H * K + H * (N + V) + H * V
    kept = a * (Q + C + cfg.qk_rope_head_dim) + a * heads + 4 * H
    return kept + (0 if selective else a * (Q + C)), 4 * (Q + C)


def kv_elements(cfg: TransformerConfig) -> int:
    """One token's keys and values in one attention layer: GQA's, or MLA's expanded per head."""
    return (
        cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim) if cfg.is_mla else 2 * cfg.n_kv_heads * cfg.resolved_head_dim
    )


def swiglu_saved_bytes(d_model: int, hidden: int, a: int, selective: bool) -> int:
    """What `SwiGLU` keeps per token for backward: selective recompute its matmuls' outputs (gate,
    up, down), else its input, gate, up and their product."""
    return a * (2 * hidden + d_model) if selective else a * d_model + a * 3 * hidden


def moe_saved_bytes(moe: MoEConfig, D: int, a: int, selective: bool, expert_rows: float, exchanged: float) -> float:
    """What `MoE` keeps per token for backward (`block_saved_bytes`): selective recompute its fp32
    router logits, the shared expert's and experts' matmul outputs, the rows both all-to-alls
    return; else the router's and shared expert's input, the router's fp32 probabilities, the
    experts' permuted input, gate/up, activation and output, the shared expert's hidden tensors."""
    F, S = moe.expert_hidden, moe.shared_hidden
    if selective:
        return 4 * moe.num_experts + a * (2 * S + D * (S > 0)) + (expert_rows * a * (2 * F + D) + 2 * exchanged * a * D)
    return a * D + 4 * moe.num_experts + expert_rows * a * (D + 2 * F + F + D) + a * 3 * S


def block_saved_bytes(
    cfg: TransformerConfig, moe: bool, mode: str, rows: float, compiled: bool, a: int, a2a: float = 0.0, cp: int = 1
) -> float:
    """Bytes autograd keeps per token for one `Block`'s backward under recompute `mode`, the sum of
    its components' (a: bytes per matmul element, 2 under autocast bf16; rows: rows per token
    through the experts: K, or more with the sync-free dispatcher's fixed buffers; a2a: rows per
    token each direction of the expert all-to-all returns, which selective recompute keeps as
    collective outputs; cp: context parallelism, whose attention keeps, instead of its own keys
    and values, each of its two chunks' contiguous key prefix: (cp + 1) × this rank's)."""
    r, D = 4, cfg.d_model  # the residual stream is fp32
    if mode == "full":
        return r * D  # the block's input
    selective = mode == "selective"
    kept, kept_eager = attention_saved_bytes(cfg, a, cp + 1 if cp > 1 else 1, selective)
    Hd, moe_cfg = cfg.resolved_dense_hidden, cfg.moe
    ffn = moe_saved_bytes(moe_cfg, D, a, selective, rows, a2a) if moe else swiglu_saved_bytes(D, Hd, a, selective)
    if selective:  # block input + every matmul / attention output
        return r * D + kept + a * D + ffn
    # the two norms' inputs, the projections' input; uncompiled: the fp32 norm outputs (the block's,
    # the attention's), silu(gate)
    hidden_for_eager = rows * moe_cfg.expert_hidden + moe_cfg.shared_hidden if moe else Hd
    eager = 0 if compiled else 4 * 2 * D + kept_eager + a * hidden_for_eager
    return r * D + a * D + kept + r * D + ffn + eager


def mtp_saved_bytes(cfg: TransformerConfig, mode: str, compiled: bool, a: int, cp: int = 1) -> float:
    """What the `MTPModule`s keep per token for backward: each one's dense block's, its
    projection's input (2D) and its two input norms' outputs."""
    block = block_saved_bytes(cfg, False, mode, 0, compiled, a, cp=cp)
    return cfg.mtp_depth * (block + 4 * 2 * cfg.d_model + a * 2 * cfg.d_model)


def expert_operand_elements(moe: MoEConfig, d_model: int) -> int:
    """What `GroupedExperts` keep per row for deferred weight gradients (src/moetrain/model/expert_grads.py):
    both products' input and output gradient, (D + 2F) + (F + D) elements."""
    return 2 * d_model + 3 * moe.expert_hidden


def moe_forward_flops(moe: MoEConfig, d_model: int) -> tuple[int, int]:
    """(The routed experts', the shared expert's) forward FLOPs per token."""
    return 6 * d_model * moe.expert_hidden * moe.top_k, 6 * d_model * moe.shared_hidden


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


def mtp_flops_per_token(cfg: TransformerConfig, seq_len: int) -> int:
    """Training FLOPs per token of the `MTPModule`s: what they add to `flops_per_token` but their norms'."""
    norms = 2 * cfg.d_model * (1 + cfg.pre_norm + cfg.peri_norm)  # the two input norms, the block's
    without = flops_per_token(dataclasses.replace(cfg, mtp_depth=0), seq_len)
    return flops_per_token(cfg, seq_len) - without - 6 * cfg.mtp_depth * norms


def attended_keys(cfg: TransformerConfig, layer: int, seq_len: int) -> int:
    """The keys per query the formula's attention term counts for block `layer`: seq_len (twice
    the causal mean, as Olmo-core counts), or for a local block twice the window's, at most that."""
    window = cfg.window_of(layer)
    return min(seq_len, 2 * window) if window else seq_len


# Dense BF16 tensor-core peaks (FLOP/s, no sparsity) for MFU. Matched by substring of the CUDA
# device name, the longest matching key wins.
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
