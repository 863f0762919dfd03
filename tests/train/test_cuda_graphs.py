"""compute.cuda_graphs on the CPU: `StepGraph` (src/moetrain/train/cuda_graphs.py) over
`EmulatedGraph`, which captures and replays aten operations with a CUDA graph's semantics
(numbers frozen at capture, tensors by their memory, capture runs nothing). The replayed steps
give the eager run's outputs, parameters, moments, guard state and router biases bit for bit
while the learning rate changes every step, the gradients are clipped and steps are skipped;
the emulator itself shows each fault a graph exposes; the config refuses what is not captured;
auto keeps the graph only where it pays."""

import math

import pytest
import torch
from support.graph_emulator import EmulatedGraph, FreedBeforeReplay, HostReadInCapture
from support.steps import carry_checkpoint, synthetic_batches

from moetrain.errors import ConfigError
from moetrain.parallel.dims import ParallelDims, ParallelState
from moetrain.train.cuda_graphs import AUTO_MIN_GAIN, WARMUP_STEPS, StepGraph
from moetrain.train.engine import TrainEngine


def one_process() -> ParallelState:
    return ParallelState(ParallelDims(world_size=1, dp=1, ep=1))


def graph_cfg(tiny_cfg, run_dir, *overrides: str):
    # The device path the GPU takes (torch's fused AdamW, the clipping factor and the skip decision
    # as tensors), a learning rate that changes every step, clipping that bites, the router bias.
    return tiny_cfg(
        run_dir,
        "train.device=cpu",
        "optim.fused=true",
        "optim.grad_clip=0.05",
        "schedule.warmup_steps=4",
        "model.moe.bias_update_rate=0.01",
        "guard.skip_spike_sigma=0",
        *overrides,
    )


@pytest.fixture
def cfg(tiny_cfg, tmp_path):
    return graph_cfg(tiny_cfg, tmp_path / "run")


def state(engine) -> dict[str, torch.Tensor]:
    out = {f"param {n}": p.detach().clone() for n, p in engine.model.named_parameters()}
    for name, tensors in engine.optimizer.checkpoint_tensors().items():
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

    captured_count = holder["count"]  # the program keeps the captured tensor: its memory stays
    total = g.capture(update)
    assert torch.equal(w, torch.zeros(3)) and float(n) == 0, "capturing runs nothing"
    lr[0] = 2.0
    grad.fill_(3.0)  # read at its memory: each replay sees what is there
    g.replay()
    grad.fill_(1.0)
    g.replay()
    assert torch.equal(w, torch.full((3,), 2.0)) and float(n) == 2 and float(total) == 6.0
    assert float(holder["count"]) == 1.0, "a rebound attribute stops changing under a graph"
    assert float(captured_count) == 0.0, "the graph reads the tensor it captured, never written"
    del captured_count  # now nothing but the graph refers to it: free memory on a GPU
    with pytest.raises(FreedBeforeReplay, match=r"aten.add.Tensor reads a \(\) torch.float32 tensor"):
        g.replay()
    with pytest.raises(HostReadInCapture):
        g.capture(lambda: bool(n > 0))


def test_memory_a_capture_allocated_holds_nothing_from_outside_the_graph_at_a_replay():
    """A tensor the capture allocated and the program fills after it (an address table made
    inside the capture, say) may share its block with a temporary the captured step wrote
    earlier: at a replay it holds that temporary, here unwritten memory. One made before the
    capture keeps what the program wrote."""
    g = EmulatedGraph()
    x = torch.ones(4)
    made = {}

    def step(table_before):
        made["table"] = torch.empty(4)  # allocated inside the capture
        return (x * table_before).sum(), (x * made["table"]).sum()

    before = torch.empty(4)
    outside, inside = g.capture(lambda: step(before))
    before.fill_(2.0)
    made["table"].fill_(2.0)  # filled after the capture, as the table once was
    g.replay()
    assert float(outside) == 8.0
    assert math.isnan(float(inside))


