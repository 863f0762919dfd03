"""`moetrain export-hf` of the production architecture (shared expert, dense first blocks, GQA
with per-head QK-norm): with sigmoid gating it loads as transformers' native GLM-4-MoE and
computes the same logits (fp32, ≤ 1e-4) and greedy continuation; bf16 by default; sharded with
an index past --max-shard-size, written shard by shard (and rank by rank) from the DCP files in
bounded memory; import-hf reads it back bit for bit; group-limited routing with a routed scale
exports and imports too. Every ref-* preset, at small width: its
softmax router and normalized embedding are refused naming the reasons and the variant (sigmoid, a
plain embedding), which exports with equal logits. Skipped where the `hf` extra is absent."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import tiny_overrides  # noqa: E402
from support.distributed import run_distributed  # noqa: E402

from moetrain.cli import main  # noqa: E402
from moetrain.hf.arch import refusal, remote_problems, unsupported_features  # noqa: E402
from moetrain.inference import load_for_inference  # noqa: E402
from moetrain.model.config import Gating  # noqa: E402
from moetrain.presets import PRESETS, preset, resolve_config  # noqa: E402
from moetrain.train.checkpoint_index import SafeFileSystemReader  # noqa: E402
from moetrain.train.checkpoint_io import model_state_dict, save_checkpoint  # noqa: E402
from moetrain.train.config import RunConfig  # noqa: E402
from moetrain.train.run_dir import resolve_checkpoint  # noqa: E402

GLM = [
    "model.moe.gating=sigmoid",
    "model.moe.shared_hidden=32",  # one shared expert as wide as a routed one
    "model.moe.restore_weight_scale=true",
    "model.moe.bias_update_rate=0.01",
]


@pytest.fixture(scope="module")
def trained(real_text_dir, tmp_path_factory):
    """The production architecture at test width with sigmoid gating, after a few steps on real
    text (the aux-free biases have moved)."""
    run = tmp_path_factory.mktemp("glm") / "run"
    overrides = tiny_overrides(real_text_dir, run, "train.steps=4", "train.eval_every=0", *GLM)
    assert main(["train", "tiny", *[f"--{o}" for o in overrides], "--quiet"]) == 0
    return run


def hf_model(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()


def max_diff(model, hf, vocab: int) -> float:
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (model(ids).float() - hf(ids).logits.float()).abs().max().item()


def greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    """moetrain's model, argmax each next token over the whole sequence so far."""
    out = ids
    with torch.no_grad():
        for _ in range(steps):
            out = torch.cat([out, model(out)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out[0, ids.shape[1] :].tolist()


def cli(capsys, *args) -> dict:
    """Run a command that succeeds; its JSON line."""
    capsys.readouterr()
    assert main(list(map(str, args))) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_glm4_moe_export_has_the_same_logits_and_greedy_continuation(trained, tmp_path, capsys):
    summary = cli(capsys, "export-hf", trained, tmp_path / "hf", "--dtype", "float32")
    assert summary["architecture"] == "Glm4MoeForCausalLM" and summary["files"] == ["model.safetensors"]
    model, cfg, tok = load_for_inference(trained)
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    assert any(bool(m.router.expert_bias_E.abs().max() > 0) for m in model.moe_layers())  # the bias matters
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["routed_scaling_factor"] == 4.0 and config["n_shared_experts"] == 1
    assert config["first_k_dense_replace"] == 1 and config["max_position_embeddings"] == cfg.data.seq_len
    hf = hf_model(tmp_path / "hf")
    assert type(hf).__name__ == "Glm4MoeForCausalLM"  # native: no remote code
    assert max_diff(model, hf, cfg.model.vocab_size) <= 1e-4

    prompt = "To be, or not to be: that is the question"
    args = ["generate", trained, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "24", "--json"]
    want = cli(capsys, *args)["token_ids"]
    prompt_ids = torch.tensor([tok.encode(prompt).ids])
    got = hf.generate(prompt_ids, do_sample=False, max_new_tokens=24, attention_mask=torch.ones_like(prompt_ids))
    got = got[0, prompt_ids.shape[1] :].tolist()
    eos = tok.token_to_id("<|endoftext|>")
    assert (got[: got.index(eos)] if eos in got else got) == want


@torch.no_grad()
def test_bf16_is_the_default_and_only_rounds_the_weights(trained, tmp_path, capsys):
    from safetensors import safe_open

    summary = cli(capsys, "export-hf", trained, tmp_path / "hf", "--max-position-embeddings", "4096")
    assert summary["dtype"] == "bfloat16"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["max_position_embeddings"] == 4096
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    fp32 = {n for n, d in dtypes.items() if d == "F32"}
    assert fp32 == {n for n in dtypes if n.endswith(("mlp.gate.weight", "e_score_correction_bias"))}, fp32
    assert set(dtypes.values()) == {"F32", "BF16"}

    model, cfg, _ = load_for_inference(trained)
    for name, p in model.named_parameters():  # what the export did: round all but the router
        if not name.endswith("router.weight"):
            p.copy_(p.bfloat16().float())
    assert max_diff(model, hf_model(tmp_path / "hf"), cfg.model.vocab_size) <= 1e-4
    native = hf_model(tmp_path / "hf", dtype="auto")
    assert native.model.embed_tokens.weight.dtype == torch.bfloat16
    assert native.model.layers[1].mlp.gate.weight.dtype == torch.float32


def test_a_sharded_export_has_an_index_and_loads_in_transformers(trained, tmp_path, capsys, monkeypatch):
    whole = cli(capsys, "export-hf", trained, tmp_path / "whole", "--dtype", "float32")
    monkeypatch.setattr("moetrain.data.progress.LOG_EVERY_S", 0.0)  # a line a shard, as one every 30 s of a long one
    assert (
        main(["export-hf", str(trained), str(tmp_path / "sharded"), "--dtype", "float32", "--max-shard-size", "200KB"])
        == 0
    )
    out, err = capsys.readouterr()
    sharded, n = json.loads(out), len(json.loads(out)["files"])
    progress = [line.split(",")[0] for line in err.splitlines()]
    assert progress == [f"exporting: {k}/{n} shards" for k in (*range(1, n + 1), n)], err
    assert len(sharded["files"]) > 3 and not (tmp_path / "sharded" / "model.safetensors").exists()
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sharded["files"]
    assert index["metadata"]["total_size"] == whole["bytes"] == sharded["bytes"]
    sizes = [(tmp_path / "sharded" / f).stat().st_size for f in sharded["files"]]
    assert max(sizes) < 200_000 + 70_000  # one shard: ≤ 200 KB of tensors (or one larger tensor)
    a, b = hf_model(tmp_path / "whole"), hf_model(tmp_path / "sharded")
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)

    # Rank by rank (as under torchrun): two writers, each its every other shard, the same files.
    for rank in (1, 0):
        main_export_rank(trained, tmp_path / "ranks", rank, 2, max_shard_size="200KB", dtype="float32")
    for name in [*sharded["files"], "model.safetensors.index.json", "config.json"]:
        assert (tmp_path / "ranks" / name).read_bytes() == (tmp_path / "sharded" / name).read_bytes(), name

    # A later unsharded export into the same directory (--force: it replaces files) leaves no stale shard behind.
    cli(capsys, "export-hf", trained, tmp_path / "sharded", "--dtype", "float32", "--force")
    assert sorted(p.name for p in (tmp_path / "sharded").glob("model*")) == ["model.safetensors"]


def main_export_rank(run, out, rank, world, **kw):
    from moetrain.hf import export_hf

    return export_hf(run, out, rank=rank, world_size=world, **kw)


@torch.no_grad()
def test_import_round_trips_exactly(trained, tmp_path, capsys):
    original, _, _ = load_for_inference(trained)
    want = original.state_dict()
    cli(capsys, "export-hf", trained, tmp_path / "hf", "--dtype", "float32", "--max-shard-size", "300KB")
    assert cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "imported")["architecture"] == "Glm4MoeForCausalLM"
    model, cfg, _ = load_for_inference(tmp_path / "imported")
    assert cfg.model.moe.gating == Gating.sigmoid and cfg.model.moe.restore_weight_scale
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)  # biases too
    again = cli(
        capsys,
        "export-hf",
        tmp_path / "imported",
        tmp_path / "again",
        "--dtype",
        "float32",
        "--max-shard-size",
        "300KB",
    )
    for name in again["files"]:
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name

    # What transformers itself writes (its save_pretrained) imports to the same model.
    hf_model(tmp_path / "hf").save_pretrained(tmp_path / "resaved")
    (tmp_path / "resaved" / "tokenizer.json").write_bytes((tmp_path / "hf" / "tokenizer.json").read_bytes())
    assert main(["import-hf", str(tmp_path / "resaved"), str(tmp_path / "imported2")]) == 0
    model2, _, _ = load_for_inference(tmp_path / "imported2")
    assert all(torch.equal(t, want[n]) for n, t in model2.state_dict().items())

    # bf16: export → import → export gives the same files.
    bf16 = cli(capsys, "export-hf", trained, tmp_path / "bf16")
    assert main(["import-hf", str(tmp_path / "bf16"), str(tmp_path / "imported-bf16")]) == 0
    cli(capsys, "export-hf", tmp_path / "imported-bf16", tmp_path / "bf16-again")
    assert (tmp_path / "bf16-again" / bf16["files"][0]).read_bytes() == (
        tmp_path / "bf16" / bf16["files"][0]
    ).read_bytes()


