"""Multi-token prediction (model.mtp_depth, src/moetrain/model/mtp.py):

- the modules' shapes (one dense block each, a 2D → D projection);
- the returned loss is the next-token loss bit for bit; the logged per-depth losses and the
  gradients (the shared embedding's included) are those of a direct computation over the
  truncated sequences (no roll), with the weight λ/K;
- bad input is refused naming the fields; a Hugging Face export leaves the modules out and its
  README says so; checkpoints keep them.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from moetrain.errors import ConfigError
from moetrain.presets import resolve_config

SMALL = ["model.d_model=64", "model.n_layers=3", "model.moe.expert_hidden=32", "model.vocab_size=512"]


def _model(depth, weight=0.3):
    cfg = resolve_config("tiny", [*SMALL, f"model.mtp_depth={depth}", f"model.mtp_loss_weight={weight}"])
    model = cfg.model.build()
    model.init_weights(seed=0)
    return model


def test_each_depth_is_a_projection_and_one_dense_block():
    model = _model(2)
    assert len(model.mtp.depths) == 2
    for k, module in enumerate(model.mtp.depths, start=1):
        assert module.depth == k and not module.block.is_moe
        assert tuple(module.proj.weight.shape) == (64, 128)
    assert _model(0).mtp is None


def _direct(model, tokens, targets, weight, depth):
    """The module docstring's formula over truncated sequences: depth k sees positions
    0 … T − k − 1 only, with the embeddings of tokens k … T − 1."""
    T = tokens.shape[1]
    h = model.run_blocks(model.embed(tokens), list(model.blocks))
    main = F.cross_entropy(model.lm_head(model.norm(h)).flatten(0, 1), targets.flatten())
    losses = []
    for k, module in enumerate(model.mtp.depths, start=1):
        cos, sin = model.rope.cos_sin(T - k)
        h = module(h[:, : T - k], model.embed(tokens[:, k:]), cos, sin, None)
        logits = model.lm_head(model.norm(h))
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets[:, k:].flatten()))
    return main, torch.stack(losses), main + weight * torch.stack(losses).mean()


def test_the_loss_is_the_next_token_loss_and_the_depths_train_as_computed_directly():
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (2, 24))
    targets = torch.roll(tokens, -1, 1)
    model, plain = _model(2, weight=0.5), _model(0)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    model.train(), plain.train()
    loss = model(tokens, None, targets)
    assert torch.equal(loss, plain(tokens, None, targets))  # the value: the next-token loss, bit for bit
    loss.backward()
    logged = model.mtp.end_step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _, direct_losses, total = _direct(model, tokens, targets, 0.5, 2)
    total.backward()
    assert torch.allclose(logged, direct_losses.detach(), rtol=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-7), name
    # the shared embedding learns from the shifted tokens: MTP adds to its gradient
    model.zero_grad()
    _direct(model, tokens, targets, 0.5, 2)[0].backward()
    assert not torch.allclose(grads["embed.weight"], model.embed.weight.grad, atol=1e-7)


def test_evaluation_runs_the_main_model_alone():
    model = _model(1)
    model.eval()
    tokens = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        model(tokens, None, torch.roll(tokens, -1, 1))
    assert model.mtp.end_step() is None


@pytest.mark.parametrize(
    "overrides, world, words",
    [
        (["model.mtp_depth=1", "parallel.cp=2"], 2, ["model.mtp_depth=1", "parallel.cp=2", "parallel.cp=1"]),
        (["model.mtp_depth=8", "data.seq_len=8"], 1, ["model.mtp_depth=8", "data.seq_len=8"]),
        (["model.mtp_depth=-1"], 1, ["model.mtp_depth"]),
    ],
)
def test_impossible_multi_token_settings_are_refused(overrides, world, words):
    with pytest.raises(ConfigError) as e:
        resolve_config("tiny", ["train.global_batch_size=8", "train.micro_batch_size=4", *overrides]).validate(
            world_size=world
        )
    for word in words:
        assert word in str(e.value), str(e.value)


def test_checkpoints_keep_the_modules_and_the_export_leaves_them_out(tiny_cfg, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from moetrain.hf import export_hf
    from moetrain.train.trainer import Trainer

    run = tmp_path / "run"
    cfg = tiny_cfg(run, "model.mtp_depth=2", "train.steps=2", "checkpoint.save_every=2", "train.eval_every=0")
    Trainer(cfg, quiet=True).fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("mtp_loss" in r and r["loss"] > r["lm_loss"] for r in records)
    metadata = (run / "checkpoints" / "step-2" / ".metadata").read_bytes()
    assert b"model.mtp.depths.1.proj.weight" in metadata
    summary = export_hf(run / "checkpoints" / "step-2", tmp_path / "hf")
    readme = (tmp_path / "hf" / "README.md").read_text()
    assert "2 multi-token prediction modules" in readme and "not part of this export" in readme
    with safe_open(str(tmp_path / "hf" / summary["files"][0]), framework="pt") as f:
        names = list(f.keys())
    assert names and not any("mtp" in n for n in names)
    Trainer(tiny_cfg(run, "model.mtp_depth=2", "train.steps=3", "train.eval_every=0"), resume=True, quiet=True).fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records][-1] == 3 and "mtp_loss" in records[-1]


def test_config_help_lists_the_new_keys(capsys):
    from moetrain.cli import main

    with pytest.raises(SystemExit):
        main(["config", "--help"])
    out = capsys.readouterr().out
    for key in ("model.mtp_depth", "model.mtp_loss_weight", "parallel.cp", "optim.name"):
        assert f"  {key}  (" in out, key
