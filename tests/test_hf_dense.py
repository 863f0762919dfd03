"""Dense models through `import-hf` and `export-hf`: a Qwen3ForCausalLM (tied and untied head) and
a LlamaForCausalLM saved by transformers import with transformers' logits and greedy tokens;
`moetrain upcycle` of the import (top-2 of 4 experts, with a shared expert) computes the same
logits, and its first training step has the dense model's loss; a dense moetrain model exports
back as the same class; what moetrain cannot express is refused naming the field."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_glm import greedy  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from moetrain.cli import main  # noqa: E402
from moetrain.generation import generate_ids  # noqa: E402
from moetrain.hf.arch import model_config_from_hf  # noqa: E402
from moetrain.inference import load_for_inference  # noqa: E402
from moetrain.model.config import RopeScaling, RopeScalingConfig  # noqa: E402
from moetrain.model.rope import RotaryEmbedding  # noqa: E402

SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # not hidden_size / heads
    max_position_embeddings=128,
    rope_theta=10000.0,
)
CLASSES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen3-tied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
}


def cli(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def random_dense(kind: str, path, real_text_dir, **fields):
    """A small dense model as transformers initializes it, every weight perturbed (the norms'
    too, so that a misplaced one shows), saved by transformers with the test tokenizer beside it."""
    config_cls, model_cls = CLASSES[kind]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**SMALL | fields, tie_word_embeddings=kind.endswith("tied"))).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    hf.save_pretrained(path)
    (path / "tokenizer.json").write_bytes((real_text_dir / "tokenizer.json").read_bytes())
    return hf


def max_diff(model, hf, T: int = 48) -> float:
    ids = torch.randint(0, 512, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (model(ids) - hf(ids).logits).abs().max().item()


@pytest.mark.parametrize("kind", list(CLASSES))
def test_a_dense_model_saved_by_transformers_imports_with_its_logits(kind, real_text_dir, tmp_path, capsys):
    hf = random_dense(kind, tmp_path / "hf", real_text_dir)
    capsys.readouterr()
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["architecture"] == type(hf).__name__
    assert ("tie_word_embeddings=true" in err) == kind.endswith("tied"), err  # the head, untied, says so
    model, cfg, _ = load_for_inference(tmp_path / "imported")
    m = cfg.model
    assert m.num_moe_layers == 0 and m.qk_norm == kind.startswith("qwen3") and m.resolved_dense_hidden == 96
    assert max_diff(model, hf) <= 1e-5
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(3))
    want = hf.generate(ids, do_sample=False, max_new_tokens=16, attention_mask=torch.ones_like(ids))
    assert greedy(model, ids, 16) == want[0, 8:].tolist()


UPCYCLES = {
    "top-2 of 4": ["--model.moe.num_experts=4", "--model.moe.top_k=2"],
    "shared expert": ["--model.moe.num_experts=4", "--model.moe.top_k=2", "--model.moe.shared_hidden=96"],
}


@pytest.mark.parametrize("kind", ["qwen3-tied", "llama"])
@pytest.mark.parametrize("name", list(UPCYCLES))
def test_the_upcycled_import_computes_the_dense_models_logits(kind, name, real_text_dir, tmp_path, capsys):
    hf = random_dense(kind, tmp_path / "hf", real_text_dir)
    cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "dense")
    summary = cli(
        capsys, "upcycle", tmp_path / "dense", tmp_path / "moe", "--model.num_dense_layers=1", *UPCYCLES[name]
    )
    assert summary["moe_blocks"] == [1, 2] and summary["experts"] == 4
    model, _, _ = load_for_inference(tmp_path / "moe")
    assert max_diff(model, hf) <= 1e-5


def test_the_upcycled_imports_first_step_has_the_dense_models_loss(real_text_dir, tmp_path, capsys):
    """The imported Qwen3 and its upcycle, each trained on from its weights with the same seed and
    data: the same first batch, the same loss."""
    random_dense("qwen3-tied", tmp_path / "hf", real_text_dir)
    cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "dense")
    cli(capsys, "upcycle", tmp_path / "dense", tmp_path / "moe", "--model.num_dense_layers=0", *UPCYCLES["top-2 of 4"])
    losses = {}
    for name in ("dense", "moe"):
        flags = [f"--checkpoint.init_from={tmp_path / name}", f"--run-dir={tmp_path / f'{name}-on'}"]
        flags += [f"--data.sources=[{real_text_dir}]", "--data.seq_len=64", "--train.global_batch_size=8"]
        flags += ["--train.micro_batch_size=4", "--train.steps=1", "--train.eval_every=0", "--quiet"]
        assert main(["train", str(tmp_path / name / "config.yaml"), *flags]) == 0, capsys.readouterr().err
        losses[name] = json.loads((tmp_path / f"{name}-on" / "metrics.jsonl").read_text().splitlines()[0])["lm_loss"]
    assert losses["moe"] == pytest.approx(losses["dense"], rel=1e-5), losses


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_a_dense_moetrain_model_exports_as_the_same_class(kind, real_text_dir, tmp_path, capsys):
    hf = random_dense(kind, tmp_path / "hf", real_text_dir)
    cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "imported")
    summary = cli(capsys, "export-hf", tmp_path / "imported", tmp_path / "back", "--dtype", "float32")
    assert summary["architecture"] == type(hf).__name__
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True).eval()
    assert type(back) is type(hf)
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)


@pytest.mark.parametrize(
    "kind, change, words",
    [
        ("qwen3", {"use_sliding_window": True, "sliding_window": 16}, ["use_sliding_window=true"]),
        ("qwen3", {"attention_bias": True}, ["attention_bias=true"]),
        ("llama", {"mlp_bias": True}, ["mlp_bias=true"]),
        (
            "llama",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}},
            ["rope_type=longrope"],
        ),
        (
            "llama",
            {"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 4.0, "truncate": False}},
            ["yarn with attention_factor"],
        ),
        ("llama", {"hidden_act": "gelu"}, ["hidden_act=gelu"]),
        ("llama", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, ["rope_type=linear"]),
        ("qwen3", {"layer_types": ["full_attention", "sliding_attention"] * 2}, ["layer_types with sliding_attention"]),
    ],
)
def test_what_moetrain_cannot_express_is_refused_naming_the_field(kind, change, words, tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    config = CLASSES[kind][0](**SMALL).to_dict() | change
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot be reproduced exactly" in err and "Traceback" not in err, err
    assert all(w in err for w in words), err


LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
"""Llama 3.1's RoPE scaling at test size: of the 16 pairs of a 32-wide head (wavelengths 2π·10^(i/4))
pair 0 (under 32 / 4) is kept, pairs 1–2 blended, the others (over 32 / 1) turn 4 times slower."""


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}
"""YaRN at test size: pairs 0–2 of a 32-wide head ramp from kept to 4 times slower, the rest are
slowed; cos and sin × (0.1·0.707·ln 4 + 1) / (0.1·ln 4 + 1) ≈ 0.96 (and, in DeepSeek-V3's latent
attention, the softmax scale × (0.1·ln 4 + 1)²)."""
SCALINGS = {
    "llama3-test": (32, LLAMA3),
    "llama-3.1": (128, LLAMA3 | {"rope_theta": 5e5, "factor": 8.0, "original_max_position_embeddings": 8192}),
    "llama-3.2": (64, LLAMA3 | {"rope_theta": 5e5, "factor": 32.0, "original_max_position_embeddings": 8192}),
    "llama3-narrow": (16, LLAMA3 | {"factor": 2.0, "low_freq_factor": 2.0, "high_freq_factor": 3.0}),
    "yarn-test": (32, YARN),
    "yarn-deepseek-v3": (64, YARN | {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0}),
    "yarn-qwen3": (
        128,
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
}


@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_frequencies_and_attention_factor_are_transformers_bit_for_bit(name):
    """Each scaling as import-hf reads it from the config.json of a Llama with it."""
    head_dim, rope = SCALINGS[name]
    config = transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=int(rope["factor"] * rope["original_max_position_embeddings"]),
        rope_parameters=dict(rope),
    )
    want, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    ours = RotaryEmbedding(head_dim, rope["rope_theta"], model_config_from_hf(config.to_dict(), "x").rope_scaling)
    ours.init_weights()
    assert torch.equal(ours.inv_freq, want) and ours.attention_factor == attention_factor


@pytest.mark.parametrize("rope", [LLAMA3, YARN], ids=["llama3", "yarn"])
def test_a_llama_with_scaled_rope_imports_and_exports_with_its_logits(rope, real_text_dir, tmp_path, capsys):
    """Positions to 120 (past 32, where every band is scaled its own way): transformers' logits
    and greedy tokens (recomputed and through the KV cache); without the scaling they are far off.
    Exported back: the same class, the same RoPE fields, the same logits."""
    hf = random_dense("llama", tmp_path / "hf", real_text_dir, rope_parameters=dict(rope))
    cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "imported")
    model, cfg, _ = load_for_inference(tmp_path / "imported")
    scaling = cfg.model.rope_scaling.to_dict()
    assert scaling["type"] == rope["rope_type"] and all(scaling[k] == v for k, v in rope.items() if k[:5] != "rope_")
    assert max_diff(model, hf, 120) <= 1e-5
    ids = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(3))
    want = hf.generate(ids, do_sample=False, max_new_tokens=16, attention_mask=torch.ones_like(ids))
    assert greedy(model, ids, 16) == generate_ids(model, ids[0].tolist(), 16) == want[0, 100:].tolist()  # KV cache
    summary = cli(capsys, "export-hf", tmp_path / "imported", tmp_path / "back", "--dtype", "float32")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True).eval()
    assert summary["architecture"] == "LlamaForCausalLM" and back.config.rope_parameters == hf.config.rope_parameters
    ids = torch.randint(0, 512, (2, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)
    model.rope.scaling, model.rope.attention_factor = RopeScalingConfig(), 1.0  # plain RoPE
    model.rope.init_weights()
    assert max_diff(model, hf, 120) > 0.1


def test_the_4x_rope_scaling_field_imports_as_the_5x_rope_parameters():
    """transformers 4.x's config.json: rope_theta beside rope_scaling (its type under "type" in older
    files); original_max_position_embeddings, when absent, is max_position_embeddings."""
    five = transformers.LlamaConfig(**SMALL, rope_parameters=LLAMA3).to_dict()
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    four = five | {"rope_parameters": None, "rope_scaling": scaling}
    older = four | {"rope_scaling": {"type" if k == "rope_type" else k: v for k, v in scaling.items()}}
    configs = [model_config_from_hf(c, "config.json") for c in (five, four, older)]
    assert configs[0] == configs[1] == configs[2] and configs[0].rope_scaling.type == RopeScaling.llama3
    del four["rope_scaling"]["original_max_position_embeddings"]
    assert model_config_from_hf(four, "config.json").rope_scaling.original_max_position_embeddings == 128


@pytest.mark.parametrize(
    "flag, words",
    [
        ("--model.rope_scaling.type=ntk", ["model.rope_scaling.type", "llama3", "yarn"]),
        ("--model.rope_scaling.factor=0", ["model.rope_scaling.factor", "positive"]),
        ("--model.rope_scaling.low_freq_factor=4", ["model.rope_scaling.high_freq_factor=4.0", "low_freq_factor=4.0"]),
    ],
)
def test_rope_scaling_keys_are_checked_naming_the_key(flag, words, capsys):
    assert main(["config", "tiny", flag]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err for w in words), err


def test_remote_code_refuses_rope_scaling(real_text_dir, tmp_path, capsys):
    random_dense("llama", tmp_path / "hf", real_text_dir, rope_parameters=LLAMA3)
    cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "imported")
    assert main(["export-hf", str(tmp_path / "imported"), str(tmp_path / "out"), "--remote-code"]) == 2
    err = capsys.readouterr().err
    assert "model.rope_scaling.type=llama3" in err and "without --remote-code" in err and "Traceback" not in err, err
