"""Hugging Face interoperability: `moetrain export-hf CHECKPOINT OUT_DIR`.

A moetrain checkpoint becomes a directory that `transformers` loads offline with a *native*
architecture (no remote code): `model.safetensors` (fp32), `config.json`, `tokenizer.json` and
`tokenizer_config.json`. Only models that a native class represents exactly are exported; any
other feature is refused with a message naming it.

Qwen3-MoE (`Qwen3MoeForCausalLM`) represents: pre-norm blocks with RMSNorm, GQA attention with
per-head RMSNorm on queries and keys and rotate-half RoPE, no biases; a softmax router over all
experts whose top-k probabilities are renormalized to sum to 1 (`norm_topk_prob`), SwiGLU
experts, no shared expert; the first blocks dense (`mlp_only_layers`, hidden `intermediate_size`);
an untied LM head. The `tiny` preset is such a model.

Weights are written in the Hub's per-expert layout (`mlp.experts.{e}.gate_proj.weight`, …), which
transformers 4.x loads as is and 5.x converts into its fused expert tensors on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moetrain.errors import ConfigError, require
from moetrain.inference import load_for_inference
from moetrain.model.config import Gating, MoEConfig, Routing, TransformerConfig
from moetrain.train import checkpoint as ckpt
from moetrain.train.config import RunConfig

EXPORTED_BY = "moetrain export-hf"


def unsupported_features(model_cfg: TransformerConfig, expert_bias_nonzero: bool) -> list[str]:
    """The features of this model that Qwen3-MoE cannot represent (empty: it exports)."""
    m, moe = model_cfg, model_cfg.moe
    problems = []
    if m.num_moe_layers == 0:
        problems.append("no MoE layer (a dense model: export it as a dense architecture instead)")
    if moe.shared_hidden > 0:
        problems.append(f"a shared expert (model.moe.shared_hidden={moe.shared_hidden}; Qwen3-MoE has none)")
    if moe.gating != Gating.softmax:
        problems.append(f"model.moe.gating={moe.gating} (Qwen3-MoE's router is a softmax)")
    if not moe.normalize_weights:
        problems.append("model.moe.normalize_weights=false (the export sets norm_topk_prob=true)")
    if moe.restore_weight_scale:
        problems.append("model.moe.restore_weight_scale=true (routing weights × k)")
    if moe.routing != Routing.learned:
        problems.append(f"model.moe.routing={moe.routing} (only the learned router is a model)")
    if expert_bias_nonzero:
        problems.append("aux-loss-free expert biases that are not zero (they change which experts are chosen)")
    if m.peri_norm:
        problems.append("model.peri_norm=true (sublayer outputs normalized before the residual add)")
    if not m.qk_norm:
        problems.append("model.qk_norm=false (Qwen3-MoE always normalizes queries and keys)")
    return problems


def hf_config(model_cfg: TransformerConfig, eos_id: int | None) -> dict:
    m, moe = model_cfg, model_cfg.moe
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.resolved_head_dim,
        "hidden_act": "silu",
        "intermediate_size": m.resolved_dense_hidden,
        "mlp_only_layers": list(range(m.num_dense_layers)),
        "decoder_sparse_step": 1,
        "moe_intermediate_size": moe.expert_hidden,
        "num_experts": moe.num_experts,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": True,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,  # transformers 4.x
        "rope_parameters": {"rope_theta": m.rope_theta, "rope_type": "default"},  # 5.x
        "max_position_embeddings": 32768,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "router_aux_loss_coef": moe.lb_loss_weight,
        "output_router_logits": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """moetrain parameter names → Qwen3-MoE's (Hub layout), fp32, contiguous."""
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        out[name] = t.detach().to(torch.float32).contiguous().clone()

    put("model.embed_tokens.weight", model.embed.weight)
    put("model.norm.weight", model.norm.weight)
    put("lm_head.weight", model.lm_head.weight)
    for i, block in enumerate(model.blocks.values()):
        p = f"model.layers.{i}"
        a = block.attn
        put(f"{p}.input_layernorm.weight", block.attn_norm.weight)
        put(f"{p}.post_attention_layernorm.weight", block.ffn_norm.weight)
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            put(f"{p}.self_attn.{theirs}.weight", getattr(a, ours).weight)
        put(f"{p}.self_attn.q_norm.weight", a.q_norm.weight)
        put(f"{p}.self_attn.k_norm.weight", a.k_norm.weight)
        ffn = block.ffn
        if hasattr(ffn, "experts"):
            put(f"{p}.mlp.gate.weight", ffn.router.weight)
            w_gate_up, w_down = ffn.experts.w_gate_up_E2FD, ffn.experts.w_down_EDF
            hidden = w_gate_up.shape[1] // 2
            for e in range(w_gate_up.shape[0]):
                put(f"{p}.mlp.experts.{e}.gate_proj.weight", w_gate_up[e, :hidden])
                put(f"{p}.mlp.experts.{e}.up_proj.weight", w_gate_up[e, hidden:])
                put(f"{p}.mlp.experts.{e}.down_proj.weight", w_down[e])
        else:
            put(f"{p}.mlp.gate_proj.weight", ffn.w_gate.weight)
            put(f"{p}.mlp.up_proj.weight", ffn.w_up.weight)
            put(f"{p}.mlp.down_proj.weight", ffn.w_down.weight)
    return out


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> dict:
    """Write the HF directory; returns a summary (architecture, tensors, parameters, paths)."""
    save_file = require("safetensors.torch", "export-hf (it writes safetensors)").save_file

    model, cfg, tokenizer = load_for_inference(checkpoint)
    bias_nonzero = any(bool(moe.router.expert_bias_E.abs().max() > 0) for moe in model.moe_layers())
    problems = unsupported_features(cfg.model, bias_nonzero)
    if problems:
        raise ConfigError(
            "This model has no exact native transformers architecture, so it is not exported: "
            + "; ".join(problems)
            + ". Supported: Qwen3-MoE (softmax top-k with normalized weights, no shared "
            "expert, QK-norm, pre-norm), e.g. the `tiny` preset."
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "exported_by": EXPORTED_BY})
    eos_token = "<|endoftext|>" if tokenizer.token_to_id("<|endoftext|>") is not None else None
    eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
    (out / "config.json").write_text(json.dumps(hf_config(cfg.model, eos_id), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos_id, "eos_token_id": eos_id, "do_sample": False}, indent=2) + "\n"
    )
    tokenizer.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.data.seq_len,
        "clean_up_tokenization_spaces": False,
    }
    if eos_token:
        tok_cfg.update(eos_token=eos_token, bos_token=eos_token, pad_token=eos_token)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return {
        "architecture": "Qwen3MoeForCausalLM",
        "out_dir": str(out),
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
    }


