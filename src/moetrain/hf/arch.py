"""The native transformers classes moetrain models leave (and enter) as: which of our
configurations each one represents exactly (`architecture_for`), its config.json, and its tensor
names. README.md, "Export details", holds the mapping table; this file is its code. Every feature
outside the table is refused by `unsupported_features`, naming it and what exports.
"""

from __future__ import annotations

import dataclasses
import enum
import re

import torch

from moetrain.config import validate_tree
from moetrain.errors import ConfigError
from moetrain.model.config import (
    AttentionKind,
    Gating,
    MoEConfig,
    RopeScaling,
    RopeScalingConfig,
    Routing,
    TransformerConfig,
)


class Architecture(enum.StrEnum):
    """A native transformers class: each named by its config.json model_type, valued by its class name."""

    qwen3_moe = "Qwen3MoeForCausalLM"
    """Softmax top-k, no shared expert, no selection bias, no routed scale; QK-norm always."""
    glm4_moe = "Glm4MoeForCausalLM"
    """Sigmoid top-k with a selection bias, × a routed scaling factor, shared experts."""
    deepseek_v3 = "DeepseekV3ForCausalLM"
    """GLM-4-MoE's routing and experts under multi-head latent attention."""
    qwen3 = "Qwen3ForCausalLM"
    """Dense: every block a SwiGLU MLP; QK-norm always."""
    llama = "LlamaForCausalLM"
    """Dense: every block a SwiGLU MLP; no QK-norm."""

    @property
    def title(self) -> str:
        """The model family's name in messages."""
        return {"qwen3_moe": "Qwen3-MoE", "glm4_moe": "GLM-4-MoE", "deepseek_v3": "DeepSeek-V3"}.get(
            self.name, self.value.removesuffix("ForCausalLM")
        )

    @property
    def dense(self) -> bool:
        """Every block a dense MLP: no router, no experts."""
        return self in (Architecture.qwen3, Architecture.llama)


@dataclasses.dataclass(frozen=True)
class HfTensor:
    """One tensor of the Hugging Face checkpoint and where it lives in a moetrain checkpoint."""

    name: str
    """Its name in the Hub layout (per-expert tensors; transformers 5 fuses them on load)."""
    entry: str
    """The moetrain checkpoint entry (canonical parameter name; experts split as ".../e")."""
    rows: tuple[int, int] | None = None
    """A range of the entry's first dim (the gate and up halves of a fused expert weight)."""
    keep_fp32: bool = False
    """Written in fp32 whatever --dtype: transformers keeps GLM-4-MoE's router weight and selection
    bias in fp32 (`_keep_in_fp32_modules_strict`), so rounding them would change the routing."""
    parameter: bool = True
    """False for the selection bias (a buffer in moetrain), so `parameters` counts what ours does."""
    empty_shape: tuple[int, ...] | None = None
    """For a zero-width tensor that has no entry (`entry` empty): its shape."""
    scale: float = 1.0
    """Written × this (in fp32, before the cast to --dtype): Qwen3-MoE's routed experts' down
    projections carry the router's × k (`restore_weight_scale`) or `routed_scale`, which that class lacks."""


def architecture_for(m: TransformerConfig) -> Architecture:
    """The native class a model exports to."""
    if m.is_mla:
        return Architecture.deepseek_v3
    if m.num_moe_layers == 0:
        return Architecture.qwen3 if m.qk_norm else Architecture.llama
    return Architecture.qwen3_moe if m.moe.gating == Gating.softmax else Architecture.glm4_moe


SOFTMAX_SHARED = (
    "transformers' softmax MoE classes with a shared expert gate it with a learned sigmoid (Qwen2-MoE, "
    "Qwen3-Next), normalize queries and keys after RoPE and have no dense first blocks (Hunyuan-MoE), have no "
    "QK-norm (Ernie-4.5-MoE) or use latent attention (DeepSeek-V2)"
)
PERI_NORM = (
    "no native MoE class normalizes sublayer outputs with this attention and routing: AFMoE gates "
    "the attention output and leaves full-attention layers without RoPE, Kolibri1 has no dense "
    "first blocks and no routed scale and picks experts by logit, Gemma-4 runs a dense MLP beside "
    "its experts"
)
LATENT_NORM_EPS = 1e-6
"""The epsilon of DeepSeek-V3's query and key/value latent norms in transformers, whatever its
rms_norm_eps (moetrain's one model.norm_eps serves every norm)."""


