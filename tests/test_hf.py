"""`moetrain export-hf` of softmax models: transformers loads the export offline with its native
Qwen3-MoE class and computes the same logits and the same greedy continuation as moetrain; a
variant no native class represents is refused naming the feature (tests/test_hf_glm.py: sigmoid
gating, GLM-4-MoE, sharding, memory, the ref-* presets). Skipped where the `hf` extra is absent."""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import tiny_overrides  # noqa: E402

from moetrain.cli import main  # noqa: E402
from moetrain.inference import load_for_inference  # noqa: E402


@pytest.fixture(scope="module")
def trained(real_text_dir, tmp_path_factory):
    """`tiny` (its own shape: 8 experts top-4, 8k vocabulary) after a few steps on real text."""
    run = tmp_path_factory.mktemp("hf") / "run"
    overrides = [
        o
        for o in tiny_overrides(real_text_dir, run, "train.steps=4", "train.eval_every=0")
        if not o.startswith(("model.", "data.seq_len"))
    ]
    assert main(["train", "tiny", *[f"--{o}" for o in overrides], "--quiet"]) == 0
    return run


def test_export_loads_natively_with_the_same_logits_tokens_and_greedy_text(trained, tmp_path, capsys):
    check_native(trained, tmp_path / "hf", capsys)


def test_weights_times_k_fold_into_the_experts_down_projections(real_text_dir, tmp_path, capsys):
    """restore_weight_scale=true (the router's weights × k, Olmo-core's choice) exports to
    Qwen3-MoE, which has no routed scale, with each expert's down_proj × k: the same logits and
    greedy text in fp32; in bf16 with k = 4 the written weights are exactly 4 × the bf16 weights
    (a power of two scales without rounding)."""
    from safetensors import safe_open

    from moetrain.hf.convert import CheckpointEntries
    from moetrain.train.run_dir import resolve_checkpoint

    run = tmp_path / "run"
    overrides = tiny_overrides(real_text_dir, run, "train.steps=4", "train.eval_every=0")
    overrides = [o for o in overrides if not o.startswith(("model.", "data.seq_len"))]
    overrides.append("model.moe.restore_weight_scale=true")
    assert main(["train", "tiny", *[f"--{o}" for o in overrides], "--quiet"]) == 0
    check_native(run, tmp_path / "hf", capsys)
    assert main(["export-hf", str(run), str(tmp_path / "bf16")]) == 0
    _, cfg, _ = load_for_inference(run)
    assert cfg.model.moe.top_k == 4
    layer = cfg.model.num_dense_layers
    entries = CheckpointEntries(resolve_checkpoint(run), cfg.model)
    w = entries.read([f"blocks.{layer}.ffn.experts.w_down_EDF/3"])[f"blocks.{layer}.ffn.experts.w_down_EDF/3"]
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        got = f.get_tensor(f"model.layers.{layer}.mlp.experts.3.down_proj.weight")
    assert torch.equal(got, 4 * w.to(torch.bfloat16)) and torch.equal(got, (4 * w).to(torch.bfloat16))


