"""`moetrain export-hf` of multi-head latent attention (dsv3-tiny at test width): it loads as
transformers' native DeepSeek-V3 and computes the same logits (fp32, ≤ 1e-4) and greedy
continuation, with and without a query latent (in bf16 its router stays fp32); import-hf reads
it back bit for bit, and reads a randomly initialized DeepseekV3ForCausalLM that transformers
saved (RoPE interleaved or not) to the logits transformers computes. What DeepSeek-V3 cannot
express is refused naming the key. Skipped where the `hf` extra is absent."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import tiny_overrides  # noqa: E402
from test_hf_dense import LLAMA3, YARN  # noqa: E402
from test_hf_glm import cli, greedy, hf_model, max_diff, write_checkpoint  # noqa: E402

from moetrain.cli import main  # noqa: E402
from moetrain.generation import generate_ids  # noqa: E402
from moetrain.hf.arch import refusal, unsupported_features  # noqa: E402
from moetrain.inference import load_for_inference  # noqa: E402
from moetrain.model.config import Gating  # noqa: E402
from moetrain.presets import preset  # noqa: E402


@pytest.fixture(scope="module")
def trained(real_text_dir, tmp_path_factory):
    """dsv3-tiny at test width (both latents, a dense block, 16 experts top-4 and a shared one,
    sigmoid with the aux-free bias), a few steps on real text: the biases have moved."""
    run = tmp_path_factory.mktemp("dsv3") / "run"
    overrides = tiny_overrides(
        real_text_dir, run, "train.steps=4", "train.eval_every=0", "model.moe.bias_update_rate=0.01"
    )
    assert main(["train", "dsv3-tiny", *[f"--{o}" for o in overrides], "--quiet"]) == 0
    return run


def hf_greedy(hf, ids: torch.Tensor, steps: int) -> list[int]:
    got = hf.generate(ids, do_sample=False, max_new_tokens=steps, attention_mask=torch.ones_like(ids))
    return got[0, ids.shape[1] :].tolist()


def test_deepseek_v3_export_has_the_same_logits_and_greedy_continuation(trained, tmp_path, capsys):
    summary = cli(capsys, "export-hf", trained, tmp_path / "hf", "--dtype", "float32")
    assert summary["architecture"] == "DeepseekV3ForCausalLM"
    model, cfg, tok = load_for_inference(trained)
    m = cfg.model
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    assert any(bool(layer.router.expert_bias_E.abs().max() > 0) for layer in model.moe_layers())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["rope_interleave"] is False
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["v_head_dim"]) == (
        m.q_lora_rank,
        m.kv_lora_rank,
        m.v_head_dim,
    )
    assert config["n_shared_experts"] == 2 and config["first_k_dense_replace"] == 1  # shared 64 = 2 × 32
    assert (config["n_group"], config["topk_group"], config["routed_scaling_factor"]) == (4, 2, 2.5)
    hf = hf_model(tmp_path / "hf")
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"  # native: no remote code
    assert max_diff(model, hf, m.vocab_size) <= 1e-4

    prompt = "To be, or not to be: that is the question"
    args = ["generate", trained, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8", "--json"]
    want = cli(capsys, *args)["token_ids"]  # moetrain's generation: the absorbed latent cache
    got = hf_greedy(hf, torch.tensor([tok.encode(prompt).ids]), 8)
    eos = tok.token_to_id("<|endoftext|>")
    assert (got[: got.index(eos)] if eos in got else got) == want


@torch.no_grad()
def test_bf16_keeps_the_router_in_fp32(trained, tmp_path, capsys):
    """The default dtype: every tensor bf16 but the router's weight and selection bias, which
    transformers keeps in fp32 (`_keep_in_fp32_modules_strict`) and loads so."""
    from safetensors import safe_open

    cli(capsys, "export-hf", trained, tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        fp32 = {n for n in f.keys() if f.get_slice(n).get_dtype() == "F32"}
    assert fp32 and all(n.endswith(("mlp.gate.weight", "e_score_correction_bias")) for n in fp32), fp32
    native = hf_model(tmp_path / "hf", dtype="auto")
    assert native.model.embed_tokens.weight.dtype == torch.bfloat16
    assert native.model.layers[1].mlp.gate.weight.dtype == torch.float32


@torch.no_grad()
def test_import_round_trips_exactly(trained, tmp_path, capsys):
    original, cfg, _ = load_for_inference(trained)
    want = original.state_dict()
    cli(capsys, "export-hf", trained, tmp_path / "hf", "--dtype", "float32")
    assert cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "imported")["architecture"] == "DeepseekV3ForCausalLM"
    model, imported, _ = load_for_inference(tmp_path / "imported")
    fields = ("attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    assert all(getattr(imported.model, f) == getattr(cfg.model, f) for f in fields)
    assert imported.model.moe == dataclasses.replace(cfg.model.moe, **_not_in_hf(imported.model.moe))
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)  # biases too
    again = cli(capsys, "export-hf", tmp_path / "imported", tmp_path / "again", "--dtype", "float32")
    for name in again["files"]:
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name


def _not_in_hf(moe) -> dict:
    """The MoE fields a Hugging Face config does not carry (training's, not the model's)."""
    return {"z_loss_weight": moe.z_loss_weight, "bias_update_rate": moe.bias_update_rate}


@torch.no_grad()
def test_without_a_query_latent_and_with_weights_times_k(real_text_dir, tmp_path, capsys):
    """q_lora_rank 0 (queries projected from x, as DeepSeek-V2-Lite) and weights × k: q_proj and
    routed_scaling_factor = k; the export computes moetrain's logits and greedy tokens and
    imports back to the same weights."""
    m = preset("dsv3-tiny").model
    m = dataclasses.replace(
        m,
        vocab_size=512,
        d_model=64,
        n_layers=3,
        q_lora_rank=0,
        moe=dataclasses.replace(
            m.moe, restore_weight_scale=True, routed_scale=1.0, num_experts=8, expert_hidden=32, shared_hidden=32
        ),
    )
    model = write_checkpoint(tmp_path / "ckpt", m, real_text_dir / "tokenizer.json", bias=True)
    cli(capsys, "export-hf", tmp_path / "ckpt", tmp_path / "hf", "--dtype", "float32")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["q_lora_rank"] is None and config["routed_scaling_factor"] == 4.0
    hf = hf_model(tmp_path / "hf")
    assert hf.model.layers[0].self_attn.q_proj is not None
    assert max_diff(model, hf, m.vocab_size) <= 1e-4
    ids = torch.randint(0, m.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    assert hf_greedy(hf, ids, 8) == greedy(model, ids, 8)
    cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "imported")
    back, cfg, _ = load_for_inference(tmp_path / "imported")
    assert cfg.model.q_lora_rank == 0 and cfg.model.moe.restore_weight_scale
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in back.state_dict().items())


SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
    max_position_embeddings=128,
    initializer_range=0.1,
)
"""A small DeepSeek-V3: group routing and the routed scale off (`GROUPED` turns them on)."""
GROUPED = {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
"""DeepSeek-V3's routing at this size: the best 2 of 4 groups of 2 experts, weights × 2.5."""


