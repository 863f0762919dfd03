"""`moetrain export-hf --remote-code`: a model no native transformers class represents (the
reference shapes: softmax routing with a shared expert and weights × k; peri-norm; a non-zero
aux-free bias under softmax) exports with moetrain's own modeling file, which transformers loads
with `trust_remote_code=True` and which computes moetrain's logits and greedy text. Skipped where
the `hf` extra is absent."""

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import tiny_overrides  # noqa: E402
from test_hf_glm import cli, greedy, small_width, write_checkpoint  # noqa: E402

from moetrain.cli import main  # noqa: E402
from moetrain.inference import load_for_inference  # noqa: E402
from moetrain.presets import PRESETS, preset  # noqa: E402


def load_remote(path, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, local_files_only=True, **kw
    ).eval()


@pytest.fixture(scope="module")
def trained(real_text_dir, tmp_path_factory):
    """`tiny` with what no native class has: a shared expert under softmax, weights × k,
    peri-norm without the input norms, a normalized embedding, a moving aux-free bias, local
    blocks (a window of 8 positions in every other block) and attention sinks, a few steps on
    real text."""
    run = tmp_path_factory.mktemp("remote") / "run"
    extra = (
        "train.steps=4",
        "train.eval_every=0",
        "model.moe.shared_hidden=64",
        "model.moe.restore_weight_scale=true",
        "model.peri_norm=true",
        "model.embedding_norm=true",
        "model.pre_norm=false",
        "model.moe.bias_update_rate=0.01",
        "model.sliding_window=8",
        "model.attention_pattern=LG",
        "model.attention_sinks=true",
    )
    overrides = [o for o in tiny_overrides(real_text_dir, run, *extra) if not o.startswith("data.seq_len")]
    overrides = [
        o
        for o in overrides
        if not o.startswith("model.")
        or o.startswith(("model.moe.", "model.peri", "model.embedding", "model.sliding", "model.attention"))
    ]
    assert main(["train", "tiny", *[f"--{o}" for o in overrides], "--quiet"]) == 0
    return run


def test_a_model_without_a_native_class_loads_with_remote_code_and_generates_moetrains_text(trained, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export-hf", str(trained), str(tmp_path / "refused")]) == 2
    assert "--remote-code" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    summary = cli(capsys, "export-hf", trained, out, "--remote-code", "--dtype", "float32")
    assert summary["architecture"] == "MoetrainForCausalLM" and summary["remote_code"] is True
    assert (out / "modeling_moetrain.py").is_file()
    hf = load_remote(out, dtype=torch.float32)
    assert type(hf).__name__ == "MoetrainForCausalLM"
    model, cfg, tok = load_for_inference(trained)
    biases = [b for n, b in model.named_buffers() if n.endswith("expert_bias_E")]
    assert any(bool(b.abs().max() > 0) for b in biases), "the fixture's bias should have moved"
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg.model.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids).float() - hf(ids).logits.float()).abs().max().item()
    assert diff <= 1e-4, diff

    prompt = "To be, or not to be: that is the question"
    args = ["generate", str(trained), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "24", "--json"]
    capsys.readouterr()
    assert main(args) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    p = torch.tensor([tok.encode(prompt).ids])
    got = hf.generate(p, do_sample=False, max_new_tokens=24, attention_mask=torch.ones_like(p))[0, p.shape[1] :]
    eos = tok.token_to_id("<|endoftext|>")
    got = got.tolist()
    assert (got[: got.index(eos)] if eos in got else got) == want

    # a left-padded batch: the short prompt continues as it does alone
    short = torch.tensor([tok.encode("The king").ids])
    pad = p.shape[1] - short.shape[1]
    batch = torch.cat([torch.cat([torch.full((1, pad), eos), short], dim=1), p])
    mask = torch.cat([torch.cat([torch.zeros(1, pad), torch.ones_like(short)], dim=1), torch.ones_like(p)]).long()
    both = hf.generate(batch, do_sample=False, max_new_tokens=8, attention_mask=mask)
    alone = hf.generate(short, do_sample=False, max_new_tokens=8, attention_mask=torch.ones_like(short))
    assert both[0, batch.shape[1] :].tolist() == alone[0, short.shape[1] :].tolist()

    with torch.no_grad():  # sinks far from their trained values near 0: the modeling file has them too
        for ours, theirs in zip(model.blocks.values(), hf.blocks.values()):
            theirs.attn.sinks.copy_(ours.attn.sinks.normal_(0, 2))
        diff = (model(ids).float() - hf(ids).logits.float()).abs().max().item()
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("name", [p for p in PRESETS if p.startswith("ref-")])
def test_the_reference_shapes_export_with_remote_code(name, real_text_dir, tmp_path, capsys):
    """Every ref-* preset's architecture at test width (softmax, shared expert, × k, dense first
    blocks, its GQA and head dim): the remote-code export computes its logits and greedy tokens;
    in bf16 the router's weight and selection bias load in fp32, as the model keeps them."""
    small, seq_len = small_width(name), preset(name).data.seq_len
    model = write_checkpoint(tmp_path / "ckpt", small, real_text_dir / "tokenizer.json", seq_len, bias=True)
    cli(capsys, "export-hf", tmp_path / "ckpt", tmp_path / "hf", "--remote-code", "--dtype", "float32")
    hf = load_remote(tmp_path / "hf", dtype=torch.float32)
    ids = torch.randint(0, small.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(ids).float() - hf(ids).logits.float()).abs().max().item()
    assert diff <= 1e-4, (name, diff)
    got = hf.generate(ids[:1, :8], do_sample=False, max_new_tokens=6, attention_mask=torch.ones_like(ids[:1, :8]))
    assert got[0, 8:].tolist() == greedy(model, ids[:1, :8], 6)
    cli(capsys, "export-hf", tmp_path / "ckpt", tmp_path / "bf16", "--remote-code")
    bf16 = load_remote(tmp_path / "bf16")
    layer = str(small.num_dense_layers)
    assert bf16.embed.weight.dtype == torch.bfloat16
    assert bf16.blocks[layer].ffn.router.weight.dtype == torch.float32


def test_random_routing_is_refused_even_with_remote_code(real_text_dir, tmp_path, capsys):
    run = tmp_path / "run"
    overrides = tiny_overrides(real_text_dir, run, "train.steps=1", "train.eval_every=0", "model.moe.routing=random")
    assert main(["train", "tiny", *[f"--{o}" for o in overrides], "--quiet"]) == 0
    capsys.readouterr()
    assert main(["export-hf", str(run), str(tmp_path / "hf"), "--remote-code"]) == 2
    err = capsys.readouterr().err
    assert "model.moe.routing=random" in err and "Traceback" not in err


def test_moetrain_export_hf_remote_code_as_typed(trained, tmp_path):
    """`moetrain export-hf RUN OUT --remote-code` in a shell: one JSON line, exit 0, and the
    directory transformers needs (weights, config with its auto_map, the modeling file, tokenizer,
    model card tagged custom_code)."""
    out = subprocess.run(
        [sys.executable, "-m", "moetrain", "export-hf", str(trained), str(tmp_path / "hf"), "--remote-code"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["remote_code"] is True
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_moetrain.MoetrainForCausalLM"
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "- custom_code" in card and "trust_remote_code=True" in card