def test_import_refuses_what_it_cannot_reproduce(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    base = {"model_type": "glm4_moe", "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts_per_tok": 2}
    for config, words in (
        (base | {"attention_bias": True}, ["attention_bias=true", "partial_rotary_factor=0.5"]),  # GLM-4.5's own
        # a routed scale and group-limited routing are read (model.moe.routed_scale, n_groups)
        (base | {"partial_rotary_factor": 1.0, "routed_scaling_factor": 2.5, "n_group": 2}, ["has no 'vocab_size'"]),
    ):
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
        assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words) and "Traceback" not in err, err


# ---- export from a distributed checkpoint, by several ranks, in bounded memory ------------------


def train_and_export(data_dir, run_dir, out_dir):
    """Every rank: train the GLM-shaped model under FSDP (each rank saves its shards of every
    entry), then write its share of the export's shards."""
    import torch.distributed as dist

    from moetrain.hf import export_hf
    from moetrain.train.trainer import Trainer

    overrides = tiny_overrides(
        data_dir, run_dir, "train.steps=3", "train.eval_every=0", "checkpoint.save_every=3", *GLM
    )
    cfg = resolve_config("tiny", [*overrides, "parallel.stack=fsdp", "train.device=cpu"])
    Trainer(cfg, quiet=True).fit()
    dist.barrier()
    summary = export_hf(run_dir, out_dir, dtype="float32", max_shard_size="150KB", rank=dist.get_rank(), world_size=2)
    dist.barrier()
    return summary