def random_deepseek_v3(path, real_text_dir, **fields):
    """A small DeepseekV3ForCausalLM as transformers initializes it (norms and selection biases
    made non-trivial), saved by transformers with the test tokenizer beside it."""
    config = transformers.DeepseekV3Config(**SMALL | fields)
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape))
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(8))
    hf.save_pretrained(path)
    (path / "tokenizer.json").write_bytes((real_text_dir / "tokenizer.json").read_bytes())
    return hf


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"rope_interleave": False},
        {"q_lora_rank": None},
        GROUPED,
        {"rope_parameters": LLAMA3},
        {"rope_parameters": YARN},
    ],
    ids=["interleaved", "rotate-half", "no-q-latent", "grouped", "llama3-rope", "yarn-rope"],
)
@torch.no_grad()
def test_a_deepseek_v3_saved_by_transformers_imports_with_its_logits(fields, real_text_dir, tmp_path, capsys):
    hf = random_deepseek_v3(tmp_path / "hf", real_text_dir, **fields)
    cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "imported")
    model, cfg, _ = load_for_inference(tmp_path / "imported")
    moe = cfg.model.moe
    assert cfg.model.is_mla and moe.gating == Gating.sigmoid and cfg.model.num_dense_layers == 1
    assert (moe.n_groups, moe.topk_groups, moe.routed_scale) == ((4, 2, 2.5) if fields == GROUPED else (1, 1, 1.0))
    assert cfg.model.rope_scaling.type == fields.get("rope_parameters", {}).get("rope_type", "none")
    assert max_diff(model, hf, 512) <= 1e-5
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(3))
    assert greedy(model, ids, 8) == hf_greedy(hf, ids, 8) == generate_ids(model, ids[0].tolist(), 8)  # KV cache
    if "rope_parameters" in fields:  # exported back with the same RoPE fields
        cli(capsys, "export-hf", tmp_path / "imported", tmp_path / "back", "--dtype", "float32")
        assert transformers.AutoConfig.from_pretrained(tmp_path / "back").rope_parameters == hf.config.rope_parameters


