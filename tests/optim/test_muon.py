"""Muon (optim.name=muon, src/moetrain/optim/muon.py) on one process:

- Newton–Schulz gives each matrix of a batch singular values near 1 and its singular vectors;
- one update is the formula of the module docstring, computed here directly, for a Linear and
  for stacked experts (gate and up apart), with weight decay, Nesterov momentum, the clipping
  factor, and a skipped step that changes nothing;
- which parameters are Muon's (the blocks' matrices) and which stay AdamW's;
- bad input is refused by name: a 1-D parameter, Muon with bf16 weights.

Layouts and checkpoints: tests/parallel/test_muon_layouts.py.
"""

import pytest
import torch
from torch import nn

from moetrain.errors import ConfigError
from moetrain.model.experts import GroupedExperts
from moetrain.optim.muon import (
    Muon,
    MuonConfig,
    check_matrices,
    muon_matrices,
    newton_schulz,
)
from moetrain.presets import resolve_config

MUON = "optim.name=muon"


@pytest.mark.parametrize("shape", [(1, 32, 64), (3, 64, 16), (2, 24, 24)])
def test_newton_schulz_pushes_singular_values_near_one_and_keeps_the_vectors(shape):
    g = torch.Generator().manual_seed(0)
    # singular values spread over two decades (5 steps lift σ ≥ ~1e-3 · ‖U‖_F near 1, not less)
    k, m, n = shape
    left = torch.linalg.qr(torch.randn(k, m, min(m, n), generator=g)).Q
    right = torch.linalg.qr(torch.randn(k, n, min(m, n), generator=g)).Q
    u = left @ torch.diag_embed(torch.logspace(-2, 0, min(m, n)).expand(k, -1) * 7.0) @ right.mT
    o = newton_schulz(u, steps=5, dtype=torch.float32)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.25, s
    # the same singular vectors: O ≈ U_u V_uᵀ, whose singular values are exactly 1
    uu, _, vh = torch.linalg.svd(u, full_matrices=False)
    polar = uu @ vh
    cos = torch.nn.functional.cosine_similarity(o.flatten(1), polar.flatten(1), dim=1)
    assert (cos > 0.95).all(), cos


class _Toy(nn.Module):
    """A Linear and stacked experts, with a norm Muon must leave alone."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({"0": nn.ModuleDict({"lin": nn.Linear(12, 8, bias=False)})})
        self.blocks["0"]["experts"] = GroupedExperts(3, 12, 5)
        self.norm = nn.LayerNorm(12)


def _reference_step(w, g, m, beta, lr, wd, coef, count, rows, cols):
    """The module docstring's formula, per matrix, in float64."""
    g = g.double() * (1.0 if coef is None else float(coef))
    m = beta * m + g
    u = g + beta * m
    mats = u.reshape(count, rows, cols)
    o = newton_schulz(mats, 5, torch.float64).double().reshape(w.shape)
    scale = 0.2 * max(rows, cols) ** 0.5
    return w.double() * (1 - lr * wd) - lr * scale * o, m


def test_one_update_is_the_formula_and_a_skipped_step_changes_nothing():
    torch.manual_seed(0)
    model = _Toy()
    for p in model.parameters():
        nn.init.normal_(p, std=0.1)
    shapes = muon_matrices(model)
    named = [(n, p) for n, p in model.named_parameters() if id(p) in shapes]
    assert [n for n, _ in named] == [
        "blocks.0.lin.weight",
        "blocks.0.experts.w_gate_up_E2FD",
        "blocks.0.experts.w_down_EDF",
    ]
    assert [(s.count, s.rows, s.cols) for s in (shapes[id(p)] for _, p in named)] == [
        (1, 8, 12),
        (6, 5, 12),
        (3, 12, 5),
    ]
    muon = Muon.whole(named, shapes, MuonConfig(momentum=0.9, ns_steps=5, weight_decay=0.1))
    want = {n: (p.detach().double().clone(), torch.zeros_like(p, dtype=torch.float64)) for n, p in named}
    coef = torch.tensor(0.5)
    for step in range(3):
        grads = [torch.randn_like(p) for _, p in named]
        before = [p.detach().clone() for _, p in named]
        muon.step(grads, lr=0.02, coef=coef, skip=torch.tensor(True))  # skipped: nothing moves
        for (_, p), b in zip(named, before):
            assert torch.equal(p, b)
        assert all(torch.equal(m, torch.zeros_like(m)) for m in muon.momentum) or step > 0
        muon.step(grads, lr=0.02, coef=coef, skip=torch.tensor(False))
        for (name, p), g, shape in zip(named, grads, (shapes[id(p)] for _, p in named)):
            w, m = want[name]
            want[name] = _reference_step(w, g, m, 0.9, 0.02, 0.1, coef, shape.count, shape.rows, shape.cols)
            assert torch.allclose(p.double(), want[name][0], atol=1e-5), (step, name)
    assert model.norm.weight.eq(model.norm.weight).all()  # untouched by Muon (not in `named`)


