"""Model configuration: the transformer and its mixture-of-experts layers."""

from __future__ import annotations

import dataclasses
import enum

from moetrain.config import Config, non_negative, positive
from moetrain.errors import ConfigError

# torch._grouped_mm needs every row stride to be a multiple of 16 bytes: 8 bf16 or 4 fp32 values.
GROUPED_MM_ALIGN = 8
MAX_WIDTH = 2**24
"""The widest model dimension (d_model, hidden sizes) a config may ask for: 1000 × a
trillion-parameter model's, far past any that can be allocated."""
MAX_LAYERS = 10**5
"""The most transformer blocks a config may ask for."""


class Gating(enum.StrEnum):
    softmax = "softmax"
    """Probabilities over all experts; the top-k are selected from them."""
    sigmoid = "sigmoid"
    """Independent per-expert scores in (0, 1) (DeepSeek-V3 style)."""


class Routing(enum.StrEnum):
    learned = "learned"
    """Top-k of the router scores (plus the aux-free bias, when enabled)."""
    random = "random"
    """k distinct experts drawn uniformly per token (from random model.moe.topk_groups groups when
    the experts are grouped), for system benchmarks: the router still runs and its scores still
    weight the outputs, so the graph and FLOPs equal learned routing."""


class AttentionKind(enum.StrEnum):
    gqa = "gqa"
    """Grouped-query attention: model.n_heads query heads over model.n_kv_heads key/value heads of
    model.head_dim, per-head QK-norm (src/moetrain/model/attention.py)."""
    mla = "mla"
    """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank
    latents with their own RMSNorms, a decoupled rotary part of the query and key heads
    (src/moetrain/model/mla.py); model.q_lora_rank, kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim and v_head_dim set its widths; n_kv_heads, head_dim and qk_norm are GQA's."""


class Fp8(enum.StrEnum):
    """FP8 recipe of the matrix products (set as `precision.fp8`; src/moetrain/model/fp8.py)."""

    none = "none"
    rowwise = "rowwise"
    """Expert grouped GEMMs and the attention / shared-expert / dense-MLP linears in float8_e4m3
    with one power-of-two scale per row (src/moetrain/model/fp8.py); the router, embedding and LM
    head stay in bf16. Needs a GPU of compute capability ≥ 8.9 (Hopper: H100, H200), or CPU."""
    mxfp8 = "mxfp8"
    """Experimental. The same GEMMs with MXFP8 operands (blocks of 32 with a shared power-of-two scale, the
    format of Blackwell's tensor cores) for forward and input gradients. Products are computed
    from the dequantized operands on any device: MXFP8's numerics, not yet its speed
    (src/moetrain/model/fp8.py). Dims must be multiples of 32."""

    @property
    def align(self) -> int:
        """Every GEMM dimension must be a multiple of this (row-wise kernels: 16; MX blocks: 32)."""
        return 32 if self == Fp8.mxfp8 else 16


class RopeScaling(enum.StrEnum):
    none = "none"
    """Plain RoPE: pair i turns by model.rope_theta^(-2i/d) per position."""
    llama3 = "llama3"
    """Llama 3.1's (transformers' rope_type "llama3"): pairs of wavelength over
    original_max_position_embeddings / low_freq_factor turn `factor` times slower, those under
    original_max_position_embeddings / high_freq_factor as before, those between by a blend of the
    two, linear in original_max_position_embeddings / wavelength (src/moetrain/model/rope.py)."""
    yarn = "yarn"
    """YaRN (transformers' rope_type "yarn"; DeepSeek-V3's and Kimi-K2's): pairs that turn more than
    beta_fast times in original_max_position_embeddings keep their frequency, those under beta_slow
    turn `factor` times slower, those between blend the two, linear in the pair's index; cos and sin
    are multiplied by the attention factor (0.1·ln factor + 1, or the mscale / mscale_all_dim ratio)."""


