"""Parameter counts: every preset's and every structural option's equal to its built model's
parameters; the reference presets against the published table (within 0.5%)."""

import dataclasses
import json
import subprocess
import sys
from collections import Counter

import pytest

from moetrain.model import counting
from moetrain.model.attention import Attention
from moetrain.model.block import Block
from moetrain.model.counting import count_params, peak_flops
from moetrain.model.experts import GroupedExperts
from moetrain.model.mla import LatentAttention
from moetrain.model.mlp import SwiGLU
from moetrain.model.moe import MoE
from moetrain.model.mtp import MTPModule, MultiTokenPrediction
from moetrain.model.norm import Embedding, RMSNorm
from moetrain.model.router import Router
from moetrain.model.transformer import Transformer
from moetrain.presets import PRESETS, preset

# (total, active) from Olmo-core's reference table (shared/REFERENCE.md) and its capacity sweep.
REFERENCE = {
    "ref-tiny-64e": (12.91e9, 1.59e9),
    "ref-small-64e": (40.86e9, 4.29e9),
    "ref-medium-128e": (137.27e9, 7.38e9),
    "ref-large-128e": (295.99e9, 15.14e9),
    "ref-ultra-128e": (1.200e12, 58.36e9),
    "ref-ultra-256e": (2.380e12, 58.41e9),
    "sweep-8l-8": (4.58e9, 3.17e9),
}


def _built(m) -> tuple[int, int, int]:
    """(total, active, embedding table) of the model `m` builds (on the meta device)."""
    model = m.build(device="meta")
    total = sum(p.numel() for p in model.parameters())
    idle = sum(
        sum(p.numel() for p in moe.experts.parameters()) // moe.cfg.num_experts * (moe.cfg.num_experts - moe.cfg.top_k)
        for moe in model.moe_layers()
    )
    return total, total - idle, model.embed.weight.numel()


VARIANTS = {
    "peri_norm": dict(peri_norm=True),
    "post_norm": dict(pre_norm=False, peri_norm=True),
    "no_qk_norm": dict(qk_norm=False),
    "embedding_norm": dict(embedding_norm=True),
    "mtp": dict(mtp_depth=2),
    "head_dim": dict(head_dim=64, n_heads=8, n_kv_heads=4),
    "dense_hidden": dict(dense_hidden=200, num_dense_layers=2),
    "all_moe": dict(num_dense_layers=0),
    "all_dense": dict(num_dense_layers=4),
    "mla": dict(
        attention="mla", q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24
    ),
    "mla_direct_queries": dict(attention="mla", q_lora_rank=0, kv_lora_rank=32, v_head_dim=16, mtp_depth=1),
    "attention_sinks": dict(attention_sinks=True, mtp_depth=1),
    "mla_attention_sinks": dict(attention="mla", q_lora_rank=0, kv_lora_rank=32, attention_sinks=True),
}


DECLARED = {
    Transformer: lambda m, _: count_params(m).total,
    Embedding: lambda m, _: counting.embedding_params(m),
    Block: lambda m, block: counting.block_params(m, block.is_moe),
    Attention: lambda m, _: counting.attention_params(m),
    LatentAttention: lambda m, _: counting.attention_params(m),
    SwiGLU: lambda m, mlp: counting.swiglu_params(m.d_model, mlp.w_gate.out_features),  # dense MLP, shared expert
    MoE: lambda m, _: counting.moe_params(m.moe, m.d_model),
    GroupedExperts: lambda m, _: counting.experts_params(m.moe, m.d_model),
    MultiTokenPrediction: lambda m, _: m.mtp_depth * counting.mtp_module_params(m),
    MTPModule: lambda m, _: counting.mtp_module_params(m),
}
"""Each component's declared parameters (src/moetrain/model/counting.py), from the config and the
module's kind."""

UNDECLARED = (RMSNorm, Router)
"""One weight each, declared in its owner's count."""


