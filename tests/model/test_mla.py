"""Multi-head latent attention (src/moetrain/model/mla.py): the module against MLA written out in
float64 (causal, within documents, within a window, with and without the query latent); values
padded for FlashAttention give the same attention; generation's cache of latents (absorbed form)
gives the full forward's logits and greedy tokens; every parameter gets a gradient, also under
selective recompute; the config's refusals; row-wise FP8 training; the FLOPs' attention term."""

import dataclasses

import pytest
import torch

from moetrain.errors import ConfigError
from moetrain.generation import generate_ids
from moetrain.model import mla
from moetrain.model.config import AttentionKind, MoEConfig, TransformerConfig
from moetrain.model.counting import flops_per_token
from moetrain.model.kv_cache import LatentCache
from moetrain.model.mla import LatentAttention
from moetrain.model.transformer import canonical_name
from moetrain.presets import resolve_config


def small(**kw) -> TransformerConfig:
    """Every MLA width different, so a swapped one shows: Q 24, C 16, N 8, R 4 (K 12), V 6."""
    base = dict(
        vocab_size=64,
        d_model=32,
        n_layers=3,
        n_heads=4,
        attention=AttentionKind.mla,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=6,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16),
    )
    return TransformerConfig(**(base | kw))


def rope_tables(T: int, R: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (T, R), float64: pair i of the rotary dims turns by θ^(−2i/R) per position."""
    inv_freq = theta ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def direct(attn: LatentAttention, x, cos, sin, eps, doc_ids=None, window=0):
    """MLA written out, float64: the latents and their RMSNorms, RoPE (rotate-half) on the rotary
    parts, per-head scores of the non-rotary parts plus the shared rotary key's, softmax over the
    positions each query sees."""
    B, T, _ = x.shape
    H, N, R, V, C = attn.n_heads, attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_rank

    def rms(z, weight):
        return z / (z.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight

    def rope(z):  # (…, T, R)
        half = z.shape[-1] // 2
        return z * cos + torch.cat([-z[..., half:], z[..., :half]], dim=-1) * sin

    if attn.wq is not None:
        q = x @ attn.wq.weight.T
    else:
        q = rms(x @ attn.wq_a.weight.T, attn.q_norm.weight) @ attn.wq_b.weight.T
    q = q.view(B, T, H, N + R).transpose(1, 2)  # (B, H, T, N + R)
    q_nope, q_rope = q[..., :N], rope(q[..., N:])
    kv = x @ attn.wkv_a.weight.T
    c, k_rope = rms(kv[..., :C], attn.kv_norm.weight), rope(kv[..., C:])  # (B, T, C), (B, T, R)
    expanded = (c @ attn.wkv_b.weight.T).view(B, T, H, N + V)
    k_nope, v = expanded[..., :N], expanded[..., N:]
    scores = torch.einsum("bhtn,bshn->bhts", q_nope, k_nope) + torch.einsum("bhtr,bsr->bhts", q_rope, k_rope)
    scores = scores / (N + R) ** 0.5
    d = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    keep = (d >= 0) & ((d < window) if window else True)
    keep = keep.expand(B, 1, T, T)
    if doc_ids is not None:
        keep = keep & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    o = torch.einsum("bhts,bshv->bthv", probs, v).reshape(B, T, H * V)
    return o @ attn.wo.weight.T


def random_module(cfg: TransformerConfig, seed: int = 0, window: int = 0) -> LatentAttention:
    """A float64 LatentAttention with every weight drawn (norms around 1, so they count)."""
    attn = LatentAttention(cfg, window).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise)
    return attn


@pytest.mark.parametrize("q_lora_rank", [24, 0], ids=["query-latent", "query-direct"])
@pytest.mark.parametrize("docs, window", [(False, 0), (True, 0), (False, 5), (True, 5)])
def test_the_module_is_mla_written_out(q_lora_rank, docs, window):
    cfg = small(q_lora_rank=q_lora_rank)
    attn = random_module(cfg, window=window)
    B, T = 2, 16
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, cfg.d_model, generator=g, dtype=torch.float64)
    doc_ids = (torch.rand(B, T, generator=g) < 0.25).long().cumsum(1) if docs else None
    cos, sin = rope_tables(T, cfg.qk_rope_head_dim, cfg.rope_theta)
    masks = None
    if docs:
        masks = (doc_ids[:, :, None] == doc_ids[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    got = attn(x, cos, sin, masks)
    assert got.shape == (B, T, cfg.d_model) and got.dtype == torch.float64
    want = direct(attn, x, cos, sin, cfg.norm_eps, doc_ids, window)
    # RoPE rounds its input to fp32 (src/moetrain/model/rope.py): ~1e-7 of these O(1) outputs
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    if docs:  # the documents change the answer: the masks are applied
        assert (attn(x, cos, sin, None) - got).abs().max() > 1e-3


def test_the_parameters_have_deepseeks_names_and_shapes():
    cfg = small()
    shapes = {n: tuple(p.shape) for n, p in LatentAttention(cfg).named_parameters()}
    assert shapes == {
        "wq_a.weight": (24, 32),
        "q_norm.weight": (24,),
        "wq_b.weight": (4 * 12, 24),
        "wkv_a.weight": (16 + 4, 32),
        "kv_norm.weight": (16,),
        "wkv_b.weight": (4 * (8 + 6), 16),
        "wo.weight": (32, 4 * 6),
    }
    assert {n for n, _ in LatentAttention(small(q_lora_rank=0)).named_parameters()} == {
        "wq.weight", "wkv_a.weight", "kv_norm.weight", "wkv_b.weight", "wo.weight",
    }  # fmt: skip


def test_values_padded_for_flash_attention_give_the_same_attention(monkeypatch):
    """The CUDA path pads the values to the query/key width and slices the output: on the CPU,
    forced, the outputs and every gradient are those of the narrower values."""
    cfg = small()
    x = torch.randn(2, 12, cfg.d_model, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    cos, sin = rope_tables(12, cfg.qk_rope_head_dim, cfg.rope_theta)

    def run():
        attn = random_module(cfg)
        out = attn(x, cos, sin)
        out.pow(2).sum().backward()
        return out, {n: p.grad for n, p in attn.named_parameters()}

    half = torch.empty(1, 1, 1, 12, dtype=torch.bfloat16)
    assert not mla.flash_pads_values(half, half[..., :6])  # on the CPU, never
    plain_out, plain_grads = run()
    monkeypatch.setattr(mla, "flash_pads_values", lambda q, v: True)
    padded_out, padded_grads = run()
    torch.testing.assert_close(padded_out, plain_out, rtol=1e-12, atol=1e-12)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-12, atol=1e-12)


def built(cfg: TransformerConfig, seed: int = 0):
    torch.manual_seed(seed)
    model = cfg.build()
    model.init_weights(seed=seed)
    return model.eval()


@pytest.mark.parametrize(
    "kw", [{}, {"q_lora_rank": 0}, {"sliding_window": 5, "attention_pattern": "LG"}], ids=["latent", "direct", "window"]
)
def test_the_latent_cache_gives_the_full_forwards_logits(kw):
    """Prompt, one token at a time, then a chunk after cached positions: the absorbed attention
    over the cached latents equals the full forward's (fp32 rounding); the cache holds C + R
    numbers per position and layer."""
    model = built(small(**kw))
    ids_2T = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full_2TV = model(ids_2T)
        cache = model.new_cache(24, batch=2)
        parts = [model.decode(ids_2T[:, :7], cache)]
        parts += [model.decode(ids_2T[:, t : t + 1], cache) for t in range(7, 15)]
        parts.append(model.decode(ids_2T[:, 15:], cache))
    torch.testing.assert_close(torch.cat(parts, dim=1), full_2TV, rtol=0, atol=1e-5)
    layer = cache.layers[0]
    assert isinstance(layer, LatentCache) and layer.kv_BSX.shape == (2, 24, 16 + 4)


def test_greedy_with_the_cache_is_greedy_without():
    model = built(small(n_layers=2, init_std=0.3), seed=1)  # wide enough weights for varied tokens
    prompt = [3, 14, 15, 9, 2, 6]
    for max_context in (None, 16):  # inside the context, and past it (the cache starts again)
        cached = generate_ids(model, prompt, 30, max_context=max_context)
        recomputed = generate_ids(model, prompt, 30, max_context=max_context, kv_cache=False)
        assert cached == recomputed and len(cached) == 30 and len(set(cached)) > 5


def _grads(model, ids_BT) -> dict[str, torch.Tensor]:
    model.train()
    model(ids_BT, targets_BT=ids_BT).backward()
    return {canonical_name(n): p.grad for n, p in model.named_parameters()}


def test_every_parameter_gets_a_gradient_also_recomputed():
    """Every parameter's gradient is non-zero; selective recompute (which keeps the matrix
    products' and attention's outputs) gives the same ones exactly."""
    from moetrain.parallel.parallelize import apply_recompute

    cfg = small(n_layers=2, num_dense_layers=1)
    ids_BT = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(4))
    plain = _grads(built(cfg), ids_BT)
    assert all(g is not None and g.abs().max() > 0 for g in plain.values()), [n for n, g in plain.items() if g is None]
    assert any(".attn.wq_a." in n for n in plain) and any(".attn.kv_norm." in n for n in plain)
    recomputed = built(cfg)
    apply_recompute(recomputed, selective=True)
    for name, grad in _grads(recomputed, ids_BT).items():
        assert torch.equal(grad, plain[name]), name


def test_the_config_refuses_what_mla_cannot_take():
    with pytest.raises(ConfigError, match=r"model.qk_rope_head_dim=5 must be even"):
        small(qk_rope_head_dim=5).validate()
    small(n_kv_heads=3, head_dim=7).validate()  # GQA's keys: not read by MLA
    with pytest.raises(ConfigError, match=r"precision.fp8=mxfp8 .* by 32; model.kv_lora_rank \+ qk_rope_head_dim=48"):
        resolve_config("dsv3-tiny", ["precision.fp8=mxfp8"]).validate()


def test_mla_trains_in_rowwise_fp8_close_to_full_precision(real_text_dir, tmp_path):
    """precision.fp8=rowwise on dsv3-tiny's MLA (CPU emulation, every product): each attention
    linear is an `Fp8Linear` of the shape `block_products` names, whose products run (bf16 out of
    an fp32 run), and the losses stay within FP8's error of the full-precision run's."""
    from conftest import tiny_overrides

    from moetrain.model.fp8 import Fp8Linear
    from moetrain.model.fp8_choice import block_products
    from moetrain.train.metrics import read_metrics
    from moetrain.train.trainer import Trainer

    def trainer(name: str, *extra: str) -> Trainer:
        overrides = tiny_overrides(real_text_dir, tmp_path / name, "train.steps=4", *extra)
        return Trainer(resolve_config("dsv3-tiny", overrides), quiet=True)

    plain, fp8 = trainer("a"), trainer("b", "precision.fp8=rowwise", "precision.fp8_select=all")
    linears = {
        name: m for name, m in fp8.engine.model.named_modules() if canonical_name(name).startswith("blocks.0.attn.w")
    }
    assert sorted(n.rsplit(".", 1)[1] for n in linears) == ["wkv_a", "wkv_b", "wo", "wq_a", "wq_b"]
    assert all(type(m) is Fp8Linear for m in linears.values())
    products = block_products(fp8.cfg.model, fp8.cfg.rows_per_micro_batch)  # what the planner and start-up line count
    attention = {name.split()[1]: (p.K, p.N) for name, p in products.items() if name.startswith("attention")}
    assert attention == {n.rsplit(".", 1)[1]: (m.in_features, m.out_features) for n, m in linears.items()}
    outputs = []
    for m in linears.values():
        m.register_forward_hook(lambda module, args, out: outputs.append(out.dtype))
    fp8.fit()
    plain.fit()
    assert len(outputs) >= 5 and set(outputs) == {torch.bfloat16}  # the FP8 products' output
    a, b = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=0.01), (x["step"], x["lm_loss"], y["lm_loss"])


def test_the_flops_count_query_key_heads_for_scores_and_value_heads_for_values():
    """Per layer and key: 2·H·K multiply-adds for the scores, 2·H·V for the values, three
    passes (6·H·(K + V)); the rest is 6 × the active parameters, as for GQA."""
    cfg, T = small(), 128
    without = flops_per_token(cfg, T, attention=False)
    assert flops_per_token(cfg, T) - without == 6 * cfg.n_layers * 4 * (12 + 6) * T
    wider = dataclasses.replace(cfg, v_head_dim=12)  # V = K: Olmo-core's 12·H·head_dim
    assert flops_per_token(wider, T) - flops_per_token(wider, T, attention=False) == 12 * cfg.n_layers * 4 * 12 * T
