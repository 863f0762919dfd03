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

from moetrain.cli import main  # noqa: E402
from moetrain.inference import load_for_inference  # noqa: E402

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


def random_dense(kind: str, path, real_text_dir):
    """A small dense model as transformers initializes it, every weight perturbed (the norms'
    too, so that a misplaced one shows), saved by transformers with the test tokenizer beside it."""
    config_cls, model_cls = CLASSES[kind]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**SMALL, tie_word_embeddings=kind.endswith("tied"))).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    hf.save_pretrained(path)
    (path / "tokenizer.json").write_bytes((real_text_dir / "tokenizer.json").read_bytes())
    return hf


def max_diff(model, hf) -> float:
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
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
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, ["rope_type=llama3"]),
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