def unsupported_features(m: TransformerConfig, expert_bias_nonzero: bool) -> list[str]:
    """What `architecture_for(m)` cannot represent exactly (empty: the model exports)."""
    moe, arch = m.moe, architecture_for(m)
    problems = []
    if m.is_mla and m.num_moe_layers == 0:
        problems.append("model.attention=mla with no MoE block (the dense classes have grouped-query attention)")
    if moe.routing != Routing.learned and m.num_moe_layers:
        problems.append(f"model.moe.routing={moe.routing} (a benchmark mode; only the learned router is a model)")
    if m.peri_norm:
        problems.append(f"model.peri_norm=true ({PERI_NORM})")
    if m.embedding_norm:
        problems.append("model.embedding_norm=true (neither class normalizes its token embeddings)")
    if not m.pre_norm:
        problems.append("model.pre_norm=false (both classes normalize each sublayer's input)")
    if m.sliding_window:
        problems.append(f"model.sliding_window={m.sliding_window} (local blocks are exported with moetrain's own file)")
    if m.attention_sinks:
        problems.append("model.attention_sinks=true (no class here has attention sinks; moetrain's own file has them)")
    if m.is_mla and moe.gating == Gating.softmax:
        problems.append(
            "softmax gating with model.attention=mla (DeepSeek-V3, the native class with latent attention, "
            "scores experts with a sigmoid; DeepSeek-V2's softmax class is not in transformers)"
        )
    if m.is_mla and m.norm_eps != LATENT_NORM_EPS:
        problems.append(
            f"model.norm_eps={m.norm_eps} with model.attention=mla (DeepSeek-V3 normalizes its latents with "
            f"ε = {LATENT_NORM_EPS} whatever its rms_norm_eps)"
        )
    if arch == Architecture.qwen3_moe:
        if moe.shared_hidden > 0:
            problems.append(
                f"softmax gating with a shared expert (model.moe.shared_hidden={moe.shared_hidden}): {SOFTMAX_SHARED}"
            )
        if expert_bias_nonzero:
            problems.append(
                "softmax gating with non-zero aux-loss-free expert biases (they change which experts "
                "are chosen; Qwen3-MoE has no selection bias)"
            )
        if not m.qk_norm:
            problems.append("softmax gating with model.qk_norm=false (Qwen3-MoE always normalizes queries and keys)")
    elif not arch.dense:  # GLM-4-MoE's routing, DeepSeek-V3's too
        if moe.shared_hidden % moe.expert_hidden:
            problems.append(
                f"model.moe.shared_hidden={moe.shared_hidden} is not a multiple of model.moe.expert_hidden="
                f"{moe.expert_hidden} ({arch.title}'s shared expert is n_shared_experts × moe_intermediate_size wide)"
            )
        if moe.num_experts < 2:
            problems.append(f"model.moe.num_experts=1 ({arch.title}'s group routing needs at least 2 experts)")
    return problems


def refusal(m: TransformerConfig, problems: list[str]) -> str:
    """One paragraph: why the model is not exported and which variant of it would be."""
    arch = architecture_for(m)
    text = "This model has no exact native transformers architecture, so it is not exported natively: "
    text += "; ".join(problems) + "."
    if not remote_problems(m):
        text += (
            " `--remote-code` exports it with moetrain's own modeling file beside the weights "
            "(transformers loads it with trust_remote_code=True)."
        )
    softmax = any(p.startswith("softmax") for p in problems)
    changes = [
        *["model.peri_norm=false"] * m.peri_norm,
        *["model.pre_norm=true"] * (not m.pre_norm),
        *["model.embedding_norm=false"] * m.embedding_norm,
        *["model.attention_sinks=false"] * m.attention_sinks,
        *["model.moe.gating=sigmoid"] * softmax,
        *[f"model.norm_eps={LATENT_NORM_EPS}"] * (m.is_mla and m.norm_eps != LATENT_NORM_EPS),
    ]
    if not changes:
        return text
    if m.is_mla:
        target = (
            "as DeepSeek-V3 (DeepseekV3ForCausalLM: multi-head latent attention, sigmoid scores with the aux-free "
            "selection bias, normalized weights × k, shared experts, dense first blocks)"
        )
    elif softmax or arch == Architecture.glm4_moe:
        target = (
            "as GLM-4-MoE (Glm4MoeForCausalLM: sigmoid scores with the aux-free selection bias, normalized "
            "weights × k, shared experts, QK-norm, GQA, dense first blocks)"
        )
    else:
        target = f"as {arch.title} ({arch.value})"
    text += f" What exports: the same architecture trained with {' and '.join(changes)}, {target}"
    if softmax and not m.is_mla:
        text += "; softmax top-k exports as Qwen3-MoE only without a shared expert, × k or aux-free bias (`tiny`)"
    return text + "."