def test_a_1d_parameter_is_refused_by_name():
    norm = nn.LayerNorm(4)
    with pytest.raises(ValueError, match="'norm.weight' has shape \\(4,\\)"):
        check_matrices([("norm.weight", norm.weight)], {})


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    model = resolve_config("tiny", [MUON]).model.build(device="meta")
    shapes = muon_matrices(model)
    muon = {n for n, p in model.named_parameters() if id(p) in shapes}
    adamw = {n for n, p in model.named_parameters() if id(p) not in shapes}
    assert "blocks.1.attn.wq.weight" in muon and "blocks.1.ffn.experts.w_down_EDF" in muon
    assert {"embed.weight", "lm_head.weight", "norm.weight"} <= adamw
    assert all(".router." in n or "norm" in n for n in adamw - {"embed.weight", "lm_head.weight"}), adamw
    assert all(p.ndim >= 2 for n, p in model.named_parameters() if n in muon)


def test_muon_with_bf16_weights_is_refused_naming_both_fields():
    with pytest.raises(ConfigError) as e:
        resolve_config("tiny", [MUON, "optim.bf16_weights=true", "train.precision=bf16"])
    assert "optim.name=muon" in str(e.value) and "optim.bf16_weights=false" in str(e.value)
    cfg = resolve_config("bench-8e", [MUON])  # unset: off with Muon, on CUDA too
    assert cfg.optim.resolved_bf16_weights(cfg.parallel, torch.bfloat16, "cuda") is False


def test_config_help_lists_the_muon_keys(capsys):
    from moetrain.cli import main

    with pytest.raises(SystemExit):
        main(["config", "--help"])
    out = capsys.readouterr().out
    for key in ("optim.name", "optim.muon_momentum", "optim.muon_ns_steps"):
        assert key in out, key


def _divided_muon(seed_grads: int):
    """On each gloo rank: a Linear, stacked experts (gate and up apart: 2E matrices; down: E) and a
    small Linear, stepped twice by a `Muon` shared over the world (the experts' down
    matrices without a gradient in the second step) and by one alone; (whether the two give the
    same bits, the matrices this rank orthogonalized)."""
    import torch.distributed as dist

    from moetrain.optim import muon

    torch.manual_seed(0)
    modules = [nn.Linear(48, 32, bias=False), GroupedExperts(5, 24, 16), nn.Linear(8, 40, bias=False)]
    model = nn.ModuleList(modules)
    for p in modules[1].parameters():  # GroupedExperts leaves its weights to the model's init
        nn.init.normal_(p, std=0.1)
    twin = nn.ModuleList([nn.Linear(48, 32, bias=False), GroupedExperts(5, 24, 16), nn.Linear(8, 40, bias=False)])
    twin.load_state_dict(model.state_dict())
    cfg = MuonConfig(momentum=0.9, ns_steps=5, weight_decay=0.1)
    world = dist.group.WORLD
    named = [(n, p) for n, p in model.named_parameters()]
    shared = Muon.whole(named, muon_matrices(model), cfg, groups=[world] * len(named))
    alone = Muon.whole(list(twin.named_parameters()), muon_matrices(twin), cfg)
    counted, real = [], muon.newton_schulz

    def counting(u, steps, dtype):
        counted.append(u.shape[0] if u.ndim == 3 else 1)
        return real(u, steps, dtype)

    g = torch.Generator().manual_seed(seed_grads)
    for step in range(2):
        grads = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        if step == 1:
            grads[2] = None
        muon.newton_schulz = counting
        shared.step(grads, 0.02, None, None)
        muon.newton_schulz = real
        alone.step(grads, 0.02, None, None)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    return same, sum(counted)


@pytest.mark.parametrize("world", [2, 3])
def test_muon_divides_newton_schulz_over_the_ranks_that_hold_the_matrices(world):
    """Every rank of a group ends with a lone rank's parameters bit for bit, and the group
    orthogonalizes each matrix once between them: 1 + 10 + 5 + 1 matrices the first step,
    1 + 10 + 1 the second (the experts' down matrices got no gradient), and no rank does them
    all."""
    from support.distributed import run_distributed

    results = run_distributed(_divided_muon, world, 7)
    assert all(same for same, _ in results)
    counts = [n for _, n in results]
    assert sum(counts) == 17 + 12 and max(counts) < 29, counts