@dataclasses.dataclass(kw_only=True)
class RopeScalingConfig(Config):
    """How RoPE's frequencies are rescaled for contexts past the pretraining length (the defaults
    beside `type` are Llama 3.1's)."""

    type: RopeScaling = RopeScaling.none
    """none: plain RoPE; llama3 or yarn (transformers' rope_type of that name), by the fields below."""
    factor: float = positive(8.0)
    """How many times slower the low frequencies turn."""
    original_max_position_embeddings: int = positive(8192, at_most=2**31)
    """The context length the model was pretrained with."""
    low_freq_factor: float = positive(1.0)
    """llama3: wavelengths over original_max_position_embeddings / low_freq_factor are scaled by factor."""
    high_freq_factor: float = positive(4.0)
    """llama3: wavelengths under original_max_position_embeddings / high_freq_factor are kept."""
    beta_fast: float = positive(32.0)
    """yarn: pairs that turn more than this many times in original_max_position_embeddings are kept."""
    beta_slow: float = positive(1.0)
    """yarn: pairs that turn fewer times are scaled by factor."""
    mscale: float = non_negative(0.0)
    """yarn, with mscale_all_dim: the attention factor is (0.1·mscale·ln factor + 1) / (0.1·mscale_all_dim·ln
    factor + 1). 0: unset, as transformers' null."""
    mscale_all_dim: float = non_negative(0.0)
    """yarn with multi-head latent attention: the softmax scale × (0.1·mscale_all_dim·ln factor + 1)², as
    DeepSeek-V3's. 0: unset."""

    def validate(self) -> None:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must be larger than "
                f"model.rope_scaling.low_freq_factor={self.low_freq_factor} (the blended band lies between "
                "them): raise high_freq_factor or lower low_freq_factor."
            )


