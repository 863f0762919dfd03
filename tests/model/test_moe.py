"""The MoE layer against naive references: grouped GEMM vs a per-expert loop, E=1/k=1 vs dense."""

import pytest
import torch
import torch.nn.functional as F

from moetrain.model.config import MoEConfig
from moetrain.model.mlp import SwiGLU
from moetrain.model.moe import MoE


def make_moe(d=16, hidden=8, experts=6, top_k=3, shared=0, **kw) -> MoE:
    cfg = MoEConfig(num_experts=experts, top_k=top_k, expert_hidden=hidden, shared_hidden=shared, **kw)
    moe = MoE(d, cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


def naive_moe(moe: MoE, x_ND: torch.Tensor) -> torch.Tensor:
    """The definition, written independently: a loop over tokens and their k experts."""
    cfg = moe.cfg
    logits = x_ND @ moe.router.weight.T
    scores = logits.softmax(-1) if cfg.gating == "softmax" else logits.sigmoid()
    ids = (scores + moe.router.expert_bias_E).topk(cfg.top_k, dim=-1).indices
    w = scores.gather(-1, ids)
    if cfg.normalize_weights:
        w = w / w.sum(-1, keepdim=True)
    if cfg.restore_weight_scale:
        w = w * cfg.top_k
    F_ = cfg.expert_hidden
    rows = []
    for n in range(x_ND.shape[0]):
        y = torch.zeros_like(x_ND[n])
        for j in range(cfg.top_k):
            e = ids[n, j]
            gate_up = moe.experts.w_gate_up_E2FD[e] @ x_ND[n]
            h = F.silu(gate_up[:F_]) * gate_up[F_:]
            y = y + w[n, j] * (moe.experts.w_down_EDF[e] @ h)
        rows.append(y)
    out = torch.stack(rows)
    if moe.shared_expert is not None:
        out = out + moe.shared_expert(x_ND)
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(shared=8, restore_weight_scale=True),
        dict(gating="sigmoid", normalize_weights=False),
        dict(experts=4, top_k=4),
    ],
)
def test_grouped_moe_matches_per_expert_loop_forward_and_all_gradients(kw):
    torch.manual_seed(1)
    moe = make_moe(**kw)
    moe.eval()  # no aux-loss attachment: compare the routed computation itself
    ref = make_moe(**kw)
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(2, 9, 16)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    grad_out = torch.randn(2, 9, 16)

    y = moe(x)
    y_ref = naive_moe(ref, x_ref.view(-1, 16)).view(2, 9, 16)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)

    y.backward(grad_out)
    y_ref.backward(grad_out)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    ref_params = dict(ref.named_parameters())
    for name, p in moe.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-5, msg=name)


def test_one_expert_top1_equals_dense_swiglu():
    moe = make_moe(d=16, hidden=24, experts=1, top_k=1)
    moe.eval()
    dense = SwiGLU(16, 24)
    with torch.no_grad():
        dense.w_gate.weight.copy_(moe.experts.w_gate_up_E2FD[0, :24])
        dense.w_up.weight.copy_(moe.experts.w_gate_up_E2FD[0, 24:])
        dense.w_down.weight.copy_(moe.experts.w_down_EDF[0])
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(moe(x), dense(x), rtol=1e-6, atol=1e-6)


def test_aux_loss_gradient_reaches_the_router():
    """The attached aux loss must give the router exactly the gradient of weight·(lb + z)."""
    torch.manual_seed(2)
    moe = make_moe(lb_loss_weight=0.3, z_loss_weight=0.1)
    moe.runtime.backward_scale = 0.5
    x = torch.randn(2, 7, 16)
    moe(x).sum().backward()
    attached = moe.router.weight.grad.clone()

    moe.zero_grad()
    moe.eval()
    route = moe.router(x.view(-1, 16))
    explicit = moe(x).sum() + 0.5 * (0.3 * route.lb_loss + 0.1 * route.z_loss)
    explicit.backward()
    torch.testing.assert_close(attached, moe.router.weight.grad, rtol=1e-5, atol=1e-6)
    assert not torch.equal(attached, torch.zeros_like(attached))


def test_statistics_accumulate_per_step_and_reset():
    moe = make_moe(experts=4, top_k=2)
    moe.train()
    for _ in range(3):
        moe(torch.randn(1, 10, 16))
    stats = moe.end_step()
    assert int(stats["tokens_per_expert"].sum()) == 3 * 10 * 2
    assert int(stats["dropped"]) == 0
    assert int(moe.step_tokens_per_expert_E.sum()) == 0 and int(moe.step_calls) == 0


def test_recompute_counts_statistics_once_and_keeps_gradients():
    torch.manual_seed(3)
    moe = make_moe(routing="random")
    x = torch.randn(2, 6, 16, requires_grad=True)
    torch.manual_seed(5)
    moe(x).square().sum().backward()
    plain = {n: p.grad.clone() for n, p in moe.named_parameters()}
    plain_counts = moe.end_step()["tokens_per_expert"]
    moe.zero_grad()
    torch.manual_seed(5)
    moe.runtime.checkpoint(moe, x).square().sum().backward()  # as apply_recompute's blocks run
    assert not moe.runtime.recomputing
    recomputed_counts = moe.end_step()["tokens_per_expert"]
    assert torch.equal(plain_counts, recomputed_counts)
    for n, p in moe.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], msg=n)


def test_apply_recompute_flags_the_reruns_of_its_blocks_and_the_layer_has_no_graph_break_for_it():
    """The layer reads `runtime.recomputing`; it does not ask autograd whether it runs inside
    backward (a graph break under torch.compile, which would split each MoE block into two
    graphs): the checkpoints of the blocks apply_recompute wraps ask, around the block."""
    import torch._dynamo

    from moetrain.model.transformer import Transformer
    from moetrain.parallel.parallelize import apply_recompute
    from moetrain.presets import PRESETS

    model = Transformer(PRESETS["tiny"]().model)
    apply_recompute(model, every=2)
    checkpoints = {int(name): getattr(block, "checkpoint_fn", None) for name, block in model.blocks.items()}
    assert len(checkpoints) >= 2 and all((checkpoints[i] is not None) == (i % 2 == 0) for i in checkpoints)
    assert all(f.func == model.runtime.checkpoint for f in checkpoints.values() if f is not None)

    moe = make_moe()
    moe.train()
    reasons = [r.reason for r in torch._dynamo.explain(moe)(torch.randn(1, 8, 16)).break_reasons]
    assert not any("non-Tensor" in r for r in reasons), reasons

    def asking(x):  # the question the checkpoint asks, in traced code
        y = x + 1
        return y * 2 if torch._C._current_graph_task_id() != -1 else y

    reasons = [r.reason for r in torch._dynamo.explain(asking)(torch.randn(3)).break_reasons]
    assert any("non-Tensor" in r for r in reasons), reasons  # the check this test relies on