def test_a_guard_that_rebinds_its_counter_fails_the_replay_check(cfg, monkeypatch):
    """The emulator catches the fault it is there for: the guard's consecutive-skip counter
    rebound instead of written in place. The replay reads the counter the capture saw, which
    the program has dropped: free memory on a GPU."""
    from moetrain.train.guard import StepGuard

    real = StepGuard.check

    def rebinding(self, lm_loss, grad_norm):
        self.consecutive = self.consecutive.clone()  # a new tensor each step, as `c = (c + 1) * …` makes
        return real(self, lm_loss, grad_norm)

    monkeypatch.setattr(StepGuard, "check", rebinding)
    eager, graphed = step_engines(cfg)
    with pytest.raises(FreedBeforeReplay, match="made before the capture and since dropped"):
        for n in range(WARMUP_STEPS + 4):
            same_step(eager, cfg, n)
            same_step(graphed, cfg, n)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["parallel.stack=fsdp"], "parallel.stack=fsdp"),
        (["parallel.shard_optimizer=true"], "parallel.shard_optimizer=true"),
        (["optim.name=muon"], "optim.name=muon"),
        (["optim.name=lion"], "optim.name=lion"),
        (["optim.fused=false"], "optim.fused=false"),
    ],
)
def test_the_config_refuses_what_is_not_captured(tiny_cfg, tmp_path, overrides, field):
    with pytest.raises(ConfigError, match="compute.cuda_graphs=step captures the training step") as error:
        tiny_cfg(tmp_path / "run", "compute.cuda_graphs=step", *overrides).validate(world_size=1)
    assert field in str(error.value) and "compute.cuda_graphs=off" in str(error.value)


def test_off_on_the_command_line_is_the_choice_not_a_bool(tiny_cfg, tmp_path):
    from moetrain.train.config import CudaGraphs

    assert tiny_cfg(tmp_path / "run", "compute.cuda_graphs=off").compute.cuda_graphs == CudaGraphs.off


def test_auto_is_the_step_graph_where_nothing_refuses_it_and_off_elsewhere_saying_why(tiny_cfg, tmp_path):
    """compute.cuda_graphs=auto is never refused: it resolves to step where step would be accepted
    (one CUDA device, a layout the step graph captures), else to off with the
    reason step would have been refused for; the engine builds what it resolves to."""
    from moetrain.train.config import CudaGraphs

    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def choice(world_size, device, *overrides):
        cfg = tiny_cfg(tmp_path / "run", "compute.cuda_graphs=auto", "optim.bf16_weights=false", *overrides)
        cfg.validate(world_size=world_size, device=device)
        return cfg.cuda_graphs_choice(world_size, device)

    assert choice(1, cpu) == (CudaGraphs.off, "the step graph replays CUDA kernels, but the run is on cpu")
    mode, why = choice(2, cuda, "train.micro_batch_size=2")
    assert mode == CudaGraphs.off and "2 ranks" in why and "set train" not in why
    mode, why = choice(1, cuda, "compute.recompute=full")
    assert mode == CudaGraphs.off and "compute.recompute=full" in why
    mode, why = choice(1, cuda, "optim.name=muon")
    assert mode == CudaGraphs.off and "optim.name=muon" in why
    mode, why = choice(1, cuda, "logging.profile=true")  # a profile names the eager step's kernels
    assert mode == CudaGraphs.off and "the profiled steps run eagerly" in why
    mode, why = choice(1, cuda)  # the one layout left: the step graph, kept if it pays
    assert mode == CudaGraphs.step
    assert f"kept if its first replays take the device at least {AUTO_MIN_GAIN:.0%} less time" in why
    explicit = tiny_cfg(tmp_path / "run", "compute.cuda_graphs=step")
    assert explicit.cuda_graphs_choice(1, cuda) == (CudaGraphs.step, None)
    engine = TrainEngine(tiny_cfg(tmp_path / "run", "compute.cuda_graphs=auto"), one_process(), cpu)
    assert engine.cuda_graphs == CudaGraphs.off and engine.step_graph is None
    assert "on cpu" in engine.cuda_graphs_why


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_the_step_graph_refuses_recompute_naming_why(tiny_cfg, tmp_path, recompute):
    """torch's checkpoint reads the CUDA generator's state in each recomputed block's forward, and
    a capture forbids that (it would fail at the fourth step)."""
    with pytest.raises(ConfigError, match=f"compute.recompute={recompute}") as error:
        tiny_cfg(tmp_path / "run", "compute.cuda_graphs=step", f"compute.recompute={recompute}").validate(world_size=1)
    assert "generator" in str(error.value) and "compute.recompute=none" in str(error.value)


