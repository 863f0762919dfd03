"""Lion (optim.name=lion, src/moetrain/optim/lion.py) on one process: the update against the
paper's formula in plain PyTorch (fp32, weight decay, clipping factor, a skipped step; split
masters, bf16 gradients and bf16 moments), the config and the planner.

Every layout against one process, resuming across layouts and the other rules' checkpoints
refused: tests/parallel/test_muon_layouts.py; resuming bit for bit: tests/train/test_trainer.py."""

import dataclasses

import pytest
import torch

from moetrain.errors import ConfigError
from moetrain.optim.lion import Lion
from moetrain.optim.rule import UpdateGroup
from moetrain.optim.split_master import join, split_fp32

LR, WD, BETAS = 3e-4, 0.5, (0.9, 0.99)


def _reference(w, g, m, lr, weight_decay, coef=1.0):
    """The paper's update, written out: (new parameter, new momentum), fp32."""
    beta1, beta2 = BETAS
    g = g * coef
    c = beta1 * m + (1 - beta1) * g
    return w * (1 - lr * weight_decay) - lr * torch.sign(c), beta2 * m + (1 - beta2) * g


def _tensors(n=1000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("coef", [None, 0.25])
def test_one_update_is_the_formula(fused, coef):
    w, g, m = _tensors()
    w2, m2 = w.clone(), m.clone()
    groups = [
        UpdateGroup([w2[:600]], [g[:600]], ([m2[:600]],), weight_decay=WD),
        UpdateGroup([w2[600:]], [g[600:]], ([m2[600:]],), weight_decay=0.0),
    ]
    step = torch.zeros(())
    lr = torch.tensor(LR) if fused else LR  # the device path takes a 0-d learning rate
    coef_t = torch.tensor(coef) if coef is not None else None
    Lion(BETAS).update(groups, step, lr=lr, grad_coef=coef_t, skip=torch.tensor(False), fused=fused)
    want_w, want_m = _reference(w, g, m, LR, WD, coef or 1.0)
    want_w[600:] = _reference(w, g, m, LR, 0.0, coef or 1.0)[0][600:]
    torch.testing.assert_close(w2, want_w, rtol=0, atol=0)
    torch.testing.assert_close(m2, want_m, rtol=0, atol=0)
    assert step.item() == 1
    # every element moved by lr·sign(c) plus the decay: Lion's update is ±lr
    assert torch.allclose((w * (1 - LR * WD) - w2)[:600].abs(), torch.full((600,), LR), atol=1e-7)


def test_a_skipped_step_changes_nothing_and_nothing_is_read_on_the_host():
    from support.host_sync import forbid_host_sync

    w, g, m = _tensors()
    hi, lo = split_fp32(w)
    m16 = m.bfloat16()
    before = [t.clone() for t in (w, m, hi, lo, m16)]
    step = torch.zeros(())
    groups = [
        UpdateGroup([w], [g], ([m],), weight_decay=WD),
        UpdateGroup([hi], [g.bfloat16()], ([m16],), weight_decay=WD, los=[lo]),
    ]
    with forbid_host_sync():
        Lion(BETAS).update(
            groups, step, lr=torch.tensor(LR), grad_coef=torch.tensor(0.5), skip=torch.tensor(True), fused=True
        )
    assert all(torch.equal(a, b) for a, b in zip(before, (w, m, hi, lo, m16)))
    assert step.item() == 0


def test_split_masters_bf16_gradients_and_bf16_moments_are_the_fp32_formula_rounded_once():
    """On a split master the update runs on the joined fp32 value (exact) and is split back; a
    bf16 moment is read in fp32 and the new one rounded to nearest."""
    w, g, m = _tensors(seed=1)
    hi, lo = split_fp32(w)
    g16, m16 = g.bfloat16(), m.bfloat16()
    want_w, want_m = _reference(w, g16.float(), m16.float(), LR, WD)
    group = UpdateGroup([hi], [g16], ([m16],), weight_decay=WD, los=[lo])
    Lion(BETAS).update([group], torch.zeros(()), lr=LR, grad_coef=None, skip=None, fused=False)
    torch.testing.assert_close(join(hi, lo), want_w, rtol=0, atol=0)
    assert torch.equal(hi, split_fp32(join(hi, lo))[0])
    torch.testing.assert_close(m16, want_m.bfloat16(), rtol=0, atol=0)


def test_the_config_takes_lion_and_builds_its_rule():
    from moetrain.optim.config import OptimizerName
    from moetrain.presets import resolve_config

    cfg = resolve_config("tiny", ["optim.name=lion", "optim.lion_betas=[0.95,0.98]"])
    assert cfg.optim.rule() == Lion((0.95, 0.98))
    assert OptimizerName.lion.state == ("step", *Lion.state)
    # bf16 weights stay opt-in for Lion (they default on for AdamW only)
    assert not cfg.optim.resolved_bf16_weights(cfg.parallel, torch.bfloat16, "cuda")
    # a name without a rule (a contributor's new member of OptimizerName) is not trained as AdamW
    assert [type(dataclasses.replace(cfg.optim, name=n).rule()).__name__ for n in OptimizerName] == [
        "AdamW",
        "AdamW",
        "Lion",
    ]
    with pytest.raises(ConfigError, match="optim.name='sgd' is not one of adamw, muon, lion"):
        dataclasses.replace(cfg.optim, name="sgd").rule()


@pytest.mark.parametrize(
    "overrides, ratio",
    [
        ([], 4 / 8),  # replicated: one fp32 moment instead of two
        (["optim.moments_dtype=bf16"], 2 / 4),
        (["parallel.shard_optimizer=true"], 8 / 12),  # fp32 master + moments per shard element
        (["parallel.stack=fsdp"], 4 / 8),
    ],
)
def test_the_planner_counts_one_moment_and_a_cheaper_step(overrides, ratio):
    from moetrain.plan import plan
    from moetrain.presets import resolve_config

    sizes = ["train.micro_batch_size=4", "train.global_batch_size=4"]
    adamw, lion = (
        plan(resolve_config("bench-tiny64e-l6", [*sizes, *overrides, f"optim.name={name}"]), 4, "h200")
        for name in ("adamw", "lion")
    )
    assert lion.memory_gib["optimizer"] == pytest.approx(ratio * adamw.memory_gib["optimizer"], rel=1e-2)
    assert lion.time_s["optimizer"] < adamw.time_s["optimizer"]
