"""`moetrain upcycle` (src/moetrain/upcycle.py): a dense `tiny` trained a few steps on real text,
upcycled with and without a shared expert, with the routed weights × k, and under sigmoid gating:
its logits are the dense model's, its first training step's loss is the dense model's continuing
on the same batch, and what is not an upcycle is refused naming the key and the fix."""

import json

import pytest
import torch
from conftest import tiny_overrides

from moetrain.cli import main
from moetrain.inference import load_for_inference

HIDDEN = 32  # tiny_overrides' model.moe.expert_hidden: the dense MLP's hidden size too


def run(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dense(real_text_dir, tmp_path_factory):
    """A dense `tiny` (every block a SwiGLU of hidden 32), 4 steps on real text."""
    run_dir = tmp_path_factory.mktemp("dense") / "run"
    extra = ("model.num_dense_layers=3", f"model.dense_hidden={HIDDEN}", "train.steps=4", "train.eval_every=0")
    assert main(["train", "tiny", *[f"--{o}" for o in tiny_overrides(real_text_dir, run_dir, *extra)], "--quiet"]) == 0
    return run_dir


UPCYCLES = {
    "8 experts, top-2": ["--model.num_dense_layers=1", "--model.moe.top_k=2"],
    "shared expert, weights × k": [
        "--model.num_dense_layers=1",
        f"--model.moe.shared_hidden={HIDDEN}",
        "--model.moe.restore_weight_scale=true",
        "--model.moe.top_k=3",
    ],
    "sigmoid, every block": ["--model.num_dense_layers=0", "--model.moe.gating=sigmoid"],
    "grouped sigmoid, weights × 2.5": [
        "--model.num_dense_layers=1",
        "--model.moe.gating=sigmoid",
        "--model.moe.n_groups=4",
        "--model.moe.topk_groups=2",
        "--model.moe.routed_scale=2.5",
    ],
}


@pytest.mark.parametrize("name", list(UPCYCLES))
def test_the_upcycled_model_computes_the_dense_models_logits(dense, tmp_path, capsys, name):
    out = tmp_path / "moe"
    summary = run(capsys, "upcycle", dense, out, *UPCYCLES[name])
    assert summary["moe_blocks"] == ([0, 1, 2] if "every" in name else [1, 2]) and summary["experts"] == 8
    model_d, _, _ = load_for_inference(dense)
    model_u, cfg_u, _ = load_for_inference(out)
    assert cfg_u.model.num_moe_layers == len(summary["moe_blocks"])
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense_logits, moe_logits = model_d(ids), model_u(ids)
    assert (moe_logits - dense_logits).abs().max() <= 1e-5 * dense_logits.abs().max(), name
    experts = model_u.blocks["2"].ffn.experts.w_gate_up_E2FD
    assert torch.equal(experts[0], experts[7])  # copies, which training pulls apart


def test_its_first_training_step_has_the_dense_models_loss(dense, real_text_dir, tmp_path, capsys):
    """The dense model and its upcycle, each trained on from its weights with the same seed and
    data: the same first batch, the same loss."""
    out = tmp_path / "moe"
    run(capsys, "upcycle", dense, out, "--model.num_dense_layers=1")
    losses = {}
    for name, config in (("dense", dense / "config.yaml"), ("moe", out / "config.yaml")):
        run_dir = tmp_path / f"{name}-on"
        flags = [f"--checkpoint.init_from={dense}"] if name == "dense" else []  # the upcycle's config names out
        flags += [f"--run-dir={run_dir}"]
        flags += ["--train.steps=1", "--train.eval_every=0", f"--data.sources=[{real_text_dir}]", "--quiet"]
        assert main(["train", str(config), *flags]) == 0
        losses[name] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["lm_loss"]
    assert losses["moe"] == pytest.approx(losses["dense"], rel=1e-5), losses


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--model.num_dense_layers=1", "--model.d_model=128"], "model.d_model=128 differs from the dense model's 64"),
        (["--model.num_dense_layers=1", "--model.moe.expert_hidden=16"], "set model.moe.expert_hidden=32"),
        (["--model.num_dense_layers=1", "--model.moe.normalize_weights=false"], "model.moe.normalize_weights=true"),
        (["--model.num_dense_layers=3"], "leaves no MoE block"),
        (
            ["--model.num_dense_layers=1", "--model.dense_hidden=64"],
            "the blocks that stay dense need model.dense_hidden=32",
        ),
        (["--model.num_dense_layers=1", "--model.moe.routing=random"], "set model.moe.routing=learned"),
    ],
)
def test_what_is_not_an_upcycle_is_refused_naming_the_fix(dense, tmp_path, capsys, flags, words):
    assert main(["upcycle", str(dense), str(tmp_path / "moe"), *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert not (tmp_path / "moe").exists()


def test_a_model_larger_than_the_machines_memory_is_refused(dense, tmp_path, capsys, monkeypatch):
    """upcycle builds the whole MoE model in fp32 host memory: past it the kernel killed it without a word."""
    from moetrain.train import run_dir

    memory = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 128}  # 512 KiB: the dense model fits, the MoE one does not
    monkeypatch.setattr(run_dir.os, "sysconf", memory.__getitem__)
    assert main(["upcycle", str(dense), str(tmp_path / "moe"), "--model.num_dense_layers=1"]) == 2
    err = capsys.readouterr().err
    assert "The upcycled checkpoint is built whole in this machine's memory" in err and "512.0 KiB" in err, err
    assert not (tmp_path / "moe").exists()