def hf_config(m: TransformerConfig, eos_id: int | None, max_positions: int, dtype: str) -> dict:
    """config.json of the export (keys of transformers 4.x and 5.x both, where they differ)."""
    moe, arch = m.moe, architecture_for(m)
    common = {
        "architectures": [arch.value],
        "model_type": arch.name,
        **{theirs: getattr(m, ours) for theirs, ours in _SHAPE.items()},
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.resolved_head_dim,
        "hidden_act": "silu",
        "intermediate_size": m.resolved_dense_hidden,
        "rms_norm_eps": m.norm_eps,
        "max_position_embeddings": max_positions,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "dtype": dtype,  # transformers 5.x
        "torch_dtype": dtype,  # 4.x
        "use_cache": True,
    }
    if arch.dense:
        extra = {"use_sliding_window": False} if arch == Architecture.qwen3 else {"mlp_bias": False}
        return common | extra | _rope(m)
    common |= {
        "moe_intermediate_size": moe.expert_hidden,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.normalize_weights,
        "router_aux_loss_coef": moe.lb_loss_weight,
        "output_router_logits": False,
    }
    if arch == Architecture.qwen3_moe:
        return common | {
            "mlp_only_layers": list(range(m.num_dense_layers)),
            "decoder_sparse_step": 1,
            "num_experts": moe.num_experts,
            "num_local_experts": moe.num_experts,
            "use_sliding_window": False,
            **_rope(m),
        }
    common |= {
        "first_k_dense_replace": m.num_dense_layers,
        "n_routed_experts": moe.num_experts,
        "n_shared_experts": moe.shared_hidden // moe.expert_hidden,
        "routed_scaling_factor": moe.weight_scale,
        "n_group": moe.n_groups,
        "topk_group": moe.topk_groups,
        "num_nextn_predict_layers": 0,  # no multi-token-prediction layers
    }
    if arch == Architecture.deepseek_v3:  # every head its own keys and values; RoPE rotate-half, as moetrain's
        return common | {
            "num_key_value_heads": m.n_heads,
            "head_dim": m.qk_rope_head_dim,  # what transformers sets: its RoPE's width
            "q_lora_rank": m.q_lora_rank or None,  # None: one projection from x
            **{name: getattr(m, name) for name in _LATENT_WIDTHS},
            "rope_interleave": False,
            **_rope(m),
        }
    return common | {
        "use_qk_norm": m.qk_norm,
        # GLM-4-MoE rotates half of each head by default: ours rotates all of it.
        "partial_rotary_factor": 1.0,  # 4.x
        **_rope(m, partial_rotary_factor=1.0),
    }


_SHAPE = dict(
    vocab_size="vocab_size", hidden_size="d_model", num_hidden_layers="n_layers", num_attention_heads="n_heads"
)
"""config.json's names of the model.* fields every class has under one name (export and import)."""
_LATENT_WIDTHS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""DeepSeek-V3's latent attention widths beside q_lora_rank: the same names in moetrain and transformers."""


def _rope(m: TransformerConfig, **extra: float) -> dict:
    """RoPE's fields: rope_theta and, when scaled, rope_scaling (transformers 4.x); rope_parameters (5.x)."""
    s = m.rope_scaling
    names = ("factor", "original_max_position_embeddings", *_SCALING.get(s.type, ()))
    scaling = {"rope_type": s.type.value, **{n: getattr(s, n) for n in names}} if s.type != RopeScaling.none else {}
    return {
        "rope_theta": m.rope_theta,
        **({"rope_scaling": scaling} if scaling else {}),
        "rope_parameters": {"rope_theta": m.rope_theta, "rope_type": "default", **extra, **scaling},
    }


