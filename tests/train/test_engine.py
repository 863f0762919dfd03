"""`TrainEngine` through its public interface only: a step is forward_backward + optim_step, state
round-trips bit for bit, routing switches by a method, and a step can close without an update;
and the loop's pieces (schedule of logging/evaluation, evaluator, checkpointing, graceful stop)
one at a time."""

import os
import signal

import pytest
import torch

from moetrain.data.loader import SyntheticLoader
from moetrain.errors import CheckpointError
from moetrain.model.config import Routing
from moetrain.parallel.dims import ParallelDims, ParallelState
from moetrain.train.callbacks import Checkpointing, Evaluator, GracefulStop, is_eval_step, is_log_step
from moetrain.train.engine import TrainEngine
from moetrain.train.trainer import Trainer


def one_process() -> ParallelState:
    return ParallelState(ParallelDims(world_size=1, dp=1, ep=1))


def batches(cfg, step: int):
    loader = SyntheticLoader(
        seq_len=cfg.data.seq_len,
        micro_batch_size=cfg.train.micro_batch_size,
        seed=step,
        vocab_size=cfg.model.vocab_size,
    )
    return [loader.next_batch() for _ in range(cfg.train.grad_accum_steps)]


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


def test_state_dict_round_trip_continues_bit_for_bit(cfg):
    torch.manual_seed(0)
    a = TrainEngine(cfg, one_process(), torch.device("cpu"))
    for step in range(3):
        a.train_step(batches(cfg, step), step)
    b = TrainEngine(cfg, one_process(), torch.device("cpu"))
    copied = {section: {k: v.clone() for k, v in tensors.items()} for section, tensors in a.state_dict().items()}
    b.load_state_dict(copied)
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
    assert any(k.endswith("w_down_EDF/0") for k in a.state_dict()["model"])


def test_drop_step_changes_no_state_and_set_routing_switches_the_routers(cfg):
    engine = TrainEngine(cfg, one_process(), torch.device("cpu"))
    before = params(engine)
    moments = {n: {k: v.clone() for k, v in s.items()} for n, s in engine.optimizer.state_dict_tensors().items()}
    biases = [m.router.expert_bias_E.clone() for m in engine.model.moe_layers()]
    out = engine.drop_step(engine.forward_backward(batches(cfg, 0)))
    assert float(out.grad_norm) == 0.0 and out.lr == 0.0
    assert sum(int(s["tokens_per_expert"].sum()) for s in out.routing) > 0  # statistics were read
    assert all(int(m.step_calls) == 0 for m in engine.model.moe_layers())  # and reset
    for (n, p), q in zip(before.items(), params(engine).values()):
        assert torch.equal(p, q), n
    for n, s in engine.optimizer.state_dict_tensors().items():
        assert all(torch.equal(s[k], moments[n][k]) for k in s), n
    assert all(torch.equal(a, m.router.expert_bias_E) for a, m in zip(biases, engine.model.moe_layers()))
    assert all(p.grad is None or not p.grad.any() for p in engine.model.parameters())

    engine.set_routing("random")
    assert {m.router.routing for m in engine.model.moe_layers()} == {Routing.random}
    assert cfg.model.moe.routing == Routing.learned  # the config is not touched
    with pytest.raises(ValueError):
        engine.set_routing("smart")


def test_log_and_eval_schedule(tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", "train.steps=25", "train.log_every=10", "train.eval_every=6")
    logged = [s for s in range(1, 26) if is_log_step(cfg, s)]
    evaluated = [s for s in range(1, 26) if is_eval_step(cfg, s)]
    assert evaluated == [6, 12, 18, 24, 25]
    assert logged == [1, 6, 10, 12, 18, 20, 24, 25]
    never = tiny_cfg(tmp_path / "run", "train.eval_every=0")
    assert not any(is_eval_step(never, s) for s in range(1, 13))


def test_evaluator_gives_the_validation_loss_or_none_without_validation_data(cfg):
    engine = TrainEngine(cfg, one_process(), torch.device("cpu"))
    loss = Evaluator(cfg, 0, 1)(engine)
    assert loss is not None and 0 < loss < 20
    cfg.data.synthetic = True
    assert Evaluator(cfg, 0, 1)(engine) is None


def test_checkpointing_saves_on_schedule_and_refuses_nan(tiny_cfg, tmp_path):
    trainer = Trainer(tiny_cfg(tmp_path / "run", "train.steps=4", "train.save_every=2"), quiet=True)
    saving = Checkpointing()
    for _ in range(4):
        out = trainer.train_step()
        saving.on_step_end(trainer, out)
    assert [s for s, _ in trainer.run.checkpoints()] == [2, 4] and saving.last_saved_step == 4
    with torch.no_grad():
        next(trainer.engine.model.parameters())[0] = float("nan")
    with pytest.raises(CheckpointError, match="NaN or inf"):
        saving.save(trainer)


def test_graceful_stop_saves_once_and_stops_the_loop(tiny_cfg, tmp_path):
    trainer = Trainer(tiny_cfg(tmp_path / "run", "train.steps=6", "train.save_every=0"), quiet=True)
    saving = Checkpointing()
    stop = GracefulStop(saving)
    stop.on_fit_start(trainer)
    try:
        out = trainer.train_step()
        stop.on_step_end(trainer, out)
        assert not trainer.run.checkpoints()
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the flag is set, nothing else happens
        out = trainer.train_step()
        stop.on_step_end(trainer, out)
    finally:
        stop.on_fit_end(trainer, completed=True)
    assert [s for s, _ in trainer.run.checkpoints()] == [2]
    assert trainer.summary["stopped_at_step"] == 2
    assert signal.getsignal(signal.SIGTERM) is not stop._handle  # handlers restored