def test_what_deepseek_v3_cannot_express_is_refused_naming_the_key():
    m = preset("dsv3-tiny").model
    assert unsupported_features(m, expert_bias_nonzero=True) == []
    for change, words in (
        ({"moe": dataclasses.replace(m.moe, gating=Gating.softmax)}, ["softmax gating", "model.moe.gating=sigmoid"]),
        ({"norm_eps": 1e-5}, ["model.norm_eps=1e-05", "model.norm_eps=1e-06"]),
        ({"moe": dataclasses.replace(m.moe, shared_hidden=96)}, ["model.moe.shared_hidden=96", "DeepSeek-V3"]),
        ({"peri_norm": True}, ["model.peri_norm=false", "DeepseekV3ForCausalLM"]),
        ({"embedding_norm": True}, ["model.embedding_norm=false"]),
        ({"sliding_window": 8}, ["model.sliding_window=8"]),
    ):
        variant = dataclasses.replace(m, **change)
        problems = unsupported_features(variant, expert_bias_nonzero=True)
        text = refusal(variant, problems)
        assert problems and all(w in text for w in words), (change, text)
        assert "--remote-code` exports it" not in text  # the modeling file has no latent attention


def test_latent_attention_is_refused_with_remote_code(real_text_dir, tmp_path, capsys):
    m = dataclasses.replace(preset("dsv3-tiny").model, vocab_size=512, d_model=64, n_layers=2)
    write_checkpoint(tmp_path / "ckpt", m, real_text_dir / "tokenizer.json")
    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--remote-code"]) == 2
    err = capsys.readouterr().err
    assert "model.attention=mla" in err and "without --remote-code" in err and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists()


def test_import_refuses_what_moetrain_cannot_reproduce(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    base = transformers.DeepseekV3Config(**SMALL).to_dict()
    for change, words in (
        ({}, []),  # the base is importable as far as its config goes: only its weights are missing
        ({"rms_norm_eps": 1e-5}, ["rms_norm_eps=1e-05"]),
        ({"num_key_value_heads": 8}, ["num_key_value_heads=8"]),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}}, ["rope_type=dynamic"]),
        ({"rope_parameters": YARN | {"attention_factor": 1.5}}, ["yarn with attention_factor"]),
    ):
        (tmp_path / "hf" / "config.json").write_text(json.dumps(base | change))
        assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and all(w in err for w in words), err
        assert ("cannot be reproduced exactly" in err) == bool(words), err