def test_the_config_refuses_several_ranks_and_the_cpu(tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", "compute.cuda_graphs=step", "train.micro_batch_size=2")
    with pytest.raises(ConfigError, match="2 ranks"):
        cfg.validate(world_size=2)
    with pytest.raises(ConfigError, match="train.device=cuda"):
        cfg.validate(world_size=1, device=torch.device("cpu"))
    cfg.validate(world_size=1)  # one rank, no device given: accepted


def test_the_step_graph_is_accepted_on_one_gpu(tiny_cfg, tmp_path):
    tiny_cfg(tmp_path / "run", "compute.cuda_graphs=step", "optim.bf16_weights=false").validate(
        world_size=1, device=torch.device("cuda")
    )


# ---- compute.cuda_graphs=step ----------------------------------------------------------------------


def step_engines(cfg):
    """(an eager engine, one whose `train_step` goes through `StepGraph` over the emulator), with
    the same initialization and the learning rate a device tensor in both."""
    torch.manual_seed(0)
    eager = TrainEngine(cfg, one_process(), torch.device("cpu"), eos_id=0)
    eager.optimizer.put_lr_on_device()
    torch.manual_seed(0)
    graphed = TrainEngine(cfg, one_process(), torch.device("cpu"), eos_id=0)
    graphed.step_graph = StepGraph(graphed, EmulatedGraph())
    return eager, graphed


def same_step(engine, cfg, n):
    """Step `n` with the random numbers seeded by `n`, so two engines draw the same ones."""
    torch.manual_seed(1000 + n)
    return engine.train_step(synthetic_batches(cfg, n), n)


def assert_same_output(a, b, n) -> None:
    assert a.lr == b.lr, n
    for name in ("lm_loss", "grad_norm", "mtp"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y) or (x.isnan().all() and y.isnan().all()), (n, name)
    assert not b.grad_norm.requires_grad and not b.lm_loss.requires_grad
    assert len(a.routing) == len(b.routing)
    for la, lb in zip(a.routing, b.routing):
        assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la), n


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.moe.routing=random"],
        ["compute.defer_expert_weight_grad=true"],
        ["model.mtp_depth=1", "data.document_masking=true"],
    ],
    ids=["learned", "random-routing", "deferred-expert-grads", "mtp-document-masking"],
)
def test_replayed_training_steps_give_the_eager_run_bit_for_bit(tiny_cfg, tmp_path, overrides):
    """compute.cuda_graphs=step: the whole step (two micro-batches' forward and backward, clipping,
    the guard, AdamW, the router bias, zeroed gradients, the routing statistics) captured once
    after the eager warm-up and replayed on new batches gives the eager run's outputs and state
    at every step: nothing it reads or writes is rebound, read on the host or left to Python
    between steps (random routing: each replay draws the numbers the eager step would)."""
    cfg = graph_cfg(tiny_cfg, tmp_path / "run", *overrides)
    eager, graphed = step_engines(cfg)
    steps = WARMUP_STEPS + 6
    for n in range(steps):
        assert_same_output(same_step(eager, cfg, n), same_step(graphed, cfg, n), n)
        assert_same(state(eager), state(graphed))
    assert graphed.cuda_graph_counts() == {"captures": 1, "replays": steps - WARMUP_STEPS, "eager": WARMUP_STEPS}
    assert graphed.step_graph.backend.on_stream == WARMUP_STEPS  # the warm-up ran on the capture's stream