_SCALING = {
    RopeScaling.llama3: ("low_freq_factor", "high_freq_factor"),
    RopeScaling.yarn: ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
}
"""Each RoPE scaling's own fields beside factor and original_max_position_embeddings: the same names
in model.rope_scaling and in transformers."""


def tensor_plan(m: TransformerConfig) -> list[HfTensor]:
    """Every tensor of the export, in file order (embedding, layers, final norm, head)."""
    arch, moe = architecture_for(m), m.moe
    pairs = (_LATENT_Q if m.q_lora_rank else _DIRECT_Q) + _LATENT_KV if m.is_mla else _ATTENTION + _QK_NORM * m.qk_norm
    plan = [HfTensor("model.embed_tokens.weight", "embed.weight")]
    for i in range(m.n_layers):
        p, b = f"model.layers.{i}", f"blocks.{i}"
        plan.append(HfTensor(f"{p}.input_layernorm.weight", f"{b}.attn_norm.weight"))
        for ours, theirs in pairs:
            plan.append(HfTensor(f"{p}.self_attn.{theirs}.weight", f"{b}.attn.{ours}.weight"))
        plan.append(HfTensor(f"{p}.post_attention_layernorm.weight", f"{b}.ffn_norm.weight"))
        if i < m.num_dense_layers:
            plan += _swiglu(f"{p}.mlp", f"{b}.ffn")
            continue
        glm = arch != Architecture.qwen3_moe  # GLM-4-MoE's routing, DeepSeek-V3's too
        plan.append(HfTensor(f"{p}.mlp.gate.weight", f"{b}.ffn.router.weight", keep_fp32=glm))
        if glm:
            bias = f"{b}.ffn.router.expert_bias_E"
            plan.append(HfTensor(f"{p}.mlp.gate.e_score_correction_bias", bias, keep_fp32=True, parameter=False))
        F = moe.expert_hidden
        # × k (or routed_scale) after the normalized weights is a constant factor of every routed
        # expert's output: Qwen3-MoE has no routed scale, so it goes into the experts' down projections
        # (linear): one rounding of each product (none for a power-of-two k); import reads it back unscaled.
        fold = moe.weight_scale if not glm else 1.0
        for e in range(moe.num_experts):
            x, gate_up = f"{p}.mlp.experts.{e}", f"{b}.ffn.experts.w_gate_up_E2FD/{e}"
            plan.append(HfTensor(f"{x}.gate_proj.weight", gate_up, rows=(0, F)))
            plan.append(HfTensor(f"{x}.up_proj.weight", gate_up, rows=(F, 2 * F)))
            plan.append(HfTensor(f"{x}.down_proj.weight", f"{b}.ffn.experts.w_down_EDF/{e}", scale=fold))
        if glm:  # zero-width when there is none (n_shared_experts=0): transformers still has them
            shared = f"{b}.ffn.shared_expert" if moe.shared_hidden else None
            plan += _swiglu(f"{p}.mlp.shared_experts", shared, m.d_model)
    plan.append(HfTensor("model.norm.weight", "norm.weight"))
    plan.append(HfTensor("lm_head.weight", "lm_head.weight"))
    return plan


_ATTENTION = (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
_QK_NORM = (("q_norm", "q_norm"), ("k_norm", "k_norm"))
_DIRECT_Q = (("wq", "q_proj"),)
_LATENT_Q = (("wq_a", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("wq_b", "q_b_proj"))
_LATENT_KV = (("wkv_a", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("wkv_b", "kv_b_proj"), ("wo", "o_proj"))


def rope_rows_from_interleaved(m: TransformerConfig, name: str, value: torch.Tensor) -> torch.Tensor:
    """Tensor `name` of a DeepSeek-V3 file whose RoPE is interleaved (rope_interleave true, as in
    DeepSeek's own checkpoints: pair i is dims 2i and 2i + 1) as moetrain's rotate-half RoPE takes
    it (pair i is dims i and i + R/2): the rows that make the rotary part of each query head and of
    the shared key reordered, evens first, then odds. Both rotations then give the same vectors up
    to that order, which queries and keys share, so every score is the same."""
    if name.endswith(".kv_a_proj_with_mqa.weight"):
        lead = m.kv_lora_rank  # [c | kr]: the latent, then the one rotary key
    elif name.endswith((".q_proj.weight", ".q_b_proj.weight")):
        lead = m.qk_nope_head_dim  # each head [q_nope | q_rope]
    else:
        return value
    R = m.qk_rope_head_dim
    order_R = lead + torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2)])
    rows_XKI = value.view(-1, lead + R, value.shape[-1])
    return torch.cat([rows_XKI[:, :lead], rows_XKI[:, order_R]], dim=1).reshape(value.shape)