def _read_hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    load_file = require("safetensors.torch", "import-hf (it reads safetensors)").load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"'{hf_dir}' has no model.safetensors (or its index): pass a Hugging Face model directory.")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(hf_dir / name)))
    return tensors


def model_config_from_hf(hf: dict, source: str) -> TransformerConfig:
    """The moetrain model a Qwen3-MoE config.json describes; refuses what moetrain cannot run
    exactly, naming the field."""
    if hf.get("model_type") != "qwen3_moe":
        raise ConfigError(
            f"{source}: model_type '{hf.get('model_type')}' is not supported; import-hf reads "
            "qwen3_moe (Qwen3-MoE) models."
        )
    layers = hf["num_hidden_layers"]
    dense = sorted(hf.get("mlp_only_layers") or [])
    rope = hf.get("rope_parameters") or {
        "rope_theta": hf.get("rope_theta", 10000.0),
        "rope_type": (hf.get("rope_scaling") or {}).get("rope_type", "default"),
    }
    problems = []
    if dense != list(range(len(dense))):
        problems.append(f"mlp_only_layers={dense} (moetrain's dense blocks come first)")
    if hf.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step={hf['decoder_sparse_step']}")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true")
    if hf.get("attention_bias"):
        problems.append("attention_bias=true")
    if hf.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings=true")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']}")
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope.get('rope_type')} (only plain RoPE)")
    if not hf.get("norm_topk_prob", False):
        problems.append("norm_topk_prob=false (moetrain exports and imports normalized top-k weights)")
    if problems:
        raise ConfigError(f"{source}: this Qwen3-MoE variant cannot be reproduced exactly: {'; '.join(problems)}.")
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    return TransformerConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=layers,
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        head_dim=hf.get("head_dim"),
        num_dense_layers=len(dense),
        dense_hidden=hf["intermediate_size"],
        qk_norm=True,
        peri_norm=False,
        norm_eps=hf["rms_norm_eps"],
        rope_theta=float(rope["rope_theta"]),
        moe=MoEConfig(
            num_experts=experts,
            top_k=hf["num_experts_per_tok"],
            expert_hidden=hf["moe_intermediate_size"],
            shared_hidden=0,
            gating=Gating.softmax,
            normalize_weights=True,
            restore_weight_scale=False,
            lb_loss_weight=hf.get("router_aux_loss_coef", 0.001),
        ),
    )