def test_replayed_steps_skip_a_non_finite_loss_as_the_eager_run_does(cfg, monkeypatch):
    """The step guard's decision is device data inside the graph: replayed steps whose loss is
    not finite skip their update (and the router bias) as the eager ones do, and the run goes on
    after them. The loss is poisoned through a tensor both engines read at its memory."""
    poison = torch.ones(())
    real = TrainEngine.forward_backward
    monkeypatch.setattr(TrainEngine, "forward_backward", lambda self, batches: real(self, batches) * poison)
    eager, graphed = step_engines(cfg)
    poisoned = {WARMUP_STEPS + 1, WARMUP_STEPS + 2, WARMUP_STEPS + 5}
    for n in range(WARMUP_STEPS + 8):
        poison.fill_(math.nan if n in poisoned else 1.0)
        assert_same_output(same_step(eager, cfg, n), same_step(graphed, cfg, n), n)
        assert_same(state(eager), state(graphed))
    assert graphed.cuda_graph_counts()["replays"] == 8
    assert int(graphed.guard.skipped_total) == 3 and int(graphed.guard.consecutive) == 0


def judged_engines(cfg, monkeypatch, device_s):
    """(an eager engine, one built for compute.cuda_graphs=auto's step graph over the emulator,
    whose timed steps report `device_s` in order: the eager ones, then the replays)."""
    import moetrain.train.engine as engine_mod
    from moetrain.train.config import CudaGraphs

    backend = EmulatedGraph()
    backend.device_s = list(device_s)
    monkeypatch.setattr(engine_mod, "CudaGraph", lambda device: backend)
    eager, graphed = step_engines(cfg)
    graphed.step_graph = None
    graphed.cuda_graphs = CudaGraphs.step
    graphed._build_graphs(CudaGraphs.step, torch.device("cpu"), judge=True)
    return eager, graphed, backend


def test_auto_keeps_the_step_graph_whose_replays_are_faster(cfg, monkeypatch, capsys):
    """compute.cuda_graphs=auto's step graph times the eager steps before its capture but the
    first (which compiles) and its first replays; replays that took the device well under the
    eager steps' time keep the graph: it goes on replaying, bit for bit the eager run, and the
    run says why once, with the times."""
    from moetrain.train.config import CudaGraphs
    from moetrain.train.cuda_graphs import JUDGED_REPLAYS

    timed = [0.010] * (WARMUP_STEPS - 1) + [0.002] * JUDGED_REPLAYS
    eager, graphed, backend = judged_engines(cfg, monkeypatch, timed)
    steps = WARMUP_STEPS + JUDGED_REPLAYS + 3
    for n in range(steps):
        assert_same_output(same_step(eager, cfg, n), same_step(graphed, cfg, n), n)
    assert_same(state(eager), state(graphed))
    assert backend.device_s == []  # every planned timing was taken, no more
    assert graphed.cuda_graph_counts() == {"captures": 1, "replays": steps - WARMUP_STEPS, "eager": WARMUP_STEPS}
    assert graphed.cuda_graphs == CudaGraphs.step
    assert "2.0 ms against 10.0 ms eager (+80.0%" in graphed.cuda_graphs_why
    assert capsys.readouterr().err.count("note: compute.cuda_graphs=auto: a replayed step took") == 1


def test_auto_drops_the_step_graph_whose_replays_save_too_little(cfg, monkeypatch, capsys):
    """Replays that saved less than AUTO_MIN_GAIN of the eager steps' device time (the GPU was
    not waiting on the host) drop the graph: its memory goes back, the engine runs every later
    step eagerly, bit for bit the eager run, and the run says why once, with the times."""
    from moetrain.train.config import CudaGraphs
    from moetrain.train.cuda_graphs import JUDGED_REPLAYS

    timed = [0.010] * (WARMUP_STEPS - 1) + [0.0099] * JUDGED_REPLAYS
    eager, graphed, backend = judged_engines(cfg, monkeypatch, timed)
    for n in range(WARMUP_STEPS + JUDGED_REPLAYS + 3):
        assert_same_output(same_step(eager, cfg, n), same_step(graphed, cfg, n), n)
    assert_same(state(eager), state(graphed))
    assert backend.device_s == [] and backend.captures == 1 and backend.ops is None  # released
    assert graphed.step_graph is None and graphed.cuda_graphs == CudaGraphs.off
    assert graphed.cuda_graph_counts() is None
    why = graphed.cuda_graphs_why
    assert "9.9 ms against 10.0 ms eager (+1.0%" in why and "the steps run eagerly" in why
    assert capsys.readouterr().err.count("note: compute.cuda_graphs=auto") == 1


