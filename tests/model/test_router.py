"""Router selection, weights, losses (against hand-computed values), aux-free bias, random routing."""

import math

import pytest
import torch

from moetrain.model.config import MoEConfig
from moetrain.model.moe import update_expert_bias
from moetrain.model.router import Router, load_balancing_loss


def router(d=8, **kw) -> Router:
    r = Router(d, MoEConfig(**kw))
    torch.nn.init.normal_(r.weight)
    return r


def test_topk_ids_distinct_and_weights_normalized():
    r = router(num_experts=8, top_k=3)
    out = r(torch.randn(50, 8))
    assert out.topk_ids_NK.shape == (50, 3)
    assert all(len(set(row)) == 3 for row in out.topk_ids_NK.tolist())
    torch.testing.assert_close(out.topk_weights_NK.sum(-1), torch.ones(50))
    assert int(out.tokens_per_expert_E.sum()) == 150


def test_topk_picks_highest_scores_and_restore_scale_multiplies_by_k():
    r = router(num_experts=6, top_k=2, restore_weight_scale=True)
    x = torch.randn(20, 8)
    out = r(x)
    scores = (x @ r.weight.T).softmax(-1)
    expected = scores.topk(2, dim=-1)
    assert torch.equal(out.topk_ids_NK.sort(-1).values, expected.indices.sort(-1).values)
    torch.testing.assert_close(out.topk_weights_NK.sum(-1), torch.full((20,), 2.0))
    torch.testing.assert_close(out.topk_weights_NK, 2 * expected.values / expected.values.sum(-1, keepdim=True))


def test_unnormalized_weights_are_raw_scores():
    r = router(num_experts=5, top_k=2, normalize_weights=False, gating="sigmoid")
    x = torch.randn(10, 8)
    out = r(x)
    scores = (x @ r.weight.T).sigmoid()
    torch.testing.assert_close(out.topk_weights_NK, scores.gather(-1, out.topk_ids_NK))


def test_bias_changes_selection_but_not_weights():
    r = router(num_experts=4, top_k=1)
    x = torch.randn(30, 8)
    r.expert_bias_E.copy_(torch.tensor([0.0, 0.0, 10.0, 0.0]))
    out = r(x)
    assert (out.topk_ids_NK == 2).all()
    scores = (x @ r.weight.T).softmax(-1)
    torch.testing.assert_close(out.topk_weights_NK[:, 0] / out.topk_weights_NK[:, 0], torch.ones(30))
    r2 = router(num_experts=4, top_k=2, normalize_weights=False)
    r2.weight.data.copy_(r.weight.data[:, :])
    r2.expert_bias_E.copy_(torch.tensor([0.0, 0.0, 10.0, 0.0]))
    out2 = r2(x)
    torch.testing.assert_close(out2.topk_weights_NK, scores.gather(-1, out2.topk_ids_NK))


def test_load_balancing_loss_hand_computed():
    # 2 tokens, 2 experts, top-1. Probabilities [0.75, 0.25] and [0.5, 0.5]; both pick expert 0.
    scores = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    counts = torch.tensor([2, 0])
    # f = [1, 0], P = [0.625, 0.375] -> E * sum f P = 2 * 0.625
    assert load_balancing_loss(scores, counts, gating="softmax").item() == pytest.approx(1.25)
    # Perfect balance gives 1.
    uniform = torch.full((4, 4), 0.25)
    assert load_balancing_loss(uniform, torch.tensor([2, 2, 2, 2]), gating="softmax").item() == pytest.approx(1.0)


def test_z_loss_hand_computed():
    r = Router(2, MoEConfig(num_experts=2, top_k=1))
    r.weight.data = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    x = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    # logits = x; logsumexp: log 2, log(e + e^2)
    expected = (math.log(2) ** 2 + math.log(math.e + math.e**2) ** 2) / 2
    assert r(x).z_loss.item() == pytest.approx(expected, rel=1e-6)


def test_aux_free_bias_moves_load_towards_uniform():
    torch.manual_seed(0)
    r = Router(8, MoEConfig(num_experts=4, top_k=1, bias_update_rate=0.01))
    r.weight.data = torch.randn(4, 8) * 0.1
    r.weight.data[0] += 0.5  # skew: expert 0 wins for most tokens
    x = torch.randn(512, 8).abs()

    def imbalance():
        counts = r(x).tokens_per_expert_E.float()
        return (counts.max() / counts.mean()).item()

    before = imbalance()
    history = []
    for _ in range(600):
        update_expert_bias(r.expert_bias_E, r(x).tokens_per_expert_E, 0.002)
        history.append(imbalance())
    # A sign update oscillates around balance: judge the average of the last iterations.
    after = sum(history[-100:]) / 100
    assert before > 2.0
    assert after < 1.25, (before, after)


def test_random_routing_is_uniform_and_keeps_the_graph():
    torch.manual_seed(0)
    r = router(num_experts=8, top_k=2, routing="random")
    r.weight.data[0] += 5.0  # learned routing would always pick expert 0
    x = torch.randn(8000, 8, requires_grad=True)
    out = r(x)
    assert all(a != b for a, b in out.topk_ids_NK.tolist()[:500])
    counts = out.tokens_per_expert_E.float()
    expected = 16000 / 8
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 24.3, counts  # chi-square, 7 dof, p = 0.001
    # Weights still come from the router: the router gets gradients, as with learned routing.
    (out.topk_weights_NK.square().sum() + out.lb_loss + out.z_loss).backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