@torch.no_grad()
def import_hf(hf_dir: str | Path, out_dir: str | Path) -> dict:
    """A Qwen3-MoE directory (config.json + safetensors, per-expert or fused expert tensors) →
    a moetrain run directory holding config.yaml, tokenizer.json and a weights-only checkpoint
    `checkpoints/step-0`, which `generate`, `eval`, `export-hf` and `train --train.init_from=…` read."""
    require("safetensors.torch", "import-hf (it reads safetensors)")  # before any work
    hf_dir, out = Path(hf_dir), Path(out_dir)
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"'{hf_dir}' has no config.json: pass a Hugging Face model directory.")
    if ckpt.list_checkpoints(out):
        raise ConfigError(f"'{out}' already holds checkpoints: choose an empty directory for the import.")
    cfg = RunConfig(model=model_config_from_hf(json.loads(config_file.read_text()), str(config_file)))
    model = cfg.model.build(device="cpu")
    model.init_weights()
    tensors = _read_hf_tensors(hf_dir)
    expected = hf_state_dict(model)  # names (Hub layout) and shapes moetrain expects

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ConfigError(f"{hf_dir}: tensor '{name}' is missing (is this the model its config.json describes?).")
        return tensors[name].to(torch.float32)

    def fused(layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """transformers 5.x saves experts fused: gate_up_proj (E, 2F, D), down_proj (E, D, F)."""
        gu, dn = f"model.layers.{layer}.mlp.experts.gate_up_proj", f"model.layers.{layer}.mlp.experts.down_proj"
        return (take(gu), take(dn)) if gu in tensors else None

    model.embed.weight.copy_(take("model.embed_tokens.weight"))
    model.norm.weight.copy_(take("model.norm.weight"))
    model.lm_head.weight.copy_(take("lm_head.weight"))
    for i, block in enumerate(model.blocks.values()):
        p, a = f"model.layers.{i}", block.attn
        block.attn_norm.weight.copy_(take(f"{p}.input_layernorm.weight"))
        block.ffn_norm.weight.copy_(take(f"{p}.post_attention_layernorm.weight"))
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            getattr(a, ours).weight.copy_(take(f"{p}.self_attn.{theirs}.weight"))
        a.q_norm.weight.copy_(take(f"{p}.self_attn.q_norm.weight"))
        a.k_norm.weight.copy_(take(f"{p}.self_attn.k_norm.weight"))
        ffn = block.ffn
        if hasattr(ffn, "experts"):
            ffn.router.weight.copy_(take(f"{p}.mlp.gate.weight"))
            pair = fused(i)
            if pair is not None:
                ffn.experts.w_gate_up_E2FD.copy_(pair[0])
                ffn.experts.w_down_EDF.copy_(pair[1])
            else:
                for e in range(ffn.experts.num_experts):
                    ffn.experts.w_gate_up_E2FD[e].copy_(
                        torch.cat(
                            [take(f"{p}.mlp.experts.{e}.gate_proj.weight"), take(f"{p}.mlp.experts.{e}.up_proj.weight")]
                        )
                    )
                    ffn.experts.w_down_EDF[e].copy_(take(f"{p}.mlp.experts.{e}.down_proj.weight"))
        else:
            ffn.w_gate.weight.copy_(take(f"{p}.mlp.gate_proj.weight"))
            ffn.w_up.weight.copy_(take(f"{p}.mlp.up_proj.weight"))
            ffn.w_down.weight.copy_(take(f"{p}.mlp.down_proj.weight"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(cfg.to_yaml())
    extra = {"config.yaml": out / "config.yaml"}
    if (hf_dir / "tokenizer.json").is_file():
        extra["tokenizer.json"] = hf_dir / "tokenizer.json"
    path = ckpt.save_checkpoint(
        out, 0, {"model": ckpt.model_state_dict(model)}, {"step": 0, "imported_from": str(hf_dir)}, extra_files=extra
    )
    return {
        "architecture": "Qwen3MoeForCausalLM",
        "checkpoint": str(path),
        "config": str(out / "config.yaml"),
        "tensors": len(expected),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