def test_a_routing_switch_or_a_load_runs_eager_steps_then_captures_again(cfg, tmp_path):
    """What changes what a step launches drops the graph: the next WARMUP_STEPS steps are eager,
    then it is captured again; the run stays the eager run's."""
    eager, graphed = step_engines(cfg)
    for n in range(2 * WARMUP_STEPS + 8):
        if n == WARMUP_STEPS + 2:
            for engine in (eager, graphed):
                engine.set_routing("random")
        if n == 2 * WARMUP_STEPS + 5:
            carry_checkpoint(eager, tmp_path / "saved", eager, graphed)
        assert_same_output(same_step(eager, cfg, n), same_step(graphed, cfg, n), n)
    assert_same(state(eager), state(graphed))
    # eager 0-2, captured at 3, replays 3-4; switch at 5: eager 5-7, captured at 8, replays 8-10;
    # load at 11: eager 11-13
    assert graphed.cuda_graph_counts() == {"captures": 2, "replays": 5, "eager": 3 * WARMUP_STEPS}
    assert graphed.step_graph.backend.on_stream == 3 * WARMUP_STEPS


@pytest.mark.parametrize("routing", ["learned", "random"])
def test_forward_and_backward_alone_replay_the_eager_passes_and_switching_back_trains_on(tiny_cfg, tmp_path, routing):
    """`moetrain bench --also-forward-backward` with the step graph: training steps, then
    forward and backward passes alone (`run(..., update=False)`, closed by `drop_step`), then
    training again, each captured after its own eager steps: the losses, routing statistics and
    state at every step are the eager run's, and the passes change no parameter."""
    cfg = graph_cfg(tiny_cfg, tmp_path / "run", f"model.moe.routing={routing}")
    eager, graphed = step_engines(cfg)
    phases = [(True, WARMUP_STEPS + 2), (False, WARMUP_STEPS + 3), (True, WARMUP_STEPS + 2)]
    n = 0
    for update, count in phases:
        before = state(graphed)
        for _ in range(count):
            torch.manual_seed(1000 + n)
            if update:
                expected = eager.train_step(synthetic_batches(cfg, n), n)
            else:
                expected = eager.drop_step(eager.forward_backward(synthetic_batches(cfg, n)))
            torch.manual_seed(1000 + n)
            got = graphed.step_graph.run(synthetic_batches(cfg, n), n, update=update)
            assert_same_output(expected, got, n)
            assert_same(state(eager), state(graphed))
            assert all(p.grad is None for p in graphed.model.parameters()), n
            n += 1
        if not update:
            assert_same(before, state(graphed))  # the passes moved nothing
    replays = sum(count - WARMUP_STEPS for _, count in phases)
    assert graphed.cuda_graph_counts() == {"captures": 3, "replays": replays, "eager": 3 * WARMUP_STEPS}
    assert graphed.step_graph.backend.on_stream == 3 * WARMUP_STEPS


def test_batches_of_another_shape_run_eagerly_then_are_captured_again_saying_so(cfg, capsys):
    """The graph's input buffers have the captured batches' shapes: a step with one micro-batch
    instead of two (or any other shape) resets the graph, says so once, runs the eager steps and
    captures again; the run stays the eager run's."""
    eager, graphed = step_engines(cfg)
    for n in range(2 * WARMUP_STEPS + 4):
        batches = synthetic_batches(cfg, n)
        if n >= WARMUP_STEPS + 2:
            batches = batches[:1]
        outs = []
        for engine in (eager, graphed):
            torch.manual_seed(1000 + n)
            outs.append(engine.train_step(batches, n))
        assert_same_output(*outs, n)
    assert_same(state(eager), state(graphed))
    # eager 0-2, captured at 3, replay 4; new shape at 5: eager 5-7, captured at 8, replay 9
    assert graphed.cuda_graph_counts() == {"captures": 2, "replays": 4, "eager": 2 * WARMUP_STEPS}
    assert capsys.readouterr().err.count("the step's batches changed shape") == 1


