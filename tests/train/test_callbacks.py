"""The loop's pieces one at a time (src/moetrain/train/callbacks.py): the list the config builds, the
logging and evaluation schedule, the evaluator, the metrics sinks, checkpointing, the graceful
stop."""

import os
import signal

import pytest
import torch

from moetrain.errors import CheckpointError
from moetrain.parallel.dims import ParallelDims, ParallelState
from moetrain.train.callbacks import (
    Callback,
    Checkpointing,
    Evaluator,
    GracefulStop,
    MetricsLogger,
    is_eval_step,
    is_log_step,
    metrics_sinks,
)
from moetrain.train.console import ConsoleSink
from moetrain.train.engine import TrainEngine
from moetrain.train.metrics import JsonlSink, MetricsSink, TensorBoardSink, read_metrics
from moetrain.train.trainer import Trainer


def test_log_and_eval_schedule(tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", "train.steps=25", "train.log_every=10", "train.eval_every=6")
    logged = [s for s in range(1, 26) if is_log_step(cfg, s)]
    evaluated = [s for s in range(1, 26) if is_eval_step(cfg, s)]
    assert evaluated == [6, 12, 18, 24, 25]
    assert logged == [1, 6, 10, 12, 18, 20, 24, 25]
    never = tiny_cfg(tmp_path / "run", "train.eval_every=0")
    assert not any(is_eval_step(never, s) for s in range(1, 13))


def test_evaluator_gives_the_validation_loss_or_none_without_validation_data(tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", "train.device=cpu")
    engine = TrainEngine(cfg, ParallelState(ParallelDims(world_size=1, dp=1, ep=1)), torch.device("cpu"))
    loss = Evaluator(cfg, 0, 1)(engine)
    assert loss is not None and 0 < loss < 20
    cfg.data.synthetic = True
    assert Evaluator(cfg, 0, 1)(engine) is None


def test_checkpointing_saves_on_schedule_and_refuses_nan(tiny_cfg, tmp_path):
    trainer = Trainer(tiny_cfg(tmp_path / "run", "train.steps=4", "checkpoint.save_every=2"), quiet=True)
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
    trainer = Trainer(tiny_cfg(tmp_path / "run", "train.steps=6", "checkpoint.save_every=0"), quiet=True)
    saving = Checkpointing()
    stop = GracefulStop(saving)
    before = signal.getsignal(signal.SIGTERM)
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
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored


def test_the_loop_runs_the_callbacks_the_config_builds_in_order(tiny_cfg, tmp_path):
    trainer = Trainer(tiny_cfg(tmp_path / "run", "train.steps=3", "logging.profile=true"), quiet=True)
    names = [type(c).__name__ for c in trainer.callbacks]
    assert names == ["StepProfiling", "SkipLimit", "MetricsLogger", "Checkpointing", "GracefulStop"]
    assert trainer.callbacks[3] is trainer.checkpointing
    plain = Trainer(tiny_cfg(tmp_path / "plain", "train.steps=3"), quiet=True)
    assert [type(c).__name__ for c in plain.callbacks] == names[1:]

    seen = []

    class Record(Callback):
        def on_fit_start(self, trainer):
            seen.append("start")

        def on_step_end(self, trainer, out):
            seen.append(trainer.step)

        def on_fit_end(self, trainer, completed):
            seen.append(("end", completed))

    plain.callbacks.append(Record())
    plain.fit()
    assert seen == ["start", 1, 2, 3, ("end", True)]


def test_the_metrics_sinks_follow_the_config_and_get_every_record_in_order(tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", "train.steps=4", "train.log_every=2", "logging.tensorboard=true")
    trainer = Trainer(cfg, quiet=False)
    for quiet, kinds in ((False, [JsonlSink, TensorBoardSink, ConsoleSink]), (True, [JsonlSink, TensorBoardSink])):
        trainer.quiet = quiet
        sinks = metrics_sinks(trainer)
        assert [type(s) for s in sinks] == kinds
        for sink in sinks:
            sink.close()

    calls = []

    class Spy(MetricsSink):
        def __init__(self, name):
            self.name = name

        def step_done(self, step):
            calls.append((self.name, "step", step))

        def write(self, record, window):
            calls.append((self.name, "write", record["step"], window[1]))

        def close(self, failed=False):
            calls.append((self.name, "close", failed))

    logger = next(c for c in trainer.callbacks if isinstance(c, MetricsLogger))
    logger.on_fit_start(trainer)
    for sink in logger.sinks:
        sink.close()
    logger.sinks = [Spy("a"), Spy("b")]
    for _ in range(3):
        out = trainer.train_step()
        logger.on_step_end(trainer, out)
    logger.on_fit_end(trainer, completed=False)
    assert calls == [
        ("a", "write", 1, 1),
        ("b", "write", 1, 1),
        ("a", "write", 2, 1),
        ("b", "write", 2, 1),
        ("a", "step", 3),
        ("b", "step", 3),
        ("b", "close", True),
        ("a", "close", True),
    ]
    assert logger.sinks == [] and not read_metrics(trainer.run.metrics_file)


def test_a_resumed_runs_tensorboard_events_hold_each_step_trained_again_once(tiny_cfg, tmp_path):
    """Steps trained again after a resume were in RUN_DIR/tb twice (TensorBoard's Python loader drew
    both), while metrics.jsonl holds them once."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    flags = ["train.log_every=1", "checkpoint.save_every=2", "checkpoint.save_final=false"]
    flags += ["logging.tensorboard=true", "train.eval_every=0"]
    Trainer(tiny_cfg(tmp_path / "run", "train.steps=3", *flags), quiet=True).fit()  # events of steps 1-3, saved at 2
    resumed = Trainer(tiny_cfg(tmp_path / "run", "train.steps=4", *flags), resume=True, quiet=True)
    assert resumed.step == 2
    resumed.fit()
    events = EventAccumulator(str(tmp_path / "run" / "tb")).Reload().Scalars("loss")
    logged = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert [e.step for e in events] == [1, 2, 3, 4]
    assert [e.value for e in events] == pytest.approx([logged[s] for s in (1, 2, 3, 4)], rel=1e-6)