def check_native(trained, out, capsys):
    """Export `trained` in fp32 to `out`: transformers' native class gives moetrain's logits
    (within 1e-4), token ids and greedy continuation."""
    capsys.readouterr()
    assert main(["export-hf", str(trained), str(out), "--dtype", "float32"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["architecture"] == "Qwen3MoeForCausalLM"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"  # native: no remote code
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    model, cfg, ours = load_for_inference(trained)
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())

    ids = torch.randint(0, cfg.model.vocab_size, (4, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids).float() - hf(ids).logits.float()).abs().max().item()
    assert diff <= 1e-4, diff

    prompt = "To be, or not to be: that is the question"
    assert tok(prompt)["input_ids"] == ours.encode(prompt).ids
    assert (
        main(["generate", str(trained), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "32", "--json"])
        == 0
    )
    want = json.loads(capsys.readouterr().out)["token_ids"]
    prompt_ids = torch.tensor([ours.encode(prompt).ids])
    got = hf.generate(prompt_ids, do_sample=False, max_new_tokens=32, attention_mask=torch.ones_like(prompt_ids))
    got = got[0, prompt_ids.shape[1] :].tolist()
    eos = ours.token_to_id("<|endoftext|>")
    assert (got[: got.index(eos)] if eos in got else got) == want


@pytest.mark.parametrize(
    "override, feature",
    [
        ("model.moe.shared_hidden=32", "shared expert"),
        ("model.qk_norm=false", "qk_norm=false"),
        ("model.peri_norm=true", "peri_norm"),
        ("model.embedding_norm=true", "embedding_norm"),
        ("model.pre_norm=false model.peri_norm=true", "pre_norm=false"),
    ],
)
def test_a_variant_without_a_native_class_is_refused_naming_the_feature(
    real_text_dir, tmp_path, capsys, override, feature
):
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "tiny",
                *[
                    f"--{o}"
                    for o in tiny_overrides(
                        real_text_dir, run, "train.steps=1", "train.eval_every=0", *override.split()
                    )
                ],
                "--quiet",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["export-hf", str(run), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and feature in err and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists()


def test_import_round_trips_exactly_and_training_continues_from_it(trained, real_text_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from moetrain.presets import resolve_config
    from moetrain.train.trainer import Trainer

    hf, imported, again = tmp_path / "hf", tmp_path / "imported", tmp_path / "hf-again"
    assert main(["export-hf", str(trained), str(hf), "--dtype", "float32"]) == 0
    assert main(["import-hf", str(hf), str(imported)]) == 0
    assert main(["export-hf", str(imported), str(again), "--dtype", "float32"]) == 0
    a, b = load_file(hf / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    original, cfg0, _ = load_for_inference(trained)
    model, _, _ = load_for_inference(imported)
    want = original.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in model.state_dict().items())

    # transformers 5.x layout (fused expert tensors) imports to the same model.
    fused_dir = tmp_path / "hf-fused"
    fused_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (fused_dir / name).write_bytes((hf / name).read_bytes())
    tensors, E = dict(a), cfg0.model.moe.num_experts
    for layer in range(cfg0.model.num_dense_layers, cfg0.model.n_layers):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [
            torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")])
            for e in range(E)
        ]
        tensors[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(E)])
    save_file(tensors, str(fused_dir / "model.safetensors"))
    assert main(["import-hf", str(fused_dir), str(tmp_path / "imported-fused")]) == 0
    model2, _, _ = load_for_inference(tmp_path / "imported-fused")
    assert all(torch.equal(t, want[n]) for n, t in model2.state_dict().items())

    # Continue training the import: its config.yaml alone starts a fresh run from its weights.
    cfg = resolve_config(
        str(imported / "config.yaml"),
        [
            f"data.sources=[{real_text_dir}]",
            f"train.run_dir={tmp_path / 'continued'}",
            "train.steps=2",
            "train.eval_every=0",
            "logging.tensorboard=false",
            "logging.plot=false",
            "train.device=cpu",
        ],
    )
    trainer = Trainer(cfg, quiet=True)
    assert all(torch.equal(t, want[n]) for n, t in trainer.engine.model.state_dict().items())
    summary = trainer.fit()
    assert summary["steps"] == 2


def test_import_refuses_another_architecture(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "model_type 'mixtral'" in err and "qwen3_moe" in err and "llama" in err and "Traceback" not in err


def test_export_writes_a_model_card_with_the_hubs_metadata(trained, tmp_path, capsys):
    """README.md opens with the Hub's metadata block (library, license, pipeline, the
    architecture's model_type as a tag) and says what the model is: shape, parameters total and
    active, steps and tokens trained, data, validation loss (none here: the fixture does not
    evaluate), the moetrain version and commit; `--license` sets the id and a malformed one is
    refused naming the flag."""
    import yaml

    from moetrain import __version__

    out = tmp_path / "hf"
    assert main(["export-hf", str(trained), str(out), "--license", "mit"]) == 0
    text = (out / "README.md").read_text()
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["library_name"] == "transformers" and meta["license"] == "mit"
    assert meta["pipeline_tag"] == "text-generation" and "qwen3_moe" in meta["tags"]
    _, cfg, _ = load_for_inference(trained)
    from moetrain.model.counting import count_params

    counts = count_params(cfg.model)
    assert f"{counts.total:,} total, {counts.active:,} active" in text
    tokens = 4 * cfg.train.global_batch_size * cfg.data.seq_len
    assert f"4 steps, {tokens:,} tokens (sequences of {cfg.data.seq_len})" in text
    assert "| validation loss | not evaluated |" in text and f"moetrain {__version__} (commit " in text
    capsys.readouterr()
    assert main(["export-hf", str(trained), str(tmp_path / "bad"), "--license", "Apache 2.0"]) == 2
    err = capsys.readouterr().err
    assert "--license='Apache 2.0'" in err and "Traceback" not in err


def test_an_import_without_a_tokenizer_says_so_and_what_to_copy(trained, tmp_path, capsys):
    """Many Hub directories hold tokenizer.model but no tokenizer.json: the import says at once
    that the checkpoint has none and how to write one, and eval names the file to copy."""
    hf, out = tmp_path / "hf", tmp_path / "imported"
    assert main(["export-hf", str(trained), str(hf)]) == 0
    (hf / "tokenizer.json").unlink()
    capsys.readouterr()
    assert main(["import-hf", str(hf), str(out)]) == 0
    assert f"import-hf: {hf} has no tokenizer.json" in capsys.readouterr().err
    assert main(["eval", str(out), "--text", str(hf / "README.md")]) == 2
    assert "has no tokenizer.json to encode text with: copy the model's own" in capsys.readouterr().err


def test_the_model_cards_validation_loss_is_read_past_a_torn_last_line(tmp_path):
    """A run killed while appending to metrics.jsonl still has its validation losses."""
    from moetrain.hf.convert import _validation_loss

    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "val_loss": 3.5}\n{"step": 4, "lo')
    assert _validation_loss(tmp_path, 4) == (2, 3.5)


def test_moetrain_import_hf_keeps_the_training_set_up_or_says_what_it_assumed(trained, tmp_path):
    """`moetrain import-hf HF OUT` of an export takes the run's context, document masking, batch,
    validation tokens, optimizer, schedule, MoE loss weights and aux-free bias rate from the
    moetrain_config.yaml the export wrote (continuing training does not silently change the
    objective); without it (a model from elsewhere) it assumes the defaults, no longer than the
    model's max_position_embeddings, and says so on stderr."""
    import subprocess
    import sys

    import yaml

    hf = tmp_path / "hf"
    assert main(["export-hf", str(trained), str(hf)]) == 0
    run = yaml.safe_load((hf / "moetrain_config.yaml").read_text())
    run["data"]["document_masking"], run["model"]["moe"]["bias_update_rate"] = True, 1e-3  # not the defaults
    (hf / "moetrain_config.yaml").write_text(yaml.safe_dump(run))

    def import_hf(src, out):
        done = subprocess.run(
            [sys.executable, "-m", "moetrain", "import-hf", str(src), str(out)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1]), yaml.safe_load((out / "config.yaml").read_text()), done

    summary, cfg, done = import_hf(hf, tmp_path / "back")
    assert summary["training_setup"]["from"] == str(hf / "moetrain_config.yaml") and "assumed" not in done.stderr
    assert cfg["data"]["seq_len"] == run["data"]["seq_len"]
    assert cfg["train"]["global_batch_size"] == run["train"]["global_batch_size"]
    assert cfg["optim"] == run["optim"] and cfg["schedule"] == run["schedule"]
    assert cfg["model"]["moe"] == run["model"]["moe"] and cfg["data"]["document_masking"]
    assert cfg["train"]["eval_tokens"] == run["train"]["eval_tokens"]
    # OUT_DIR is laid out as a run directory: what prepare-data --tokenizer OUT_DIR/tokenizer.json reads
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()

    (hf / "moetrain_config.yaml").unlink()
    summary, cfg, done = import_hf(hf, tmp_path / "elsewhere")
    assert summary["training_setup"]["from"].startswith("assumed")
    assert cfg["data"]["seq_len"] <= json.loads((hf / "config.json").read_text())["max_position_embeddings"]
    assert "says nothing of how the model was trained; assumed data.seq_len=" in done.stderr
    assert f"(at most its config.json's max_position_embeddings={cfg['data']['seq_len']})" in done.stderr
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 0}))  # no bound to name
    summary, cfg, done = import_hf(hf, tmp_path / "unbounded")
    assert "max_position_embeddings" not in done.stderr and cfg["data"]["seq_len"] > 0
    (hf / "config.json").write_text(json.dumps(config))
    assert main(["import-hf", str(hf), str(hf), "--force"]) == 0  # into its own directory: its tokenizer stays


