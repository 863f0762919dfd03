"""Group-limited routing (DeepSeek-V3's) and the routed scale, against a per-token reference of
DeepSeek-V3's formula; their validation."""

import pytest
import torch

from moetrain.errors import ConfigError
from moetrain.model.config import MoEConfig
from moetrain.model.router import Router

GROUPED = dict(num_experts=16, top_k=4, gating="sigmoid", n_groups=4, topk_groups=2, routed_scale=2.5)


def grouped_router(**kw) -> Router:
    r = Router(8, MoEConfig(**(GROUPED | kw)))
    torch.nn.init.normal_(r.weight)
    r.expert_bias_E.copy_(torch.randn(r.cfg.num_experts) * 0.1)
    return r


def reference(x_ND, weight_ED, bias_E, *, n_groups, topk_groups, top_k, scale):
    """DeepSeek-V3's routing one token at a time: group score = sum of its two best biased scores,
    the best topk_groups groups, top-k of the biased scores inside them, weights from the unbiased
    scores, normalized, × scale. Returns (sorted expert ids, their weights) per token."""
    scores_NE = (x_ND @ weight_ED.T).sigmoid()
    size = weight_ED.shape[0] // n_groups
    ids, weights = [], []
    for s_E in scores_NE:
        biased = s_E + bias_E
        group_scores = [sorted(biased[g * size : (g + 1) * size].tolist())[-2:] for g in range(n_groups)]
        kept = sorted(range(n_groups), key=lambda g: -sum(group_scores[g]))[:topk_groups]
        allowed = [e for g in kept for e in range(g * size, (g + 1) * size)]
        chosen = sorted(sorted(allowed, key=lambda e: -biased[e].item())[:top_k])
        w = s_E[chosen]
        ids.append(chosen)
        weights.append((w / w.sum() * scale).tolist())
    return torch.tensor(ids), torch.tensor(weights)


def test_grouped_router_matches_deepseek_v3_formula():
    r = grouped_router()
    x = torch.randn(64, 8)
    out = r(x)
    ids, weights = reference(x, r.weight.detach(), r.expert_bias_E, n_groups=4, topk_groups=2, top_k=4, scale=2.5)
    order = out.topk_ids_NK.argsort(-1)
    assert torch.equal(out.topk_ids_NK.gather(-1, order), ids)
    torch.testing.assert_close(out.topk_weights_NK.gather(-1, order), weights)
    torch.testing.assert_close(out.topk_weights_NK.sum(-1), torch.full((64,), 2.5))


@pytest.mark.parametrize("routing", ["learned", "random"])
def test_no_expert_outside_the_chosen_groups(routing):
    r = grouped_router(num_experts=32, top_k=6, n_groups=8, topk_groups=3, routing=routing)
    group_NK = r(torch.randn(200, 8)).topk_ids_NK // 4
    assert max(len(set(row)) for row in group_NK.tolist()) <= 3
    if routing == "random":  # every group still drawn
        assert len(set(group_NK.flatten().tolist())) == 8


def test_groups_change_selection_but_gradients_reach_the_router_as_without():
    x = torch.randn(40, 8)
    grouped, plain = grouped_router(), grouped_router(n_groups=1, topk_groups=1)
    plain.weight.data.copy_(grouped.weight.data)
    plain.expert_bias_E.copy_(grouped.expert_bias_E)
    outs = [r(x) for r in (grouped, plain)]
    assert not torch.equal(outs[0].topk_ids_NK, outs[1].topk_ids_NK)
    for r, out in zip((grouped, plain), outs):
        (out.topk_weights_NK.square().sum() + out.lb_loss + out.z_loss).backward()
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0 and r.weight.grad.isfinite().all()


def test_grouped_router_compiles_to_the_same_result():
    r = grouped_router()
    x = torch.randn(32, 8)
    eager, compiled = r(x), torch.compile(r, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(eager.topk_ids_NK, compiled.topk_ids_NK)
    torch.testing.assert_close(eager.topk_weights_NK, compiled.topk_weights_NK)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(topk_groups=5), "model.moe.topk_groups=5"),
        (dict(n_groups=3), "model.moe.n_groups=3"),
        (dict(n_groups=16, topk_groups=2), "model.moe.n_groups=16"),
        (dict(gating="softmax"), "model.moe.gating=sigmoid"),
        (dict(top_k=9), "model.moe.top_k=9"),
        (dict(restore_weight_scale=True), "model.moe.routed_scale=2.5"),
    ],
)
def test_validation_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        MoEConfig(**(GROUPED | overrides)).validate()
