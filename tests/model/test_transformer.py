"""The whole model: meta-device construction, init, counting vs real parameters, masking."""

import ast
from pathlib import Path

import pytest
import torch

from moetrain.model.config import MoEConfig, TransformerConfig
from moetrain.model.counting import count_params, flops_per_token

MODEL_DIR = Path(__file__).resolve().parents[2] / "src" / "moetrain" / "model"


def small_cfg(**kw) -> TransformerConfig:
    base = dict(
        vocab_size=64,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        num_dense_layers=1,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16),
    )
    base.update(kw)
    return TransformerConfig(**base)


def build(cfg: TransformerConfig, seed=0):
    model = cfg.build(device="meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def test_model_package_never_imports_torch_distributed():
    offenders = []
    for path in MODEL_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch.distributed"):
                names = [ast.unparse(node)]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("torch.distributed")]
    assert offenders == []


def test_meta_construction_allocates_nothing_and_init_is_deterministic():
    cfg = small_cfg()
    meta = cfg.build(device="meta")
    assert all(p.is_meta for p in meta.parameters())
    a, b, c = build(cfg, seed=1), build(cfg, seed=1), build(cfg, seed=2)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all(), name
    assert not torch.equal(a.embed.weight, c.embed.weight)
    # Norms start at one, biases at zero, output projections are scaled down.
    assert torch.equal(a.norm.weight, torch.ones(32))
    assert a.blocks["1"].attn.wo.weight.std() < a.blocks["1"].attn.wq.weight.std()


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(peri_norm=True, qk_norm=False),
        dict(embedding_norm=True),
        dict(pre_norm=False, peri_norm=True),
        dict(head_dim=16, moe=MoEConfig(num_experts=6, top_k=3, expert_hidden=24, shared_hidden=8)),
        dict(num_dense_layers=0, dense_hidden=40),
        dict(num_dense_layers=3),
    ],
)
def test_counted_params_equal_the_real_parameters(kw):
    cfg = small_cfg(**kw)
    model = build(cfg)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())
    # Active = total minus the routed experts a token does not use.
    expert_numel = sum(m.experts.w_gate_up_E2FD.numel() + m.experts.w_down_EDF.numel() for m in model.moe_layers())
    unused = expert_numel * (cfg.moe.num_experts - cfg.moe.top_k) // cfg.moe.num_experts
    assert count_params(cfg).active == count_params(cfg).total - unused


def test_flops_formula_by_hand():
    cfg = small_cfg()
    counts = count_params(cfg)
    expected = 6 * (counts.active - 64 * 32) + 12 * 3 * 4 * 8 * 128
    assert flops_per_token(cfg, seq_len=128) == expected
    assert flops_per_token(cfg, 128, causal_halved=True) == expected - 12 * 3 * 4 * 8 * 128 // 2


def test_forward_shapes_and_causality():
    model = build(small_cfg())
    tokens = torch.randint(0, 64, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, 64)
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 64
    model.eval()
    torch.testing.assert_close(model(tokens)[:, :8], model(changed)[:, :8])


def test_document_masking_isolates_documents():
    model = build(small_cfg())
    model.eval()
    tokens = torch.randint(1, 64, (1, 10))
    doc_ids = torch.tensor([[0] * 4 + [1] * 6])
    other = tokens.clone()
    other[0, :4] = (other[0, :4] + 7) % 64  # change only the first document
    out, out_other = model(tokens, doc_ids), model(other, doc_ids)
    torch.testing.assert_close(out[0, 4:], out_other[0, 4:])  # the second document cannot see it
    assert not torch.allclose(model(tokens)[0, 4:], model(other)[0, 4:])  # without the mask it can


def test_embedding_norm_starts_the_residual_stream_at_unit_rms_and_is_not_decayed():
    from moetrain.optim.base import param_groups

    plain, normed = build(small_cfg()), build(small_cfg(embedding_norm=True))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    with torch.no_grad():
        assert rms(plain.embed(tokens)).mean().item() == pytest.approx(0.986 * plain.cfg.init_std, rel=0.2)
        assert torch.allclose(rms(normed.embed(tokens)), torch.ones(2, 16), atol=1e-2)  # eps aside
    names = {n for n, _ in normed.named_parameters()} - {n for n, _ in plain.named_parameters()}
    assert names == {"embed.norm.weight"}
    assert torch.equal(normed.embed.weight, plain.embed.weight)  # the table draws as before
    decayed = {id(p) for g in param_groups(normed, 0.1) if g["weight_decay"] for p in g["params"]}
    assert id(normed.embed.norm.weight) not in decayed and id(normed.embed.weight) not in decayed


def test_without_the_input_norms_a_block_adds_the_normalized_sublayer_outputs():
    """model.pre_norm=false, peri_norm=true: x + norm(attn(x)), then + norm(ffn(·)) (Olmo-core's
    moe_8l block); both off is refused, naming them."""
    from moetrain.errors import ConfigError

    model = build(small_cfg(pre_norm=False, peri_norm=True))
    block = model.blocks["0"]
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    cos, sin = model.rope.cos_sin(8)
    with torch.no_grad():
        h = x + block.attn_out_norm(block.attn(x, cos, sin))
        want = h + block.ffn_out_norm(block.ffn(h))
        assert torch.equal(block(x, cos, sin), want)
    assert not any("attn_norm" in n or "ffn_norm." in n for n, _ in model.named_parameters())
    with pytest.raises(ConfigError, match="model.pre_norm=false with model.peri_norm=false"):
        small_cfg(pre_norm=False).validate()
