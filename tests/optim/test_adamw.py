import pytest
import torch

from moetrain.model.config import MoEConfig, TransformerConfig
from moetrain.optim.base import param_groups
from moetrain.optim.config import ScheduleConfig
from moetrain.optim.schedule import lr_at


def test_no_weight_decay_on_norms_embeddings_biases():
    cfg = TransformerConfig(
        vocab_size=32,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        moe=MoEConfig(num_experts=2, top_k=1, expert_hidden=8),
    )
    model = cfg.build()
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(32))  # a bias, to check it is excluded
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert "embed.weight" in no_decay_names and "lm_head.bias" in no_decay_names and "norm.weight" in no_decay_names
    assert "lm_head.weight" in decay_names and "blocks.1.ffn.experts.w_down_EDF" in decay_names
    assert not any("norm" in n for n in decay_names)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
def test_schedules_warm_up_and_end_where_configured(kind):
    cfg = ScheduleConfig(kind=kind, warmup_steps=10, min_lr_ratio=0.1, decay_fraction=0.2)
    lrs = [lr_at(s, 100, 1.0, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    if kind == "constant":
        assert lrs[-1] == 1.0
    else:
        assert lrs[-1] == pytest.approx(0.1)
        assert all(a >= b - 1e-12 for a, b in zip(lrs[10:], lrs[11:]))
    if kind == "wsd":
        assert lrs[79] == 1.0 and lrs[80] < 1.0


def test_clipping_folded_into_the_fused_adamw_kernel_matches_scaling_the_gradients():
    """With fused AdamW (CUDA's default) the clip factor goes to the kernel as its gradient
    divisor instead of a separate pass over the gradients: the same update."""
    import copy

    from moetrain.optim.config import OptimConfig
    from moetrain.optim.replicated import ReplicatedAdamW
    from moetrain.parallel.dims import ParallelDims, ParallelState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    state = ParallelState(ParallelDims(world_size=1, dp=1, ep=1))
    results = []
    for fused in (False, True):
        m = copy.deepcopy(model)
        opt = ReplicatedAdamW(m, state, OptimConfig(lr=1e-2, fused=fused))  # fused: CUDA's default
        assert opt.fused == fused
        for step in range(3):
            m(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).square().sum().backward()
            norm = opt.clip_grad_norm(0.1)  # far below the gradient norm: clipping is active
            assert norm > 1.0
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