def test_a_router_bias_that_is_rebound_fails_the_step_replay_check(tiny_cfg, tmp_path, monkeypatch):
    """The emulator catches the fault it is there for: the router bias moved by a new tensor
    each step instead of in place. The captured step keeps reading the bias it had at capture,
    which the program has dropped: free memory on a GPU."""
    from moetrain.model.moe import MoE

    def rebinding(self, skip=None):
        load_E = self.step_tokens_per_expert_E.float()
        rate = self.cfg.bias_update_rate * (~skip).float()
        self.router.expert_bias_E = self.router.expert_bias_E + rate * torch.sign(load_E.mean() - load_E)

    monkeypatch.setattr(MoE, "update_bias", rebinding)
    cfg = graph_cfg(tiny_cfg, tmp_path / "run")
    eager, graphed = step_engines(cfg)
    with pytest.raises(FreedBeforeReplay, match="made before the capture and since dropped"):
        for n in range(WARMUP_STEPS + 4):
            same_step(eager, cfg, n)
            same_step(graphed, cfg, n)


@pytest.mark.parametrize("extra", [(), ("model.moe.routing=random",)], ids=["learned", "random-routing"])
def test_a_run_with_the_step_graph_logs_the_eager_runs_metrics_and_resumes_exactly(tiny_cfg, tmp_path, extra):
    """Through the trainer (evaluations, checkpoints and logging between replays): a run whose
    steps go through `StepGraph` writes the eager run's metrics.jsonl values and ends on its
    weights, bit for bit; so does one stopped after 5 steps and resumed (the load resets the
    graph: eager steps, then a new capture)."""
    from moetrain.train.metrics import read_metrics
    from moetrain.train.trainer import Trainer

    def trainer(name, graphed, resume=False):
        t = Trainer(graph_cfg(tiny_cfg, tmp_path / name, *extra), resume=resume, quiet=True)
        if graphed:
            t.engine.step_graph = StepGraph(t.engine, EmulatedGraph())
        else:
            t.engine.optimizer.put_lr_on_device()
        return t

    eager = trainer("eager", graphed=False)
    eager.fit()
    graphed = trainer("graphed", graphed=True)
    graphed.fit()
    part = trainer("part", graphed=True)
    for _ in range(5):
        part.train_step()
    part.save()
    del part
    resumed = trainer("part", graphed=True, resume=True)
    assert resumed.step == 5
    resumed.fit()

    def logged(name):
        keys = ("loss", "lm_loss", "grad_norm", "lb_loss", "z_loss", "lr", "val_loss", "expert_load_max_over_mean")
        return {r["step"]: [r.get(k) for k in keys] for r in read_metrics(tmp_path / name / "metrics.jsonl")}

    want = logged("eager")
    assert logged("graphed") == want
    resumed_log = logged("part")
    assert all(resumed_log[s] == want[s] for s in range(6, 13)), resumed_log
    assert graphed.engine.cuda_graph_counts() == {"captures": 1, "replays": 12 - WARMUP_STEPS, "eager": WARMUP_STEPS}
    for run in (graphed, resumed):
        assert_same(state(eager.engine), state(run.engine))


def eager_after_a_failed_capture(cfg, eager, graphed, steps: int, capsys) -> str:
    """Run `steps` steps on both engines, where the graphed one's capture fails: every step gives
    the eager run's outputs and state, none is captured or replayed, and the run says why once.
    Returns what it wrote on stderr."""
    for n in range(steps):
        assert_same_output(same_step(eager, cfg, n), same_step(graphed, cfg, n), n)
        assert_same(state(eager), state(graphed))
    assert graphed.cuda_graph_counts() == {"captures": 0, "replays": 0, "eager": steps}
    err = capsys.readouterr().err
    assert err.count("note: compute.cuda_graphs=step: the training step could not be captured") == 1
    return err