REMOTE_MODULE = "modeling_moetrain"
"""The modeling file `--remote-code` ships (src/moetrain/hf/modeling_moetrain.py)."""


def remote_problems(m: TransformerConfig) -> list[str]:
    """What even moetrain's own modeling file does not export (empty: it exports)."""
    if m.moe.routing != Routing.learned:
        return [f"model.moe.routing={m.moe.routing} (a benchmark mode; only the learned router is a model)"]
    if m.is_mla:
        return [
            "model.attention=mla (moetrain's modeling file has no latent attention; DeepseekV3ForCausalLM has it: "
            "export without --remote-code, with sigmoid gating (model.moe.gating=sigmoid))"
        ]
    if m.rope_scaling.type != RopeScaling.none:
        return [
            f"model.rope_scaling.type={m.rope_scaling.type} (moetrain's modeling file has plain RoPE; Llama, Qwen3, "
            "Qwen3-MoE, GLM-4-MoE and DeepSeek-V3 have llama3's and yarn's scaling: export without --remote-code)"
        ]
    if m.moe.n_groups > 1 or m.moe.routed_scale != 1:
        return [
            f"model.moe.n_groups={m.moe.n_groups}, routed_scale={m.moe.routed_scale} (moetrain's modeling file has "
            "plain top-k × 1 or k; GLM-4-MoE and DeepSeek-V3 have group-limited routing and a routed scale: export "
            "without --remote-code)"
        ]
    return []


def remote_tensor_plan(entries: list[str]) -> list[HfTensor]:
    """Every checkpoint entry but the multi-token prediction modules', in checkpoint order, under
    modeling_moetrain.py's names: moetrain's own, each expert's as `experts.{e}.w_gate_up` / `.w_down`;
    the router's weight and selection bias in fp32, as that file keeps them."""
    plan = []
    for entry in entries:
        if entry.startswith("mtp."):
            continue
        name = re.sub(r"experts\.w_gate_up_E2FD/(\d+)$", r"experts.\1.w_gate_up", entry)
        name = re.sub(r"experts\.w_down_EDF/(\d+)$", r"experts.\1.w_down", name)
        router = ".ffn.router." in entry
        plan.append(HfTensor(name, entry, keep_fp32=router, parameter=not entry.endswith("expert_bias_E")))
    return plan


