"""train.cuda_graphs=optimizer on the CPU: `UpdateGraph` (src/moetrain/train/cuda_graphs.py) over
`EmulatedGraph`, which captures and replays aten operations with a CUDA graph's semantics
(numbers frozen at capture, tensors by their memory, capture runs nothing). The replayed updates
give the eager run's parameters, moments, guard state and router biases bit for bit while the
learning rate changes every step, the gradients are clipped and steps are skipped; the
emulator itself shows each fault a graph exposes; the config refuses what is not captured."""

import math

import pytest
import torch

from moetrain.errors import ConfigError
from moetrain.parallel.dims import ParallelDims, ParallelState
from moetrain.testing.graph_emulator import EmulatedGraph, HostReadInCapture
from moetrain.testing.steps import synthetic_batches
from moetrain.train.cuda_graphs import MAX_UNPAID, NOTE_AFTER, PAYING_REPLAYS, UpdateGraph
from moetrain.train.engine import TrainEngine


def one_process() -> ParallelState:
    return ParallelState(ParallelDims(world_size=1, dp=1, ep=1))


@pytest.fixture
def cfg(tiny_cfg, tmp_path):
    # The device path the GPU takes (torch's fused AdamW, the clipping factor and the skip decision
    # as tensors), a learning rate that changes every step, clipping that bites, the router bias.
    return tiny_cfg(
        tmp_path / "run",
        "train.device=cpu",
        "optim.fused=true",
        "optim.grad_clip=0.05",
        "schedule.warmup_steps=4",
        "model.moe.bias_update_rate=0.01",
        "train.skip_spike_sigma=0",
    )


def engines(cfg, backend):
    """(an engine launching its update op by op, one replaying it through `backend`), with the
    same initialization and the learning rate a device tensor in both (an fp32 rate rounds
    torch's AdamW step size differently from a float64 number)."""
    torch.manual_seed(0)
    eager = TrainEngine(cfg, one_process(), torch.device("cpu"))
    eager.optimizer.put_lr_on_device()
    torch.manual_seed(0)
    graphed = TrainEngine(cfg, one_process(), torch.device("cpu"))
    graphed.update_graph = UpdateGraph(graphed, backend)
    return eager, graphed


def step(engine, cfg, n, poison=False):
    """Step `n`; `poison`: a non-finite loss, which the step guard must skip."""
    lm_loss = engine.forward_backward(synthetic_batches(cfg, n))
    if poison:
        lm_loss = lm_loss * math.nan
    return engine.optim_step(lm_loss, n)


def state(engine) -> dict[str, torch.Tensor]:
    out = {f"param {n}": p.detach().clone() for n, p in engine.model.named_parameters()}
    for name, tensors in engine.optimizer.state_dict_tensors().items():
        out.update({f"{k} {name}": v.detach().clone() for k, v in tensors.items()})
    for i, moe in enumerate(engine.model.moe_layers()):
        out[f"bias {i}"] = moe.router.expert_bias_E.clone()
    g = engine.guard
    out.update(history=g.history_W2.clone(), count=g.count.clone(), skipped=g.skipped_total.clone())
    out["consecutive"] = g.consecutive.clone()
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_replayed_updates_give_the_eager_run_bit_for_bit(cfg):
    backend = EmulatedGraph()
    eager, graphed = engines(cfg, backend)
    poisoned = {5, 6, 9}
    for n in range(12):
        out_e = step(eager, cfg, n, poison=n in poisoned)
        out_g = step(graphed, cfg, n, poison=n in poisoned)
        assert out_e.lr == out_g.lr
        assert torch.equal(out_e.grad_norm, out_g.grad_norm), n
        assert_same(state(eager), state(graphed))
    counts = graphed.update_graph.counts()
    # step 0 eager, step 1 eager and captured (its gradients lie where step 0's did), then replays
    assert counts == {"captures": 1, "replays": 10, "eager": 2}, counts
    assert int(graphed.guard.skipped_total) == 3 and int(graphed.guard.consecutive) == 0


def test_a_step_whose_gradients_moved_runs_eagerly_and_the_graph_is_captured_again(cfg):
    backend = EmulatedGraph()
    eager, graphed = engines(cfg, backend)
    for n in range(8):
        if n in (3, 5):
            backend.move()  # this step's gradients lie elsewhere, and so do the next ones
        step(eager, cfg, n)
        step(graphed, cfg, n)
        assert_same(state(eager), state(graphed))
    # eager: 0, 1 (capture), 3 (moved), 4 (capture), 5 (moved), 6 (capture); replays: 2, 7
    assert graphed.update_graph.counts() == {"captures": 3, "replays": 2, "eager": 6}


def test_captures_that_do_not_pay_end_in_eager_steps_and_paid_ones_do_not_count(cfg):
    """Gradients that move every other step: each capture serves one replay at most, and after
    MAX_UNPAID such captures the steps stay eager. A capture that served PAYING_REPLAYS replays
    (an evaluation moved the gradients once, later) does not count against the run."""
    backend = EmulatedGraph()
    graph = UpdateGraph(_Stub(), backend)
    for _ in range(2 + PAYING_REPLAYS):  # captured on the second step, then replays that pay
        graph.run(torch.zeros(()))
    assert graph.counts() == {"captures": 1, "replays": PAYING_REPLAYS, "eager": 2}
    for n in range(6 * MAX_UNPAID):
        if n % 2 == 0:
            backend.move()
        graph.run(torch.zeros(()))
    assert graph.captures == 1 + MAX_UNPAID and graph.unpaid == MAX_UNPAID - 1  # the last one still serving
    before = graph.counts()
    for _ in range(4):
        backend.move()
        graph.run(torch.zeros(()))
        graph.run(torch.zeros(()))
    after = graph.counts()
    assert after["captures"] == before["captures"] and after["eager"] == before["eager"] + 8