@dataclasses.dataclass(kw_only=True)
class MoEConfig(Config):
    num_experts: int = positive(8, at_most=2**20)
    """Routed experts per MoE layer."""
    top_k: int = positive(4, at_most=2**20)
    """Experts each token is sent to."""
    expert_hidden: int = positive(128, at_most=MAX_WIDTH)
    """Hidden size of each routed SwiGLU expert."""
    shared_hidden: int = non_negative(0, at_most=MAX_WIDTH)
    """Hidden size of the shared expert that every token also passes through; 0 = none."""
    gating: Gating = Gating.softmax
    """How router logits become scores."""
    routing: Routing = Routing.learned
    """How experts are selected."""
    normalize_weights: bool = True
    """Rescale the k selected scores to sum to 1."""
    restore_weight_scale: bool = False
    """Multiply the (normalized) weights by k, which keeps the output scale of a split dense MLP."""
    routed_scale: float = positive(1.0, at_most=2**20)
    """Multiply the (normalized) weights by this constant, independent of k: DeepSeek-V3's routed
    scaling factor (2.5). A factor of k is restore_weight_scale, which follows top_k; set one of the two."""
    n_groups: int = positive(1, at_most=2**20)
    """Group-limited routing (DeepSeek-V3's node-limited routing): the experts split into this many
    equal groups, in order; each token ranks the groups by the sum of the top 2 biased scores in
    each and takes its k experts from the best model.moe.topk_groups of them. Sigmoid gating only;
    1 = no groups."""
    topk_groups: int = positive(1, at_most=2**20)
    """Group-limited routing: how many of the model.moe.n_groups groups each token may use."""
    lb_loss_weight: float = non_negative(0.01)
    """Weight of the Switch-style load-balancing loss; 0 disables it."""
    z_loss_weight: float = non_negative(2e-4)
    """Weight of the router z-loss (mean squared logsumexp of the logits); 0 disables it."""
    bias_update_rate: float = non_negative(0.0)
    """Auxiliary-loss-free balancing: after each optimizer step every expert's selection bias moves
    by this amount towards uniform load (sign of the load error). 0 disables it."""

    def validate(self) -> None:
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"model.moe.top_k={self.top_k} is larger than model.moe.num_experts="
                f"{self.num_experts}: a token cannot pick more experts than exist. Lower top_k or "
                "raise num_experts."
            )
        if self.restore_weight_scale and self.routed_scale != 1:
            raise ConfigError(
                f"model.moe.routed_scale={self.routed_scale} with model.moe.restore_weight_scale=true: both scale "
                "the routed weights. Keep restore_weight_scale (× k) or routed_scale (a constant), not both."
            )
        groups, kept = self.n_groups, self.topk_groups
        if kept > groups:
            raise ConfigError(
                f"model.moe.topk_groups={kept} is larger than model.moe.n_groups={groups}: a token cannot use more "
                "groups than exist. Lower topk_groups."
            )
        if groups > 1 and self.gating != Gating.sigmoid:
            raise ConfigError(
                f"model.moe.n_groups={groups} needs model.moe.gating=sigmoid: group-limited routing is "
                "DeepSeek-V3's, over sigmoid scores (softmax's max-of-group, DeepSeek-V2's, is not supported). "
                "Set model.moe.gating=sigmoid or model.moe.n_groups=1."
            )
        if groups > 1 and (self.num_experts % groups or self.num_experts // groups < 2):
            raise ConfigError(
                f"model.moe.n_groups={groups} must divide model.moe.num_experts={self.num_experts} into groups "
                "of at least 2 experts (a group's score is the sum of its top 2): choose a divisor."
            )
        if groups > 1 and self.top_k > kept * (self.num_experts // groups):
            raise ConfigError(
                f"model.moe.top_k={self.top_k} is more than the {kept * (self.num_experts // groups)} experts "
                f"of model.moe.topk_groups={kept} groups of {self.num_experts // groups}: raise topk_groups."
            )
        if self.expert_hidden % GROUPED_MM_ALIGN:
            raise ConfigError(
                f"model.moe.expert_hidden={self.expert_hidden} must be a multiple of "
                f"{GROUPED_MM_ALIGN} (the grouped GEMM needs 16-byte aligned rows)."
            )

    @property
    def weight_scale(self) -> float:
        """The factor of the (normalized) routed weights: k with restore_weight_scale, else routed_scale."""
        return float(self.top_k) if self.restore_weight_scale else self.routed_scale


@dataclasses.dataclass(kw_only=True)
class TransformerConfig(Config):
    vocab_size: int = positive(8192, at_most=2**32)
    """Rows of the embedding and the LM head (pad it to a multiple of 128 for speed)."""
    d_model: int = positive(128, at_most=MAX_WIDTH)
    """Width of the residual stream."""
    n_layers: int = positive(4, at_most=MAX_LAYERS)
    """Transformer blocks in total (dense + MoE)."""
    n_heads: int = positive(4, at_most=2**16)
    """Query heads."""
    n_kv_heads: int = positive(2, at_most=2**16)
    """Key/value heads (grouped-query attention); must divide n_heads."""
    head_dim: int | None = positive(None, at_most=2**16)
    """Width of one head; None = d_model // n_heads."""
    num_dense_layers: int = non_negative(1, at_most=MAX_LAYERS)
    """The first blocks use a dense SwiGLU MLP instead of an MoE layer."""
    dense_hidden: int | None = positive(None, at_most=MAX_WIDTH)
    """Hidden size of the dense MLP; None = top_k × expert_hidden + shared_hidden."""
    qk_norm: bool = True
    """Per-head RMSNorm on queries and keys (grouped-query attention; MLA normalizes its latents)."""
    attention: AttentionKind = AttentionKind.gqa
    """The attention of every block: gqa (grouped-query) or mla (multi-head latent, DeepSeek-V3's)."""
    q_lora_rank: int = non_negative(0, at_most=MAX_WIDTH)
    """MLA: width of the query latent (x → latent → RMSNorm → heads); 0 = queries projected from x
    directly, as DeepSeek-V2-Lite."""
    kv_lora_rank: int = positive(512, at_most=MAX_WIDTH)
    """MLA: width of the key/value latent, what generation's cache holds per position and layer
    (with the rotary key)."""
    qk_nope_head_dim: int = positive(128, at_most=2**16)
    """MLA: the part of each query and key head without position (from the latents)."""
    qk_rope_head_dim: int = positive(64, at_most=2**16)
    """MLA: the rotary part of each query head, and of the one key head all heads share; even."""
    v_head_dim: int = positive(128, at_most=2**16)
    """MLA: width of each value head."""
    sliding_window: int = non_negative(0, at_most=2**31)
    """Local attention: in the layers model.attention_pattern makes local, a token attends to
    itself and the sliding_window − 1 positions before it (src/moetrain/model/local_attention.py).
    0 = every layer attends to every earlier position."""
    attention_pattern: str = ""
    """Which blocks attend locally (L: over model.sliding_window positions) and which globally
    (G), as a pattern repeated over the blocks from the first, e.g. "LLLG" (three local, then one
    global); "" = every block local when model.sliding_window is set."""
    attention_sinks: bool = False
    """gpt-oss's attention sinks: every attention layer (GQA or MLA, local or global) learns one
    logit per query head, initialized to 0, that joins its softmax's denominator as e^sink and
    adds nothing to the output, so a head can attend to little or nothing
    (src/moetrain/model/sinks.py). The cost on a GPU: SDPA's memory-efficient (or math) kernel with a
    dense (T, T) mask in place of FlashAttention. Hugging Face export: with `--remote-code` only."""
    pre_norm: bool = True
    """Normalize each sublayer's input. false (with peri_norm=true): x + norm(f(x)), OLMo 2's
    reordered norm, which Olmo-core's moe_8l shape (bench-8e) has."""
    peri_norm: bool = False
    """Also normalize each sublayer's output before the residual add (pre-norm otherwise)."""
    norm_eps: float = positive(1e-6)
    """Epsilon of every RMSNorm."""
    rope_theta: float = positive(500_000.0)
    """RoPE base: the rotation of pair i advances by theta^(-2i/head_dim) per position."""
    rope_scaling: RopeScalingConfig = dataclasses.field(default_factory=RopeScalingConfig)
    init_std: float = positive(0.02)
    """Std of the (truncated) normal initialization; output projections use `init_output_std`."""
    init_output_std: float | None = positive(None)
    """Std of the output projections (attention out, every MLP and expert down projection); None:
    init_std / sqrt(2 × n_layers), so that the residual stream's variance does not grow with depth.
    Olmo-core's `InitMethod.normal` gives them init_std like every matrix."""
    embedding_norm: bool = False
    """RMSNorm of the token embeddings × √d_model (a weight of d_model, `embed.norm.weight`), so the
    residual stream starts at unit RMS instead of init_std, as in Olmo-core's MoE models. Exports
    with `--remote-code` only."""
    mtp_depth: int = non_negative(0, at_most=16)
    """Multi-token prediction (DeepSeek-V3's): this many sequential modules, module k predicting
    the token k + 1 ahead from the previous depth's hidden state and the embedding of token k,
    through one dense block each, with the model's embedding and LM head (src/moetrain/model/mtp.py).
    Training only: the loss logged as lm_loss (and the validation loss) stays the next-token one;
    a Hugging Face export leaves the modules out; checkpoints keep them. 0 = off."""
    mtp_loss_weight: float = non_negative(0.3)
    """λ: the multi-token losses join the next-token loss as λ × their mean over the depths."""
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def is_mla(self) -> bool:
        return self.attention == AttentionKind.mla

    @property
    def qk_head_dim(self) -> int:
        """Width of one query/key head: what the scores' dot products run over."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.resolved_head_dim

    @property
    def value_head_dim(self) -> int:
        """Width of one value head (and of one head of the attention's output)."""
        return self.v_head_dim if self.is_mla else self.resolved_head_dim

    @property
    def rope_dim(self) -> int:
        """The dims of a head RoPE rotates: the whole head, or MLA's rotary part."""
        return self.qk_rope_head_dim if self.is_mla else self.resolved_head_dim

    @property
    def resolved_dense_hidden(self) -> int:
        if self.dense_hidden is not None:
            return self.dense_hidden
        return self.moe.top_k * self.moe.expert_hidden + self.moe.shared_hidden

    @property
    def num_moe_layers(self) -> int:
        return self.n_layers - self.num_dense_layers

    def window_of(self, layer: int) -> int:
        """Block `layer`'s sliding window (0: global attention); the multi-token prediction
        modules' blocks, numbered on from the last, continue the pattern."""
        pattern = self.attention_pattern or "L"
        return self.sliding_window if pattern[layer % len(pattern)] == "L" else 0

    def validate(self) -> None:
        gqa = not self.is_mla  # n_heads, n_kv_heads and head_dim shape GQA's heads; MLA has its own widths
        if gqa and self.head_dim is None and self.d_model % self.n_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}: "
                "choose heads that divide the width, or set model.head_dim explicitly."
            )
        if gqa and self.resolved_head_dim % 2:
            name = "head dim d_model/n_heads" if self.head_dim is None else "model.head_dim"
            raise ConfigError(f"{name}={self.resolved_head_dim} must be even (RoPE rotates pairs).")
        if gqa and self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={self.n_kv_heads} does not divide model.n_heads={self.n_heads}: "
                "each key/value head serves a whole group of query heads."
            )
        if self.is_mla and self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs): change it by one."
            )
        if not (self.pre_norm or self.peri_norm):
            raise ConfigError(
                "model.pre_norm=false with model.peri_norm=false leaves the blocks without a norm: set either "
                "(pre_norm alone: pre-norm; peri_norm alone: x + norm(f(x)); both: peri-norm)."
            )
        if set(self.attention_pattern) - {"L", "G"}:
            raise ConfigError(
                f"model.attention_pattern={self.attention_pattern!r} may hold only L (a local block) and G (a "
                'global one), repeated over the blocks: e.g. "LLLG".'
            )
        if self.attention_pattern and not self.sliding_window:
            raise ConfigError(
                f"model.attention_pattern={self.attention_pattern!r} names local blocks, but model.sliding_window "
                "is 0 (no window): set model.sliding_window (tokens), or drop the pattern."
            )
        if self.num_dense_layers > self.n_layers:
            raise ConfigError(
                f"model.num_dense_layers={self.num_dense_layers} must be at most model.n_layers={self.n_layers}."
            )
        if self.d_model % GROUPED_MM_ALIGN:
            raise ConfigError(
                f"model.d_model={self.d_model} must be a multiple of {GROUPED_MM_ALIGN} (the grouped "
                "GEMM needs 16-byte aligned rows)."
            )

    def build(self, device: str | None = None):
        """Build the model. On device "meta" no memory is allocated; call `to_empty()` and
        `init_weights()` to materialize it."""
        import torch

        from moetrain.model.transformer import Transformer

        with torch.device(device or "cpu"):
            return Transformer(self)