def remote_config(m: TransformerConfig, eos_id: int | None, max_positions: int, dtype: str) -> dict:
    """config.json of a `--remote-code` export: MoetrainConfig's fields and the auto_map that
    points transformers at the modeling file."""
    moe = m.moe
    return {
        "architectures": ["MoetrainForCausalLM"],
        "model_type": "moetrain",
        "auto_map": {
            "AutoConfig": f"{REMOTE_MODULE}.MoetrainConfig",
            "AutoModelForCausalLM": f"{REMOTE_MODULE}.MoetrainForCausalLM",
        },
        # model.* fields under their own names, but for the resolved widths
        **{name: getattr(m, name) for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads")},
        "head_dim": m.resolved_head_dim,
        "num_dense_layers": m.num_dense_layers,
        "dense_hidden": m.resolved_dense_hidden,
        **{name: getattr(m, name) for name in ("qk_norm", "pre_norm", "peri_norm", "embedding_norm", "sliding_window")},
        **{name: getattr(m, name) for name in ("attention_pattern", "attention_sinks", "norm_eps", "rope_theta")},
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        **{name: getattr(moe, name) for name in ("expert_hidden", "shared_hidden")},
        "gating": moe.gating.value,
        **{name: getattr(moe, name) for name in ("normalize_weights", "restore_weight_scale")},
        "max_position_embeddings": max_positions,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": False,
        "tie_word_embeddings": False,
    }


def _swiglu(theirs: str, ours: str | None, d_model: int = 0) -> list[HfTensor]:
    """A SwiGLU MLP's three projections; `ours` None: zero-width ones (no such module here)."""
    names = (
        ("w_gate", "gate_proj", (0, d_model)),
        ("w_up", "up_proj", (0, d_model)),
        ("w_down", "down_proj", (d_model, 0)),
    )
    if ours is None:
        return [HfTensor(f"{theirs}.{t}.weight", "", empty_shape=shape) for _, t, shape in names]
    return [HfTensor(f"{theirs}.{t}.weight", f"{ours}.{o}.weight") for o, t, _ in names]


# ---- import: config.json → TransformerConfig -----------------------------------------------


def model_config_from_hf(hf: dict, source: str) -> TransformerConfig:
    """The moetrain model a Qwen3-MoE, GLM-4-MoE, DeepSeek-V3, Qwen3 or Llama config.json
    describes; refuses what moetrain cannot run exactly, naming the field."""
    model_type = hf.get("model_type")
    known = {a.name: a for a in Architecture}
    if model_type not in known:
        raise ConfigError(
            f"{source}: model_type '{model_type}' is not supported; import-hf reads qwen3_moe (Qwen3-MoE), "
            "glm4_moe (GLM-4-MoE), deepseek_v3 (DeepSeek-V3) and the dense qwen3 (Qwen3) and llama (Llama) models."
        )
    try:
        model = _model_config(hf, source, known[model_type])
    except KeyError as e:
        raise ConfigError(f"{source} has no '{e.args[0]}': it is not a complete {model_type} config.json.") from None
    except (TypeError, ValueError) as e:  # a field of another type: "64" or null where a number goes
        raise ConfigError(
            f"{source} holds a value of the wrong type ({e}): compare it with a {model_type} config.json."
        ) from None
    try:
        validate_tree(model, "model.")
    except ConfigError as e:
        raise ConfigError(f"{source} describes a model moetrain cannot build: {e}") from None
    return model


def _model_config(hf: dict, source: str, arch: Architecture) -> TransformerConfig:
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    # transformers 5.x: rope_parameters; 4.x: rope_theta and rope_scaling, whose type older files name "type"
    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = []
    if hf.get("attention_bias"):
        problems.append("attention_bias=true")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']}")
    if rope_type not in ("default", "llama3", "yarn"):
        problems.append(f"rope_type={rope_type} (moetrain has plain RoPE, llama3's and yarn's scaling)")
    if rope_type == "yarn" and (rope.get("attention_factor") is not None or rope.get("truncate") is False):
        problems.append("yarn with attention_factor or truncate=false (moetrain's follows mscale and truncates)")
    latent = _latent_attention(hf, heads, problems) if arch == Architecture.deepseek_v3 else None
    if arch.dense:
        dense, moe = layers, {}
        sliding, local = hf.get("use_sliding_window"), sorted(set(hf.get("layer_types") or []) - {"full_attention"})
        if sliding or local:
            field = "use_sliding_window=true" if sliding else f"layer_types with {', '.join(local)}"
            problems.append(f"{field} (sliding-window layers; moetrain imports full attention only)")
        if hf.get("mlp_bias"):
            problems.append("mlp_bias=true")
    elif arch == Architecture.qwen3_moe:
        dense, moe = _qwen3_routing(hf, problems)
    else:
        dense, moe = _sigmoid_routing(hf, layers, 3 if arch == Architecture.deepseek_v3 else 1)
    if arch == Architecture.glm4_moe:
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))  # transformers' default
        if partial != 1.0:
            problems.append(f"partial_rotary_factor={partial} (moetrain rotates whole heads)")
    if problems:
        raise ConfigError(f"{source}: this {arch.title} variant cannot be reproduced exactly: {'; '.join(problems)}.")
    return TransformerConfig(
        **{ours: hf[theirs] for theirs, ours in _SHAPE.items()},
        **(latent or _grouped_query_attention(hf, heads, arch)),
        num_dense_layers=dense,
        dense_hidden=hf["intermediate_size"],
        peri_norm=False,
        norm_eps=hf["rms_norm_eps"],
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=_rope_scaling(rope, rope_type, hf),
        moe=_moe_config(hf, arch, moe),
    )


def _rope_scaling(rope: dict, rope_type: str, hf: dict) -> RopeScalingConfig:
    """model.rope_scaling of a config.json's RoPE fields (`rope`: its 5.x rope_parameters)."""
    if rope_type == "default":
        return RopeScalingConfig()
    kind = RopeScaling(rope_type)
    original = rope.get("original_max_position_embeddings", hf["max_position_embeddings"])  # transformers' default
    # llama3's fields are required; yarn's, absent or null, are transformers' defaults (moetrain's too)
    fields = {n: float(rope[n]) for n in _SCALING[kind] if kind == RopeScaling.llama3 or rope.get(n) is not None}
    factor = float(rope["factor"])
    return RopeScalingConfig(type=kind, factor=factor, original_max_position_embeddings=int(original), **fields)