def test_a_run_whose_gradients_move_every_step_says_so_once(capsys):
    backend = EmulatedGraph()
    graph = UpdateGraph(_Stub(), backend)
    for _ in range(2 * NOTE_AFTER):
        backend.move()
        graph.run(torch.zeros(()))
    assert graph.counts() == {"captures": 0, "replays": 0, "eager": 2 * NOTE_AFTER}
    err = capsys.readouterr().err
    assert err.count("note: train.cuda_graphs=optimizer:") == 1 and "ran eagerly" in err


class _Stub:
    """What `UpdateGraph` calls of an engine, with one gradient and an update that counts."""

    def __init__(self):
        self.grad = torch.ones(4)
        self.n = torch.zeros(())
        self.optimizer = self

    def put_lr_on_device(self):
        pass

    def graph_inputs(self):
        return [self.grad]

    def update_tensors(self, lm_loss):
        self.n.add_(1)
        return self.n.clone()


def test_the_engine_counts_each_replay_and_eager_step_once(cfg):
    """Through the engine: an evaluation-like disruption (moved gradients) costs one eager step
    and one capture; the updates stay the eager run's."""
    backend = EmulatedGraph()
    eager, graphed = engines(cfg, backend)
    for n in range(2 * MAX_UNPAID + 12):
        if n == 10:
            backend.move()
        step(eager, cfg, n)
        step(graphed, cfg, n)
    assert_same(state(eager), state(graphed))
    assert graphed.update_graph.counts() == {"captures": 2, "replays": 2 * MAX_UNPAID + 8, "eager": 4}


def test_the_emulator_shows_what_a_graph_freezes():
    g = EmulatedGraph()
    w, n, grad = torch.zeros(3), torch.zeros(()), torch.ones(3)
    holder = {"count": torch.zeros(())}
    lr = [0.5]

    def update():
        w.add_(grad * lr[0])  # a number: frozen at capture
        n.add_(1)  # in place: counts every replay
        holder["count"] = holder["count"] + 1  # rebound: the graph writes the tensor it captured
        return w.sum()

    total = g.capture(update, [grad])
    assert torch.equal(w, torch.zeros(3)) and float(n) == 0, "capturing runs nothing"
    lr[0] = 2.0
    g.replay([torch.full((3,), 3.0)])  # the step's gradient stands in for the captured one
    g.replay([torch.ones(3)])
    assert torch.equal(w, torch.full((3,), 2.0)) and float(n) == 2 and float(total) == 6.0
    assert float(holder["count"]) == 1.0, "a rebound attribute stops changing under a graph"
    with pytest.raises(HostReadInCapture):
        g.capture(lambda: bool(n > 0), [])


def test_a_guard_that_rebinds_its_counter_fails_the_replay_check(cfg, monkeypatch):
    """The check above catches the fault it is there for: the guard's consecutive-skip counter
    rebound instead of written in place."""
    from moetrain.train.guard import StepGuard

    real = StepGuard.check

    def rebinding(self, lm_loss, grad_norm):
        self.consecutive = self.consecutive.clone()  # a new tensor each step, as `c = (c + 1) * …` makes
        return real(self, lm_loss, grad_norm)

    monkeypatch.setattr(StepGuard, "check", rebinding)
    eager, graphed = engines(cfg, EmulatedGraph())
    for n in range(6):
        step(eager, cfg, n, poison=n >= 3)
        step(graphed, cfg, n, poison=n >= 3)
    assert int(eager.guard.consecutive) == 3 and int(graphed.guard.consecutive) != 3


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["parallel.stack=fsdp"], "parallel.stack=fsdp"),
        (["parallel.shard_optimizer=true"], "parallel.shard_optimizer=true"),
        (["optim.name=muon"], "optim.name=muon"),
        (["optim.fused=false"], "optim.fused=false"),
    ],
)
def test_the_config_refuses_what_is_not_captured(tiny_cfg, tmp_path, overrides, field):
    with pytest.raises(ConfigError, match="train.cuda_graphs=optimizer") as error:
        tiny_cfg(tmp_path / "run", "train.cuda_graphs=optimizer", *overrides).validate(world_size=1)
    assert field in str(error.value) and "train.cuda_graphs=off" in str(error.value)


def test_off_on_the_command_line_is_the_choice_not_a_bool(tiny_cfg, tmp_path):
    from moetrain.train.config import CudaGraphs

    assert tiny_cfg(tmp_path / "run", "train.cuda_graphs=off").train.cuda_graphs == CudaGraphs.off


def test_the_config_refuses_several_ranks_and_the_cpu(tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", "train.cuda_graphs=optimizer", "train.micro_batch_size=2")
    with pytest.raises(ConfigError, match="2 ranks"):
        cfg.validate(world_size=2)
    with pytest.raises(ConfigError, match="train.device=cuda"):
        cfg.validate(world_size=1, device=torch.device("cpu"))
    cfg.validate(world_size=1)  # one rank, no device given: accepted