def test_a_step_that_cannot_be_captured_runs_eagerly_from_then_on_and_says_why(tiny_cfg, tmp_path, monkeypatch, capsys):
    """The fallback: a step that reads a device value on the host cannot be captured; the run
    says so once, naming the operation, and every step from the one that tried runs eagerly,
    with the eager run's results. The read comes in the update, after the backward, so the
    aborted capture had made gradients and multi-token sums, which must not leak into the next
    step."""
    from moetrain.model.moe import MoE

    real = MoE.update_bias

    def host_reading(self, skip=None):
        float(self.step_calls)  # a host read: fine eagerly, not in a graph
        return real(self, skip)

    monkeypatch.setattr(MoE, "update_bias", host_reading)
    cfg = graph_cfg(tiny_cfg, tmp_path / "run", "model.mtp_depth=1")
    err = eager_after_a_failed_capture(cfg, *step_engines(cfg), WARMUP_STEPS + 4, capsys)
    assert "_local_scalar_dense" in err and "as with compute.cuda_graphs=off" in err


def test_a_gradient_accumulated_off_the_capture_stream_fails_the_capture_and_the_run_goes_on_eagerly(cfg, capsys):
    """On the GPU, a parameter whose gradient accumulator autograd made on another stream
    accumulates there during the capture: outside the graph, into memory the graph does not own,
    so replays would read freed memory. The step graph's hook sees it (the emulator's
    `stale_stream`), the capture fails, and the run goes on eagerly with the eager run's results,
    saying why once."""
    eager, graphed = step_engines(cfg)
    graphed.step_graph.backend.stale_stream = True
    err = eager_after_a_failed_capture(cfg, eager, graphed, WARMUP_STEPS + 3, capsys)
    assert "accumulated outside the capture's stream" in err


def test_bench_keeps_the_step_graphs_warm_up_and_capture_out_of_the_timed_window(cfg):
    """`moetrain bench --warmup 2` with compute.cuda_graphs=step: the training step's window warms
    up over the eager steps and the capture, so every timed step is a replay; the other windows
    and runs without the step graph keep their warm-up."""
    from moetrain.bench import _OptimizerStep, warm_up_steps

    eager, graphed = step_engines(cfg)
    optimizer_step = object.__new__(_OptimizerStep)
    assert warm_up_steps(graphed, 0, "training step", None, 2) == WARMUP_STEPS + 1
    assert warm_up_steps(graphed, 0, "training step", None, 9) == 9
    assert warm_up_steps(eager, 0, "training step", None, 2) == 2
    assert warm_up_steps(graphed, 1, "forward+backward", None, 5) == WARMUP_STEPS + 1
    assert warm_up_steps(eager, 1, "forward+backward", None, 5) == 1
    assert warm_up_steps(graphed, 1, "optimizer step", optimizer_step, 0) == 1
    assert warm_up_steps(eager, 0, "forward+backward", None, 0) == 0
    for n in range(warm_up_steps(graphed, 0, "training step", None, 2)):
        graphed.train_step(synthetic_batches(cfg, n), n)
    replays = graphed.cuda_graph_counts()["replays"]
    graphed.train_step(synthetic_batches(cfg, 9), 9)  # the first timed step
    assert graphed.cuda_graph_counts()["replays"] == replays + 1


@pytest.mark.parametrize("replay_s, kept", [(0.002, True), (0.0099, False)])
def test_bench_keeps_autos_timed_replays_and_its_choice_out_of_the_timed_window(cfg, monkeypatch, replay_s, kept):
    """With compute.cuda_graphs=auto the training step's window also warms up over the replays
    auto times and the step where it keeps or drops the graph: the first timed step is settled
    (a replay that times nothing, or an eager step with the graph gone)."""
    from moetrain.bench import warm_up_steps
    from moetrain.train.cuda_graphs import JUDGED_REPLAYS

    timed = [0.010] * (WARMUP_STEPS - 1) + [replay_s] * JUDGED_REPLAYS
    _, graphed, backend = judged_engines(cfg, monkeypatch, timed)
    n_warm = warm_up_steps(graphed, 0, "training step", None, 2)
    assert n_warm == WARMUP_STEPS + JUDGED_REPLAYS + 1
    for n in range(n_warm):
        graphed.train_step(synthetic_batches(cfg, n), n)
    assert (graphed.step_graph is not None) == kept and backend.device_s == []
    if kept:
        assert not graphed.step_graph.judge
        assert warm_up_steps(graphed, 1, "forward+backward", None, 5) == WARMUP_STEPS + 1