def test_import_refuses_a_config_or_weights_it_cannot_trust(trained, tmp_path, capsys):
    """config.json that is not JSON or not an object, one with fewer layers than the weights,
    quantized (int8) weights and NaN weights: each refused in one paragraph naming the file or the
    tensor; and eval of outputs that are not finite stops instead of printing NaN, which is not
    JSON."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "hf"
    assert main(["export-hf", str(trained), str(src)]) == 0
    capsys.readouterr()

    def refused(case, edit, *words):
        case_dir = tmp_path / case
        shutil.copytree(src, case_dir)
        edit(case_dir)
        assert main(["import-hf", str(case_dir), str(tmp_path / f"out-{case}")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err, err
        for word in words:
            assert word in err, (word, err)

    def weights(fn):
        def edit(d):
            tensors = load_file(d / "model.safetensors")
            fn(tensors)
            save_file(tensors, d / "model.safetensors")

        return edit

    config = json.loads((src / "config.json").read_text())
    refused("broken", lambda d: (d / "config.json").write_text("{not json"), "config.json' is not a JSON file")
    refused("binary", lambda d: (d / "config.json").write_bytes(b"\xff\xfe\x00"), "is not a JSON file")
    refused("list", lambda d: (d / "config.json").write_text("[1, 2]"), "holds a JSON list")
    fewer = {**config, "num_hidden_layers": config["num_hidden_layers"] - 1}
    refused("fewer", lambda d: (d / "config.json").write_text(json.dumps(fewer)), "the weights hold", "layers")
    name = "model.layers.0.self_attn.q_proj.weight"
    refused("int8", weights(lambda t: t.update({name: t[name].to(torch.int8)})), name, "int8", "quantized")
    refused("nan", weights(lambda t: t[name].view(-1)[0].fill_(float("nan"))), name, "NaN or infinite")


def test_eval_of_outputs_that_are_not_finite_stops(trained, tmp_path, capsys, monkeypatch):
    import moetrain.cli.models as models

    monkeypatch.setattr(models, "text_loss", lambda *a: {"loss": float("nan"), "perplexity": float("nan"), "tokens": 9})
    (tmp_path / "t.txt").write_text("Some text.")
    assert main(["eval", str(trained), "--text", str(tmp_path / "t.txt")]) == 2
    err = capsys.readouterr().err
    assert "the loss is nan over 9 tokens" in err and "Traceback" not in err