@pytest.mark.parametrize("name", sorted(PRESETS) + sorted(VARIANTS))
def test_every_component_declares_the_parameters_it_builds(name):
    """The planner sums what the components declare: each one's declaration equals the parameters
    of the module it builds (meta device), and every module of the package that holds parameters
    has one, in every preset and every structural option (on tiny)."""
    m = preset(name).model if name in PRESETS else dataclasses.replace(preset("tiny").model, **VARIANTS[name])
    m = dataclasses.replace(m, mtp_depth=max(m.mtp_depth, 1))
    for module in m.build(device="meta").modules():
        params = sum(p.numel() for p in module.parameters())
        if type(module) in DECLARED:
            assert DECLARED[type(module)](m, module) == params, (name, type(module).__name__)
        else:
            ours = type(module).__module__.startswith("moetrain.")
            assert not (ours and params) or isinstance(module, UNDECLARED), f"{type(module).__name__} declares no cost"


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["tiny"])
def test_every_blocks_declared_matrices_are_its_built_ones(variant):
    """`block_matrices` (what FP8's choice, its dims check and the planner's Muon and split-entry
    sums read) holds each matrix Muon updates in a built block, and its largest entry optim.bf16_weights
    splits (one expert's for the stacked experts)."""
    from moetrain.optim.muon import muon_matrices
    from moetrain.optim.split_master import is_split_candidate

    m = dataclasses.replace(preset("tiny").model, **VARIANTS.get(variant, {}))
    model = m.build(device="meta")
    shapes, split = muon_matrices(model), is_split_candidate(model)
    for block in model.blocks.values():
        ids, declared = {id(p) for p in block.parameters()}, counting.block_matrices(m, block.is_moe)
        built, wanted = Counter(), Counter()
        for s in (shapes[i] for i in ids if i in shapes):
            built[min(s.rows, s.cols), max(s.rows, s.cols)] += s.count
        for x in declared:
            wanted[min(x.d_in, x.d_out), max(x.d_in, x.d_out)] += x.matrices
        assert built == wanted, variant
        largest = max(p.numel() // (p.shape[0] if p.ndim == 3 else 1) for p in block.parameters() if id(p) in split)
        assert largest == max(x.d_in * x.d_out * (2 if x.experts else 1) for x in declared), variant


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_presets_count_is_its_built_models(name):
    m = preset(name).model
    counts = count_params(m)
    assert (counts.total, counts.active, counts.embedding) == _built(m)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_structural_options_count_is_its_built_models(variant):
    m = dataclasses.replace(preset("tiny").model, **VARIANTS[variant])
    m = dataclasses.replace(m, moe=dataclasses.replace(m.moe, shared_hidden=64)) if variant == "mtp" else m
    counts = count_params(m)
    assert (counts.total, counts.active, counts.embedding) == _built(m)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_param_counts(name):
    total, active = REFERENCE[name]
    counts = count_params(preset(name).model)
    assert abs(counts.total - total) / total < 0.005, counts
    assert abs(counts.active - active) / active < 0.005, counts


def test_deepseek_v3s_count():
    """dsv3-671b against DeepSeek-V3's published 671B total and 37B activated (the main model; the
    multi-token prediction module's 14B aside). Its "37B" is a rounding of the activated count
    without the input embedding, DeepSeek's convention (V2-Lite's "2.4B activated" is 2.45B by
    it, 2.66B with the embedding): 36.63B here, 37.55B with the embedding (`active`)."""
    counts = count_params(preset("dsv3-671b").model)
    assert abs(counts.total - 671e9) / 671e9 < 0.001, counts
    assert round((counts.active - counts.embedding) / 1e9) == 37, counts
    assert (counts.total, counts.active, counts.embedding) == (671_026_404_352, 37_552_282_624, 926_679_040)


def test_tiny_is_under_4m_params():
    assert count_params(preset("tiny").model).total <= 4_000_000


def test_sweep_keeps_active_params_while_total_grows():
    totals = [count_params(preset(f"sweep-8l-{e}").model) for e in (8, 16, 32, 64, 128)]
    assert all(a.total < b.total for a, b in zip(totals, totals[1:]))
    assert max(c.active for c in totals) / min(c.active for c in totals) < 1.002


def test_params_command_prints_one_json_line():
    out = subprocess.run(
        [sys.executable, "-m", "moetrain", "params", "ref-tiny-64e"], capture_output=True, text=True, check=True
    )
    record = json.loads(out.stdout.strip().splitlines()[-1])
    assert record["total_params"] == count_params(preset("ref-tiny-64e").model).total
    assert record["active_params"] == count_params(preset("ref-tiny-64e").model).active
    assert record["flops_per_token"] > 6 * record["active_params"] * 0.9


def test_peak_flops_table():
    assert peak_flops("NVIDIA H200") == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA GH200 480GB") == 989.4e12
    assert peak_flops(None) is None and peak_flops("Some GPU") is None


def test_multi_token_prediction_modules_count_as_parameters_and_flops():
    """tiny with model.mtp_depth = 2: each module's two norms, its 2D → D projection and its
    dense block are parameters (558,208 of them, all active: every token runs them), and each
    token's FLOPs grow by theirs, the LM head's two more passes and two more blocks' attention."""
    from moetrain.model.counting import flops_per_token

    base, mtp = preset("tiny").model, dataclasses.replace(preset("tiny").model, mtp_depth=2)
    D, hd, H, G, F = base.d_model, base.resolved_head_dim, base.n_heads, base.n_kv_heads, base.resolved_dense_hidden
    attention = 2 * D * H * hd + 2 * D * G * hd + (2 * hd if base.qk_norm else 0)
    block = attention + D * (4 if base.peri_norm else 2) + 3 * D * F
    module = 2 * D + 2 * D * D + block
    plain, more = count_params(base), count_params(mtp)
    assert more.total - plain.total == more.active - plain.active == 2 * module == 558_208
    seq = 256
    extra = 6 * (2 * module + 2 * base.vocab_size * D) + 12 * 2 * H * hd * seq
    assert flops_per_token(mtp, seq) - flops_per_token(base, seq) == extra
