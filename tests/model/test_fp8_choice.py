"""precision.fp8_select: which products row-wise FP8 takes (src/moetrain/model/fp8_choice.py)."""

import pytest

from moetrain.model.experts import GroupedExperts, expert_mlp
from moetrain.model.fp8 import Fp8Linear, MxFp8Linear, fp8_expert_mlp, mxfp8_expert_mlp
from moetrain.model.fp8_choice import MIN_ROWS_PER_EXPERT, MIN_TFLOP, Product, block_products, choose
from moetrain.parallel.parallelize import apply_fp8
from moetrain.presets import resolve_config


def test_a_product_pays_from_its_flops_and_rows_per_expert():
    assert Product("linear", 8192, 4096, 4096).tflop == pytest.approx(6 * 8192 * 4096 * 4096 / 1e12)
    assert Product("experts", 32768, 4096, 4096, 8).tflop == pytest.approx(18 * 32768 * 4096 * 4096 / 1e12)
    big = MIN_TFLOP["linear"] * 1e12 / 6
    assert Product("linear", 1, 1, int(big) + 1).pays and not Product("linear", 1, 1, int(big) - 1).pays
    rows = int(MIN_TFLOP["experts"] * 1e12 / 18 / 1024 / 1024)  # experts: 3 GEMMs of K × N each
    assert Product("experts", rows + 8, 1024, 1024, 1).pays and not Product("experts", rows - 8, 1024, 1024, 1).pays
    assert Product("linear", rows - 8, 1024, 3 * 1024).pays  # the same FLOPs as a linear pay
    # enough FLOPs, too few rows per expert
    assert not Product("experts", 65536, 4096, 4096, 65536 // MIN_ROWS_PER_EXPERT + 1).pays
    assert Product("experts", 65536, 4096, 4096, 65536 // MIN_ROWS_PER_EXPERT).pays
    assert choose(Product("linear", 16, 16, 16), "all") and not choose(Product("linear", 16, 16, 16), "auto")


@pytest.mark.parametrize(
    "preset, chosen",
    [
        ("bench-8e", {"experts", "dense MLP", "attention q/o", "shared expert"}),
        ("bench-tiny64e-l6", {"dense MLP"}),
        ("bench-small32e", set()),
        ("bench-sweep-8", set()),
        ("bench-sweep-64", set()),
        ("tiny", set()),
    ],
)
def test_the_shipped_presets_take_fp8_where_the_probe_measured_it_pays(preset, chosen):
    cfg = resolve_config(preset)
    products = block_products(cfg.model, cfg.rows_per_micro_batch)
    assert {name for name, p in products.items() if choose(p, "auto")} == chosen


def _fp8_modules(model):
    linears = {type(m) for m in model.modules() if isinstance(m, Fp8Linear | MxFp8Linear)}
    recipes = {expert_mlp: None, fp8_expert_mlp: "rowwise", mxfp8_expert_mlp: "mxfp8"}
    experts = {recipes[getattr(m.mlp, "func", m.mlp)] for m in model.modules() if isinstance(m, GroupedExperts)}
    return sum(isinstance(m, Fp8Linear | MxFp8Linear) for m in model.modules()), linears, experts


def test_apply_fp8_turns_what_the_choice_says_and_mxfp8_takes_every_product():
    cfg = resolve_config("tiny", ["model.d_model=64", "model.moe.expert_hidden=32"])
    auto, every, mx = (cfg.model.build(device="meta") for _ in range(3))
    rows = cfg.rows_per_micro_batch
    apply_fp8(auto, "rowwise", "auto", rows)
    apply_fp8(every, "rowwise", "all", rows)
    apply_fp8(mx, "mxfp8", "auto", rows)
    assert _fp8_modules(auto) == (0, set(), {None})  # tiny: no product repays it
    n = 4 * cfg.model.n_layers + 3 * cfg.model.num_dense_layers  # q, k, v, o per block; the dense MLP
    assert _fp8_modules(every) == (n, {Fp8Linear}, {"rowwise"})
    assert _fp8_modules(mx) == (n, {MxFp8Linear}, {"mxfp8"})
    # a shape past both thresholds takes the experts' FP8 under auto
    wide = resolve_config("bench-8e", ["model.n_layers=2", "model.vocab_size=256"])
    model = wide.model.build(device="meta")
    apply_fp8(model, "rowwise", "auto", wide.rows_per_micro_batch)
    count, classes, experts = _fp8_modules(model)
    # the dense block's MLP, q and o of both blocks, the MoE block's shared expert; not k and v
    assert count == 3 + 2 * 2 + 3 and experts == {"rowwise"}


def test_the_fp8_lm_head_is_asked_for_with_rowwise_and_a_vocabulary_it_can_take():
    from moetrain.errors import ConfigError

    cfg = resolve_config("tiny", ["model.d_model=64", "model.moe.expert_hidden=32"])
    model = cfg.model.build(device="meta")
    apply_fp8(model, "rowwise", "auto", cfg.rows_per_micro_batch, lm_head=True)
    assert type(model.lm_head) is Fp8Linear and _fp8_modules(model)[0] == 1  # the head alone (auto: no block product)
    for overrides, names in (
        (["precision.fp8_lm_head=true"], ("precision.fp8_lm_head=true", "precision.fp8=none", "precision.fp8=rowwise")),
        (
            ["precision.fp8_fast_accum_backward=true"],
            ("precision.fp8_fast_accum_backward=true", "precision.fp8=rowwise"),
        ),
        (
            ["precision.fp8=rowwise", "precision.fp8_lm_head=true", "model.vocab_size=1000"],
            ("model.vocab_size=1000", "16"),
        ),
    ):
        with pytest.raises(ConfigError) as e:
            resolve_config("tiny", overrides).validate()
        assert all(n in str(e.value) for n in names), str(e.value)


def test_fast_accumulation_in_backward_reaches_every_backward_product(monkeypatch):
    """precision.fp8_fast_accum_backward: the backward FP8 products (linears', experts' and the LM
    head's, which the chunked loss runs in forward) ask for fast accumulation as the forward ones
    always do; without it they do not."""
    import torch

    import moetrain.model.fp8 as fp8
    import moetrain.model.loss as loss_module

    calls = []
    real_mm, real_grouped = fp8._scaled_mm, fp8._scaled_grouped_mm
    mm = lambda *a: calls.append(("mm", a[-1])) or real_mm(*a)  # noqa: E731
    monkeypatch.setattr(fp8, "_scaled_mm", mm)
    monkeypatch.setattr(loss_module, "_scaled_mm", mm)
    monkeypatch.setattr(fp8, "_scaled_grouped_mm", lambda *a: calls.append(("grouped", a[-1])) or real_grouped(*a))
    cfg = resolve_config("tiny", ["model.d_model=64", "model.moe.expert_hidden=32", "model.vocab_size=256"])
    seen = {}
    for fast in (False, True):
        torch.manual_seed(0)
        model = cfg.model.build()
        apply_fp8(model, "rowwise", "all", cfg.rows_per_micro_batch, lm_head=True, fast_backward=fast)
        tokens = torch.randint(0, 256, (2, 16))
        calls.clear()
        model(tokens, targets_BT=tokens, loss_chunk_tokens=8).backward()
        seen[fast] = list(calls)
    # Forward: x·Wᵀ per linear, the logits per chunk of 8 tokens, 2 grouped GEMMs per expert layer.
    # Backward: dx and dW per linear, the head's dh per chunk, dx of both grouped GEMMs.
    linears, chunks, expert_layers = (
        4 * cfg.model.n_layers + 3 * cfg.model.num_dense_layers,
        4,
        cfg.model.n_layers - cfg.model.num_dense_layers,
    )
    assert [kind for kind, _ in seen[False]] == [kind for kind, _ in seen[True]]
    assert all(flag is True for _, flag in seen[True])
    fast = [kind for kind, flag in seen[False] if flag is True]
    slow = [kind for kind, flag in seen[False] if flag is False]
    assert (fast.count("mm"), fast.count("grouped")) == (linears + chunks, 2 * expert_layers)
    assert (slow.count("mm"), slow.count("grouped")) == (2 * linears + chunks, 2 * expert_layers)


def test_the_lm_head_and_fast_backward_follow_the_selection_unless_set():
    """precision.fp8_lm_head and precision.fp8_fast_accum_backward left unset: the head runs in FP8 where
    fp8_select would take a block product of its shape and the vocabulary allows; backward uses
    fast accumulation. Set, they are what is asked; without row-wise FP8, both are off."""
    wide = resolve_config("bench-8e", ["precision.fp8=rowwise"])
    assert wide.fp8_lm_head and wide.fp8_fast_backward
    assert not resolve_config("bench-8e").fp8_lm_head and not resolve_config("bench-8e").fp8_fast_backward
    odd = resolve_config("bench-8e", ["precision.fp8=rowwise", "model.vocab_size=100001"])
    odd.validate()  # left unset, an odd vocabulary keeps the head in bf16 without an error
    assert not odd.fp8_lm_head
    off = resolve_config(
        "bench-8e", ["precision.fp8=rowwise", "precision.fp8_lm_head=false", "precision.fp8_fast_accum_backward=false"]
    )
    assert not off.fp8_lm_head and not off.fp8_fast_backward
    small = resolve_config("tiny", ["precision.fp8=rowwise"])
    assert not small.fp8_lm_head  # 24 × 128 rows × 64 × its vocabulary: far below 0.8 TFLOP
    assert resolve_config("tiny", ["precision.fp8=rowwise", "precision.fp8_select=all"]).fp8_lm_head