def test_export_of_a_distributed_checkpoint_by_two_ranks(real_text_dir, tmp_path):
    run, out = tmp_path / "run", tmp_path / "hf"
    summaries = run_distributed(train_and_export, 2, real_text_dir, run, out)
    stored = SafeFileSystemReader(str(resolve_checkpoint(run))).read_metadata().state_dict_metadata
    assert len(stored["model.embed.weight"].chunks) == 2  # FSDP: each rank saved half of each entry
    assert len(summaries[0]["files"]) > 2
    model, cfg, _ = load_for_inference(run)
    assert max_diff(model, hf_model(out), cfg.model.vocab_size) <= 1e-4


def export_by_rank(run, outs, *flags):
    """Every rank: `moetrain export-hf RUN OUTS[rank] FLAGS` (as torchrun starts it); the exit code
    and what it printed on stderr."""
    import contextlib
    import io

    import torch.distributed as dist

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["export-hf", str(run), str(outs[dist.get_rank()]), *flags])
    return code, err.getvalue()


def test_export_ranks_agree_on_their_flags_and_on_rank_0s_overwrite_check(trained, tmp_path):
    """Ranks given other OUT_DIRs left rank 0 waiting an hour for shards written elsewhere; without
    --force, rank 0 refused an OUT_DIR holding an export while the other ranks wrote their shards
    into it."""
    a, b = tmp_path / "a", tmp_path / "b"
    (code0, err0), (code1, err1) = run_distributed(export_by_rank, 2, trained, [a, b], timeout_s=120)
    assert code0 == code1 == 2 and err0 == err1, (err0, err1)
    assert f"out_dir={str(b)!r} there, {str(a)!r} on rank 0" in err0
    flags = ["--dtype", "float32", "--max-shard-size", "150KB"]
    assert [c for c, _ in run_distributed(export_by_rank, 2, trained, [a, a], *flags, timeout_s=120)] == [0, 0]
    before = {p.name: p.read_bytes() for p in a.iterdir()}
    assert len([n for n in before if n.endswith(".safetensors")]) > 2
    for code, err in run_distributed(export_by_rank, 2, trained, [a, a], "--max-shard-size", "150KB", timeout_s=120):
        assert code == 2 and "holds " in err and "Pass --force" in err, err
    assert {p.name: p.read_bytes() for p in a.iterdir()} == before  # not a shard replaced


