"""The loop's pieces one at a time (moetrain/train/callbacks.py): the logging and evaluation
schedule, the evaluator, checkpointing, the graceful stop."""

import os
import signal

import pytest
import torch

from moetrain.errors import CheckpointError
from moetrain.parallel.dims import ParallelDims, ParallelState
from moetrain.train.callbacks import Checkpointing, Evaluator, GracefulStop, is_eval_step, is_log_step
from moetrain.train.engine import TrainEngine
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
