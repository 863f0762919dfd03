"""Attention sinks (model.attention_sinks, src/moetrain/model/sinks.py): outputs and the gradients
of q, k, v and the sinks against an explicit softmax over [scores, sink] without the sink's
column (float64), global, within a sliding window and with document masks; very negative sinks
give plain attention; generation's cache (GQA and MLA, local and global blocks) against the full
forward, and its greedy tokens against recomputing; the parameters start at 0, are counted,
refused by native Hugging Face export, kept by a checkpoint; the key takes only true or false."""

import dataclasses

import pytest
import torch

from moetrain.generation import generate_ids
from moetrain.hf.arch import unsupported_features
from moetrain.model.config import MoEConfig, TransformerConfig
from moetrain.model.counting import count_params
from moetrain.model.kv_cache import attend_held
from moetrain.model.sequence_layout import WholeSequence

B, H, G, T, Dh = 2, 4, 2, 12, 6


def reference(q, k, v, sink_H, keep_BTS):
    """softmax over [q·kᵀ/√Dh (masked), sink_h], the sink's column dropped, times v."""
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    scores = (q @ k.transpose(-1, -2) / Dh**0.5).masked_fill(~keep_BTS[:, None], float("-inf"))
    sink_BHT1 = sink_H.view(1, H, 1, 1).expand(*scores.shape[:3], 1)
    return torch.cat([scores, sink_BHT1], -1).softmax(-1)[..., :-1] @ v


def inputs(seed, docs):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, G, T, Dh, generator=g, dtype=torch.float64) for _ in range(2))
    sink_H = torch.randn(H, generator=g, dtype=torch.float64) * 2
    doc_ids_BT = (torch.rand(B, T, generator=g) < 0.25).long().cumsum(1) if docs else torch.zeros(B, T)
    keep_BTT = (doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    return (q, k, v, sink_H), keep_BTT, (keep_BTT if docs else None)


@pytest.mark.parametrize("window", [0, 4])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_sink_attention_and_its_gradients_equal_the_softmax_with_a_sink_column(window, docs):
    (q, k, v, sink_H), keep_BTT, mask_BTT = inputs(window, docs)
    if window:
        d_TT = torch.arange(T)[:, None] - torch.arange(T)[None, :]
        keep_BTT = keep_BTT & (d_TT < window)
    w = torch.randn(B, H, T, Dh, dtype=torch.float64)
    ours = [t.clone().requires_grad_() for t in (q, k, v, sink_H)]
    theirs = [t.clone().requires_grad_() for t in (q, k, v, sink_H)]
    got = WholeSequence().attend(*ours[:3], mask_BTT, window, ours[3])
    want = reference(*theirs, keep_BTT)
    assert (got - want).abs().max() < 1e-12
    (got * w).sum().backward()
    (want * w).sum().backward()
    for a, b in zip(ours, theirs):
        assert (a.grad - b.grad).abs().max() < 1e-12
    assert ours[3].grad.abs().min() > 1e-3  # every head's sink learns
    # without the sink the output differs: the test can fail
    assert (got - WholeSequence().attend(q, k, v, mask_BTT, window)).abs().max() > 1e-3


def test_gradcheck_and_very_negative_sinks_give_plain_attention():
    (q, k, v, sink_H), _, mask_BTT = inputs(1, True)
    small = [t[:1, :, :5].clone().requires_grad_() for t in (q, k, v)]
    attend = WholeSequence().attend
    fn = lambda q, k, v, s: attend(q, k, v, mask_BTT[:1, :5, :5], 3, s)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (*small, sink_H.clone().requires_grad_()))
    for mask, window in ((None, 0), (mask_BTT, 0), (mask_BTT, 5)):
        plain = attend(q, k, v, mask, window)
        assert (attend(q, k, v, mask, window, torch.full((H,), -1e4, dtype=q.dtype)) - plain).abs().max() < 1e-12