RSS_PROBE = """
import json, re, sys, torch
from moetrain.hf import export_hf
torch.set_num_threads(1)  # speed only: OpenMP threads crawl on oversubscribed CI cores
def kib(field):  # this process's own figures (ru_maxrss would include the parent's, before exec)
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
before = kib("VmRSS")  # after the imports
summary = export_hf(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3])
print(json.dumps({"grew_bytes": kib("VmHWM") - before, "exported_bytes": summary["bytes"]}))
"""


def write_checkpoint(run: Path, model_cfg, tokenizer: Path, seq_len: int = 64, bias: bool = False):
    """A checkpoint of a randomly initialized model (norms and biases made non-trivial)."""
    cfg = RunConfig(model=model_cfg)
    cfg.data.seq_len = seq_len
    model = model_cfg.build(device="cpu")
    model.rope.init_weights()  # (Transformer.init_weights' per-expert generators take seconds here)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # norms not all ones, so that a swapped norm shows
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if p.ndim == 1 else p.normal_(0, 0.1, generator=g))
        for moe in model.moe_layers():
            moe.router.expert_bias_E.copy_(0.05 * torch.randn(moe.cfg.num_experts, generator=g) * bias)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    extra = {"config.yaml": run / "config.yaml", "tokenizer.json": tokenizer}
    save_checkpoint(run, 0, {"model": model_state_dict(model)}, {"step": 0}, extra_files=extra)
    model.eval()
    return model


def test_export_memory_is_one_read_group_not_the_model(real_text_dir, tmp_path):
    """A 100 MB checkpoint exported in 8 MB shards: the process grows by far less than the model
    (the former export held it twice, fp32)."""
    m = dataclasses.replace(
        preset("tiny").model,
        vocab_size=512,
        d_model=256,
        n_layers=3,
        moe=dataclasses.replace(preset("tiny").model.moe, num_experts=64, expert_hidden=256),
    )
    write_checkpoint(tmp_path / "run", m, real_text_dir / "tokenizer.json")
    probe = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(tmp_path / "run"), str(tmp_path / "hf"), "8MB"],
        capture_output=True,
        text=True,
        check=True,
    )
    figures = json.loads(probe.stdout.strip().splitlines()[-1])
    checkpoint_bytes = 2 * figures["exported_bytes"]  # fp32 entries, written as bf16
    assert checkpoint_bytes > 90e6
    assert figures["grew_bytes"] < 0.3 * checkpoint_bytes, figures


# ---- every ref-* preset at small width; every preset's verdict ----------------------------------


