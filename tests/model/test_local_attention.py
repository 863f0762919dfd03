"""Local (sliding-window) attention (src/moetrain/model/local_attention.py): the function against a
direct softmax over the window, with grouped-query heads and document masks; the pattern of local
and global blocks and its refusals; generation's cache within the window against the full
forward; a window as long as the sequence is global attention; the FLOPs the planner counts."""

import pytest
import torch

from moetrain.errors import ConfigError
from moetrain.model.config import MoEConfig, TransformerConfig
from moetrain.model.counting import flops_per_token
from moetrain.model.local_attention import local_attention


def direct(q, k, v, window, doc_ids_BT=None):
    """softmax(q·kᵀ/√Dh) over the keys within `window` positions up to each query (and in its
    document), float64."""
    H, G, T, Dh = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    d_TT = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    keep = ((d_TT >= 0) & (d_TT < window)).expand(q.shape[0], 1, T, T)
    if doc_ids_BT is not None:
        keep = keep & (doc_ids_BT[:, None, :, None] == doc_ids_BT[:, None, None, :])
    scores = (q @ k.transpose(-1, -2) / Dh**0.5).masked_fill(~keep, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("window", [1, 3, 7, 16, 40])
@pytest.mark.parametrize("docs", [False, True], ids=["causal", "documents"])
def test_local_attention_is_the_softmax_over_the_window(window, docs):
    g = torch.Generator().manual_seed(window)
    B, H, G, T, Dh = 2, 4, 2, 16, 8
    q = torch.randn(B, H, T, Dh, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, G, T, Dh, generator=g, dtype=torch.float64) for _ in range(2))
    doc_ids_BT = (torch.rand(B, T, generator=g) < 0.25).long().cumsum(1) if docs else None
    mask_BTT = None
    if docs:
        mask_BTT = (doc_ids_BT[:, :, None] == doc_ids_BT[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    got = local_attention(q, k, v, window, mask_BTT)
    assert (got - direct(q, k, v, window, doc_ids_BT)).abs().max() < 1e-12


def small(**kw) -> TransformerConfig:
    return TransformerConfig(
        vocab_size=64,
        d_model=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        moe=MoEConfig(num_experts=4, expert_hidden=16),
        **kw,
    )


def test_the_pattern_repeats_over_the_blocks_and_bad_ones_are_refused():
    cfg = small(sliding_window=6, attention_pattern="LLG")
    assert [cfg.window_of(i) for i in range(7)] == [6, 6, 0, 6, 6, 0, 6]
    assert [small(sliding_window=6).window_of(i) for i in range(4)] == [6] * 4
    assert [small().window_of(i) for i in range(4)] == [0] * 4
    model = small(sliding_window=6, attention_pattern="LG").build()
    assert [b.attn.window for b in model.blocks.values()] == [6, 0, 6, 0]
    for kw, words in (
        ({"sliding_window": 6, "attention_pattern": "LXG"}, r"only L \(a local block\) and G"),
        ({"attention_pattern": "LG"}, "model.sliding_window is 0"),
    ):
        with pytest.raises(ConfigError, match=words):
            small(**kw).validate()


def built(cfg: TransformerConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_weights()
    return model.eval()


def test_the_cache_within_the_window_gives_the_full_forwards_logits():
    """Prompt, one token at a time, then a chunk: every step past the window drops the keys
    that left it, as the full forward's mask does."""
    model = built(small(sliding_window=5, attention_pattern="LG"))
    ids_1T = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full_1TV = model(ids_1T)
        cache = model.new_cache(24)
        parts = [model.decode(ids_1T[:, :7], cache)]
        parts += [model.decode(ids_1T[:, t : t + 1], cache) for t in range(7, 15)]
        parts.append(model.decode(ids_1T[:, 15:], cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full_1TV, rtol=0, atol=1e-5)
    with torch.no_grad():  # the window matters here: global attention gives other logits
        assert (built(small())(ids_1T) - full_1TV).abs().max() > 1e-3


def test_a_window_as_long_as_the_sequence_is_global_attention():
    ids_1T = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        windowed, plain = built(small(sliding_window=12))(ids_1T), built(small())(ids_1T)
    torch.testing.assert_close(windowed, plain, rtol=0, atol=1e-5)


def test_the_flops_count_twice_the_window_for_a_local_block():
    """The MFU formula counts seq_len keys a query for a global block (twice the causal mean);
    a local block counts twice the window, at most seq_len."""
    plain, T = small(), 256
    per_block = 12 * plain.n_heads * plain.resolved_head_dim
    for window, pattern, local_blocks in ((32, "LG", 2), (32, "", 4), (200, "", 4)):
        cfg = small(sliding_window=window, attention_pattern=pattern)
        saved = local_blocks * per_block * (T - min(T, 2 * window))
        assert flops_per_token(plain, T) - flops_per_token(cfg, T) == saved
