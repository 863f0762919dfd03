"""The MoE auxiliary losses reach the router's gradient in compiled blocks as they do eager."""

import pytest
import torch

from moetrain.parallel.parallelize import apply_compile
from moetrain.presets import resolve_config

SMALL = ["model.d_model=64", "model.moe.expert_hidden=32", "model.vocab_size=256", "model.n_layers=2"]


def _grads(overrides: list[str], compile: bool, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of one forward and backward (fp32, on `tokens`' device)."""
    cfg = resolve_config("tiny", SMALL + overrides)
    model = cfg.model.build(device=tokens.device)
    model.init_weights(seed=0)
    model.runtime.backward_scale = 0.25  # as the trainer sets it for 4 micro-batches
    if compile:
        apply_compile(model)
    model(tokens, targets_BT=tokens, loss_chunk_tokens=0).backward()
    return {n.replace("_orig_mod.", ""): p.grad for n, p in model.named_parameters() if p.grad is not None}


def check_compiled_aux_gradients(tokens: torch.Tensor, tolerance: float) -> None:
    """The compiled model's gradients are the eager one's within `tolerance` (relative, per
    parameter), and the aux losses carry a real share of each router's gradient."""
    eager, compiled = _grads([], False, tokens), _grads([], True, tokens)
    without_aux = _grads(["model.moe.lb_loss_weight=0", "model.moe.z_loss_weight=0"], False, tokens)
    assert eager.keys() == compiled.keys()
    routers = [n for n in eager if n.endswith("router.weight")]
    assert routers
    for name in routers:  # the aux losses carry a large share of the router's gradient here
        assert (eager[name] - without_aux[name]).norm() > 0.1 * eager[name].norm(), name
    for name, grad in eager.items():
        assert (compiled[name] - grad).norm() <= tolerance * grad.norm() + 1e-12, name


def test_compiled_blocks_give_the_aux_losses_their_gradient():
    check_compiled_aux_gradients(torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)), 1e-4)


@pytest.mark.gpu
def test_compiled_blocks_give_the_aux_losses_their_gradient_on_cuda():
    """Inductor's CUDA backend keeps the aux losses' gradient too (fp32 on the GPU; TF32 off, so
    the products differ from eager by summation order only)."""
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    check_compiled_aux_gradients(tokens.cuda(), 1e-3)