def small_width(name: str):
    """The preset's architecture at test width: its dense-block count, GQA ratio, explicit head
    dim (unequal to d_model / heads where the preset's is), top-k, shared-to-routed ratio, weight
    normalization and scale, norm placement, RoPE base and norm epsilon are kept."""
    m = preset(name).model
    head_dim = 16 if m.resolved_head_dim * m.n_heads == m.d_model else 24
    moe = dataclasses.replace(
        m.moe, num_experts=16, expert_hidden=16, shared_hidden=16 * (m.moe.shared_hidden // m.moe.expert_hidden)
    )
    small = dataclasses.replace(
        m,
        vocab_size=512,
        d_model=64,
        n_layers=m.num_dense_layers + 2,
        n_heads=4,
        n_kv_heads=4 * m.n_kv_heads // m.n_heads,
        head_dim=head_dim,
        moe=moe,
    )
    small.validate()
    return small


@pytest.mark.parametrize("name", [p for p in PRESETS if p.startswith("ref-")])
def test_ref_preset_at_small_width_refused_with_softmax_and_exported_with_sigmoid(
    name, real_text_dir, tmp_path, capsys
):
    small, seq_len = small_width(name), preset(name).data.seq_len
    tokenizer = real_text_dir / "tokenizer.json"
    write_checkpoint(tmp_path / "softmax", small, tokenizer, seq_len)
    assert main(["export-hf", str(tmp_path / "softmax"), str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    for reason in ("softmax gating with a shared expert", "model.moe.gating=sigmoid", "model.embedding_norm=false"):
        assert reason in err, (reason, err)
    assert not (tmp_path / "refused").exists()

    sigmoid = dataclasses.replace(small.moe, gating=Gating.sigmoid)
    variant = dataclasses.replace(small, embedding_norm=False, moe=sigmoid)
    model = write_checkpoint(tmp_path / "sigmoid", variant, tokenizer, seq_len, bias=True)
    summary = cli(capsys, "export-hf", tmp_path / "sigmoid", tmp_path / "hf", "--dtype", "float32")
    assert summary["architecture"] == "Glm4MoeForCausalLM" and summary["max_position_embeddings"] == seq_len
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["first_k_dense_replace"] == small.num_dense_layers and config["head_dim"] == small.head_dim
    assert config["num_key_value_heads"] == small.n_kv_heads and config["routed_scaling_factor"] == 4.0
    assert max_diff(model, hf_model(tmp_path / "hf"), small.vocab_size) <= 1e-4


def test_every_preset_exports_or_names_the_variant_that_does():
    verdicts = {}
    for name in PRESETS:
        m = preset(name).model
        problems = unsupported_features(m, expert_bias_nonzero=False)
        verdicts[name] = not problems
        if problems:
            text = refusal(m, problems)
            assert "model.moe.gating=sigmoid" in text or m.moe.gating == Gating.sigmoid, name
            assert ("model.peri_norm=false" in text) == m.peri_norm, name
            assert ("model.embedding_norm=false" in text) == m.embedding_norm, name
            assert ("model.pre_norm=true" in text) == (not m.pre_norm), name
            assert ("model.sliding_window" in text) == (m.sliding_window > 0), name
            assert "--remote-code` exports it" in text, name
        variant = dataclasses.replace(
            m,
            peri_norm=False,
            pre_norm=True,
            embedding_norm=False,
            sliding_window=0,
            moe=dataclasses.replace(m.moe, gating=Gating.sigmoid),
        )
        assert unsupported_features(variant, expert_bias_nonzero=True) == [], name
    assert [n for n, ok in verdicts.items() if ok] == ["tiny", "dsv3-tiny", "dsv3-671b"]


@pytest.mark.parametrize("change", ["drop", "add"])
def test_a_plan_that_misses_or_invents_an_entry_is_refused_before_any_file(
    trained, tmp_path, capsys, monkeypatch, change
):
    """A model option that `unsupported_features` does not refuse and `tensor_plan` does not map
    (a contributor's new tensor) exported without it, or stopped with a KeyError."""
    from moetrain.hf import arch, convert

    def plan(m):
        whole = arch.tensor_plan(m)
        return whole[:-1] if change == "drop" else [*whole, arch.HfTensor("model.new.weight", "blocks.0.new.weight")]

    monkeypatch.setattr(convert, "tensor_plan", plan)
    assert main(["export-hf", str(trained), str(tmp_path / "hf")]) == 2
    entry = arch.tensor_plan(load_for_inference(trained)[1].model)[-1].entry if change == "drop" else "blocks.0.new"
    err = capsys.readouterr().err
    assert "plan does not map the checkpoint's entries " + entry in err and "--remote-code" in err, err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--dtype", "float16"], "--dtype"),
        (["--max-shard-size", "lots"], "--max-shard-size='lots'"),
        (["--max-position-embeddings", "0"], "--max-position-embeddings=0"),
    ],
)
def test_bad_export_flags_are_one_paragraph(trained, tmp_path, capsys, flags, words):
    assert main(["export-hf", str(trained), str(tmp_path / "hf"), *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


@torch.no_grad()
def test_group_limited_routing_with_a_routed_scale_exports_as_glm4_moe(real_text_dir, tmp_path, capsys):
    """Sigmoid top-4 from the best 3 of 4 groups of 2 experts, weights × 2.5: n_group, topk_group
    and routed_scaling_factor, the same logits, and back; moetrain's own modeling file has neither."""
    m = preset("tiny").model
    moe = dataclasses.replace(
        m.moe, gating=Gating.sigmoid, expert_hidden=32, shared_hidden=32, n_groups=4, topk_groups=3, routed_scale=2.5
    )
    m = dataclasses.replace(m, vocab_size=512, d_model=64, n_layers=3, moe=moe)
    model = write_checkpoint(tmp_path / "ckpt", m, real_text_dir / "tokenizer.json", bias=True)
    cli(capsys, "export-hf", tmp_path / "ckpt", tmp_path / "hf", "--dtype", "float32")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["n_group"], config["topk_group"], config["routed_scaling_factor"]) == (4, 3, 2.5)
    assert max_diff(model, hf_model(tmp_path / "hf"), m.vocab_size) <= 1e-5
    cli(capsys, "import-hf", tmp_path / "hf", tmp_path / "imported")
    _, cfg, _ = load_for_inference(tmp_path / "imported")
    assert (cfg.model.moe.n_groups, cfg.model.moe.topk_groups, cfg.model.moe.routed_scale) == (4, 3, 2.5)
    assert "model.moe.n_groups=4" in remote_problems(m)[0]
