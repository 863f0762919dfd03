"""`TrainEngine` through its public interface only: a step is forward_backward + optim_step, state
round-trips bit for bit, routing switches by a method, and a step can close without an update."""

import pytest
import torch
from support.steps import carry_checkpoint, synthetic_batches

from moetrain.model.config import Routing
from moetrain.parallel.dims import ParallelDims, ParallelState
from moetrain.train.engine import TrainEngine


def one_process() -> ParallelState:
    return ParallelState(ParallelDims(world_size=1, dp=1, ep=1))


batches = synthetic_batches


@pytest.fixture
def cfg(tiny_cfg, tmp_path):
    return tiny_cfg(tmp_path / "run", "model.moe.bias_update_rate=0.01", "train.device=cpu")


def params(engine):
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_train_step_is_forward_backward_then_optim_step(cfg):
    torch.manual_seed(0)
    a = TrainEngine(cfg, one_process(), torch.device("cpu"))
    torch.manual_seed(0)
    b = TrainEngine(cfg, one_process(), torch.device("cpu"))
    for step in range(3):
        out_a = a.train_step(batches(cfg, step), step)
        out_b = b.optim_step(b.forward_backward(batches(cfg, step)), step)
        assert torch.equal(out_a.lm_loss, out_b.lm_loss) and torch.equal(out_a.grad_norm, out_b.grad_norm)
        assert out_a.lr == out_b.lr and len(out_a.routing) == cfg.model.num_moe_layers
    for (n, p), q in zip(params(a).items(), params(b).values()):
        assert torch.equal(p, q), n


def test_a_checkpoint_round_trip_continues_bit_for_bit(cfg, tmp_path):
    torch.manual_seed(0)
    a = TrainEngine(cfg, one_process(), torch.device("cpu"))
    for step in range(3):
        a.train_step(batches(cfg, step), step)
    b = TrainEngine(cfg, one_process(), torch.device("cpu"))
    carry_checkpoint(a, tmp_path / "saved", b)
    biases = [m.router.expert_bias_E for m in a.model.moe_layers()]
    assert any(bool(x.abs().max() > 0) for x in biases), "the aux-free bias should have moved"
    for moe_a, moe_b in zip(a.model.moe_layers(), b.model.moe_layers()):
        assert torch.equal(moe_a.router.expert_bias_E, moe_b.router.expert_bias_E)
    rng = torch.get_rng_state()
    out_a = a.train_step(batches(cfg, 3), 3)
    torch.set_rng_state(rng)
    out_b = b.train_step(batches(cfg, 3), 3)
    assert torch.equal(out_a.lm_loss, out_b.lm_loss) and torch.equal(out_a.grad_norm, out_b.grad_norm)
    for (n, p), q in zip(params(a).items(), params(b).values()):
        assert torch.equal(p, q), n
    # the experts are split per global index in the layout-free format
    assert any(k.endswith("w_down_EDF/0") for k in a.checkpoint_state()["model"])


def test_drop_step_changes_no_state_and_set_routing_switches_the_routers(cfg):
    engine = TrainEngine(cfg, one_process(), torch.device("cpu"))
    before = params(engine)
    moments = {n: {k: v.clone() for k, v in s.items()} for n, s in engine.optimizer.checkpoint_tensors().items()}
    biases = [m.router.expert_bias_E.clone() for m in engine.model.moe_layers()]
    out = engine.drop_step(engine.forward_backward(batches(cfg, 0)))
    assert float(out.grad_norm) == 0.0 and out.lr == 0.0
    assert sum(int(s["tokens_per_expert"].sum()) for s in out.routing) > 0  # statistics were read
    assert all(int(m.step_calls) == 0 for m in engine.model.moe_layers())  # and reset
    for (n, p), q in zip(before.items(), params(engine).values()):
        assert torch.equal(p, q), n
    for n, s in engine.optimizer.checkpoint_tensors().items():
        assert all(torch.equal(s[k], moments[n][k]) for k in s), n
    assert all(torch.equal(a, m.router.expert_bias_E) for a, m in zip(biases, engine.model.moe_layers()))
    assert all(p.grad is None or not p.grad.any() for p in engine.model.parameters())

    engine.set_routing("random")
    assert {m.router.routing for m in engine.model.moe_layers()} == {Routing.random}
    assert cfg.model.moe.routing == Routing.learned  # the config is not touched
    with pytest.raises(ValueError):
        engine.set_routing("smart")


def test_a_batch_bound_for_a_gpu_is_pinned_first_and_nothing_else_is():
    """`pinned_for`: a CPU tensor bound for a CUDA device goes through page-locked memory (its
    copy then queues without waiting for the stream); a tensor for the CPU, or one pinned or on
    a device already, is handed back as it is."""
    from moetrain.transfer import pinned_for

    batch = torch.arange(6).reshape(2, 3)
    assert pinned_for(batch, torch.device("cpu")) is batch
    batch.pin_memory = lambda: "page-locked copy"  # a CPU-only build cannot pin
    assert pinned_for(batch, torch.device("cuda")) == "page-locked copy"
    batch.is_pinned = lambda: True
    assert pinned_for(batch, torch.device("cuda")) is batch