def _moe_config(hf: dict, arch: Architecture, routing: dict) -> MoEConfig:
    """The routing and experts (`routing`: MoEConfig fields and n_shared_experts). A dense model's: the
    defaults with experts as wide as its MLP, so that `moetrain upcycle` copies the MLP into them as they are."""
    if arch.dense:
        return MoEConfig(expert_hidden=hf["intermediate_size"])
    return MoEConfig(
        top_k=hf["num_experts_per_tok"],
        expert_hidden=hf["moe_intermediate_size"],
        normalize_weights=bool(hf.get("norm_topk_prob", arch != Architecture.qwen3_moe)),  # transformers' defaults
        lb_loss_weight=hf.get("router_aux_loss_coef", 0.001),
        shared_hidden=routing.pop("n_shared_experts", 0) * hf["moe_intermediate_size"],
        **routing,
    )


def _qwen3_routing(hf: dict, problems: list[str]) -> tuple[int, dict]:
    """Qwen3-MoE's dense blocks and experts: (dense blocks, MoEConfig fields)."""
    mlp_only = sorted(hf.get("mlp_only_layers") or [])
    if mlp_only != list(range(len(mlp_only))):
        problems.append(f"mlp_only_layers={mlp_only} (moetrain's dense blocks come first)")
    if hf.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step={hf['decoder_sparse_step']}")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true")
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    # no shared expert, × k, routed scale or expert groups: MoEConfig's defaults
    return len(mlp_only), {"num_experts": experts, "gating": Gating.softmax}


def _sigmoid_routing(hf: dict, layers: int, dense_default: int) -> tuple[int, dict]:
    """GLM-4-MoE's and DeepSeek-V3's dense blocks and experts (`dense_default`: transformers'
    first_k_dense_replace where config.json has none): (dense blocks, MoEConfig fields)."""
    top_k, scale = hf["num_experts_per_tok"], float(hf.get("routed_scaling_factor", 1.0))
    groups, kept = hf.get("n_group", 1), hf.get("topk_group", 1)
    restore = scale == float(top_k) and top_k != 1
    if kept == groups:  # every group kept: plain top-k, which n_groups=1 computes exactly
        groups = kept = 1
    return min(hf.get("first_k_dense_replace", dense_default), layers), {
        "num_experts": hf.get("n_routed_experts") or hf.get("num_local_experts"),
        "n_shared_experts": hf.get("n_shared_experts", 1),
        "gating": Gating.sigmoid,
        "restore_weight_scale": restore,
        "routed_scale": 1.0 if restore else scale,
        "n_groups": groups,
        "topk_groups": kept,
    }


def _grouped_query_attention(hf: dict, heads: int, arch: Architecture) -> dict:
    """Grouped-query attention (every class but DeepSeek-V3's) as moetrain's fields."""
    return {
        "n_kv_heads": hf["num_key_value_heads"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "qk_norm": arch in (Architecture.qwen3_moe, Architecture.qwen3) or bool(hf.get("use_qk_norm", False)),
    }


def _latent_attention(hf: dict, heads: int, problems: list[str]) -> dict:
    """DeepSeek-V3's attention as moetrain's fields (`rope_rows_from_interleaved` reorders the
    weights of an interleaved RoPE)."""
    kv_heads = hf.get("num_key_value_heads") or heads
    if kv_heads != heads:
        problems.append(f"num_key_value_heads={kv_heads} (latent attention expands keys and values to every head)")
    if hf["rms_norm_eps"] != LATENT_NORM_EPS:
        problems.append(
            f"rms_norm_eps={hf['rms_norm_eps']} (its latent norms use {LATENT_NORM_EPS}; moetrain's one "
            "model.norm_eps serves every norm)"
        )
    return {
        "n_kv_heads": heads,
        "qk_norm": False,
        "attention": AttentionKind.mla,
        "q_lora_rank": hf["q_lora_rank"] or 0,
        **{name: hf[name] for name in _LATENT_WIDTHS},
    }