def test_the_cache_attends_with_sinks_from_any_offset():
    """attend_held (generation's) for new positions start … T − 1 over 0 … T − 1."""
    (q, k, v, sink_H), keep_BTT, _ = inputs(2, False)
    want = reference(q, k, v, sink_H, keep_BTT)
    for start, window in ((0, 0), (7, 0), (T - 1, 0), (5, 4)):
        if window:
            d_TT = torch.arange(T)[:, None] - torch.arange(T)[None, :]
            want = reference(q, k, v, sink_H, keep_BTT & (d_TT < window))
        got = attend_held(q[:, :, start:], k, v, start, window, sink_H=sink_H)
        assert (got - want[:, :, start:]).abs().max() < 1e-12, (start, window)


def small(**kw) -> TransformerConfig:
    moe = MoEConfig(num_experts=4, expert_hidden=16)
    return TransformerConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, moe=moe, **kw)


MLA = dict(attention="mla", q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


@pytest.mark.parametrize("kw", [{}, dict(sliding_window=5, attention_pattern="LG"), MLA], ids=["gqa", "local", "mla"])
def test_the_cache_with_sinks_gives_the_full_forwards_logits(kw):
    torch.manual_seed(0)
    model = small(attention_sinks=True, **kw).build()
    model.init_weights()
    sinks = [b.attn.sinks for b in model.blocks.values()]
    assert all(s.shape == (4,) and not s.any() for s in sinks)  # initialized to 0
    with torch.no_grad():
        for s in sinks:
            s.normal_(0, 2)
    ids_1T = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full_1TV = model.eval()(ids_1T)
        cache = model.new_cache(20)
        parts = [model.decode(ids_1T[:, :7], cache)] + [model.decode(ids_1T[:, t : t + 1], cache) for t in range(7, 12)]
        parts.append(model.decode(ids_1T[:, 12:], cache))
        torch.testing.assert_close(torch.cat(parts, dim=1), full_1TV, rtol=0, atol=1e-5)
        prompt = ids_1T[0, :5].tolist()
        assert generate_ids(model, prompt, 12) == generate_ids(model, prompt, 12, kv_cache=False)
        for s in sinks:
            s.zero_()
        assert (model(ids_1T) - full_1TV).abs().max() > 1e-3  # the sinks matter


@pytest.mark.parametrize("kw", [{}, MLA], ids=["gqa", "mla"])
def test_sinks_are_counted_and_refused_by_native_export(kw):
    cfg = small(attention_sinks=True, **kw)
    model = cfg.build(device="meta")
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())
    assert count_params(cfg).total - count_params(dataclasses.replace(cfg, attention_sinks=False)).total == 3 * 4
    assert any("model.attention_sinks=true" in p for p in unsupported_features(cfg, False))
    assert not any("attention_sinks" in p for p in unsupported_features(small(**kw), False))


def test_a_checkpoint_keeps_the_sinks(tiny_cfg, tmp_path):
    from moetrain.train.trainer import Trainer

    def sinks(trainer):
        return torch.stack([b.attn.sinks.detach() for b in trainer.engine.model.blocks.values()])

    extra = ("model.attention_sinks=true", "train.eval_every=0", "checkpoint.save_every=2")
    trained = Trainer(tiny_cfg(tmp_path / "run", *extra, "train.steps=2"), quiet=True)
    trained.fit()
    assert sinks(trained).abs().min() > 0  # they learned
    resumed = Trainer(tiny_cfg(tmp_path / "run", *extra, "train.steps=3"), resume=True, quiet=True)
    assert torch.equal(sinks(resumed), sinks(trained))


def test_the_key_takes_only_true_or_false():
    from moetrain.errors import ConfigError
    from moetrain.presets import resolve_config

    assert resolve_config("tiny", ["model.attention_sinks=true"]).model.attention_sinks
    with pytest.raises(ConfigError, match="'model.attention_sinks' must be true or false"):
        resolve_config("tiny", ["model.attention_sinks=maybe"])
