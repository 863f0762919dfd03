"""Pipeline stages, in one process: how layers are cut and placed, and that the stages of a split
model, run one after the other, are the whole model (outputs and gradients), document masking
included. The schedules themselves run in test_layouts.py (pp2, interleaved, pp2·dp2·ep2)."""

import pytest
import torch
import torch.nn.functional as F

from moetrain.model.transformer import canonical_name
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.dims import ParallelDims
from moetrain.parallel.pipeline import StageModule, split_model, stage_layers, stages_of_rank
from moetrain.presets import resolve_config


def test_layers_are_cut_into_equal_contiguous_stages_placed_round_robin():
    assert stage_layers(8, 4) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    # uneven: the first stages take the extra blocks (63 blocks on 8 stages: 8 × 7 + 7)
    assert stage_layers(5, 3) == [["0", "1"], ["2", "3"], ["4"]]
    assert [len(s) for s in stage_layers(63, 8)] == [8] * 7 + [7]
    looped = ParallelDims(world_size=2, dp=1, ep=1, pp=2, stages_per_rank=2)
    assert [stages_of_rank(r, looped) for r in range(2)] == [[0, 2], [1, 3]]
    plain = ParallelDims(world_size=4, dp=1, ep=1, pp=4)
    assert [stages_of_rank(r, plain) for r in range(4)] == [[0], [1], [2], [3]]


def model_cfg():
    return resolve_config(
        "tiny",
        [
            "model.vocab_size=256",
            "model.d_model=32",
            "model.n_layers=4",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.moe.num_experts=4",
            "model.moe.top_k=2",
            "model.moe.expert_hidden=16",
        ],
    ).model


def split(cfg, dims, pp_rank):
    model = cfg.build(device="meta")
    split_model(model, dims, pp_rank)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    return model


@pytest.mark.parametrize("pp, v", [(2, 1), (2, 2), (4, 1), (3, 1)])
def test_stages_in_order_are_the_whole_model(pp, v):
    """Split over pp ranks with v stages each: every parameter lives on exactly one rank with its
    whole-model name and initial value; stage 0 → … → S-1 gives the whole model's logits (with
    document masking) and, after backward, its gradients."""
    cfg = model_cfg()
    dims = ParallelDims(world_size=pp, dp=1, ep=1, pp=pp, stages_per_rank=v)
    whole = cfg.build(device="meta")
    whole.to_empty(device="cpu")
    whole.init_weights(seed=3)
    parts = [split(cfg, dims, r) for r in range(pp)]

    whole_params = {canonical_name(n): p for n, p in whole.named_parameters()}
    held = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(held) == sorted(whole_params)  # each exactly once
    for part in parts:
        for n, p in part.named_parameters():
            assert torch.equal(p, whole_params[n]), n
    assert parts[0].embed is not None and all(p.embed is None for p in parts[1:])
    last_rank = (dims.num_stages - 1) % pp
    assert all((p.lm_head is not None) == (r == last_rank) for r, p in enumerate(parts))

    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (3, 16))
    tokens[:, 5] = 0  # an EOS in every row: two documents per sequence
    doc_ids = (tokens == 0).int().cumsum(1) - (tokens == 0).int()
    targets = torch.randint(0, cfg.vocab_size, (3, 16))

    want = whole(tokens, doc_ids)
    F.cross_entropy(want.flatten(0, 1), targets.flatten()).backward()

    layout = stage_layers(cfg.n_layers, dims.num_stages)
    x = tokens
    for s in range(dims.num_stages):
        stage = StageModule(parts[s % pp], layout[s], first=s == 0, last=s == dims.num_stages - 1, amp_dtype=None)
        stage.queue_doc_ids([doc_ids])
        x = stage(x)
        assert not stage._doc_ids  # consumed
    torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)
    F.cross_entropy(x.flatten(0, 1), targets.flatten()).backward()
    for part in parts:
        for n, p in part.named_parameters():
            torch.testing.assert_close(p.grad, whole_params[n].grad, rtol=1e-5, atol=1e-7, msg=n)


def test_document_masking_reaches_every_stage():
    """Without the queued document ids a later stage would attend across documents: the
    masked and unmasked chains differ."""
    cfg = model_cfg()
    dims = ParallelDims(world_size=2, dp=1, ep=1, pp=2)
    parts = [split(cfg, dims, r) for r in range(2)]
    layout = stage_layers(cfg.n_layers, 2)
    tokens = torch.randint(1, cfg.vocab_size, (2, 16))
    tokens[:, 8] = 0
    doc_ids = (tokens == 0).int().cumsum(1) - (tokens == 0).int()
    s0 = StageModule(parts[0], layout[0], first=True, last=False, amp_dtype=None)
    s1 = StageModule(parts[1], layout[1], first=False, last=True, amp_dtype=None)
    s0.queue_doc_ids([doc_ids])
    hidden = s0(tokens)
    s1.queue_doc_ids([doc_ids])
    masked = s1(hidden)
    s1.queue_doc_ids(None)
    unmasked = s1(hidden)
    # Positions after the EOS see only their own document when masked.
    assert not torch.allclose(masked[:, 9:], unmasked[:, 9:])
    torch.testing.assert_close(masked[:, :9], unmasked[:, :9])


def test_pipeline_config_defaults():
    assert ParallelConfig(pp=2).stages_per_rank == 1
    assert ParallelConfig(pp=2, pp_schedule="interleaved-1f1b").stages_per_rank == 2
