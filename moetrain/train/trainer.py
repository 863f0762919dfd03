"""The training loop.

`Trainer(cfg)` builds a run — runtime (device, process group, layout), data loader, `TrainEngine`
(model, optimizer, pipeline), run directory — and starts it fresh or resumes it. `fit()` is the
loop, and nothing else:

    while step < train.steps:
        batches = the step's micro-batches from the loader
        out = engine.train_step(batches, step)        forward/backward, clip, update
        step += 1
        every callback's on_step_end(out)              profile, skip limit, log + evaluate,
                                                       checkpoint, graceful stop

Nothing in a step copies from the device to the host: losses, gradient norms and routing
statistics stay device tensors, read only on logging steps (every `train.log_every`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from moetrain.model.counting import count_params
from moetrain.parallel.distributed import cpu_group
from moetrain.train import checkpoint as ckpt
from moetrain.train.callbacks import (
    Callback,
    Checkpointing,
    Evaluator,
    GracefulStop,
    MetricsLogger,
    SkipLimit,
    StepProfiling,
)
from moetrain.train.config import RunConfig
from moetrain.train.engine import Batch, StepOutput, TrainEngine
from moetrain.train.plot import plot_run
from moetrain.train.profiling import StepProfiler
from moetrain.train.run_dir import RunDir
from moetrain.train.runtime import setup_runtime
from moetrain.train.wandb_sink import require_wandb


class Trainer:
    def __init__(self, cfg: RunConfig, *, resume: bool = False, quiet: bool = False):
        """Build the run on this rank (every rank of a torchrun launch does the same); with
        `resume`, continue from the run directory's newest complete checkpoint."""
        self.cfg = cfg
        tc = cfg.train
        if tc.wandb:
            require_wandb()
        runtime = setup_runtime(cfg)
        self.device, self.par = runtime.device, runtime.par
        self.quiet = quiet or not self.par.is_main
        self.run = RunDir(tc.run_dir, main=self.par.is_main)
        torch.manual_seed(tc.seed)
        self.loader = cfg.data.build(
            micro_batch_size=tc.micro_batch_size,
            seed=tc.seed,
            vocab_size=cfg.model.vocab_size,
            dp_rank=self.par.dp_rank,
            dp_size=self.par.dims.dp,
        )
        self.engine = TrainEngine(cfg, self.par, self.device, eos_id=self.loader.eos_id)
        self.evaluator = Evaluator(cfg, self.par.dp_rank, self.par.dims.dp)
        self.checkpointing = Checkpointing()
        self.step = 0
        """Optimizer steps done."""
        self.resumed_from: Path | None = None
        self.summary: dict[str, Any] = {}
        self._stopping = False
        if resume:
            self._resume()
        else:
            self._start_fresh()
        self.run.write_config(cfg.to_yaml(), self.loader.tokenizer_path)

    # ---- the loop ------------------------------------------------------------------------------
    def next_batches(self) -> list[Batch]:
        """The next step's micro-batches (train.grad_accum_steps of them), this rank's rows."""
        return [self.loader.next_batch() for _ in range(self.cfg.train.grad_accum_steps)]

    def train_step(self) -> StepOutput:
        """One optimizer step on the next batches."""
        out = self.engine.train_step(self.next_batches(), self.step)
        self.step += 1
        return out

    def fit(self) -> dict[str, Any]:
        """Train to train.steps (or until stopped); write and return the run's summary."""
        tc = self.cfg.train
        self.summary = self.run.read_summary() if self.resumed_from is not None else {}
        if "initial_val_loss" not in self.summary and tc.eval_every > 0:
            self.summary["initial_val_loss"] = self.evaluator(self.engine)
        logger = MetricsLogger(self.evaluator)
        callbacks: list[Callback] = [
            *([StepProfiling(self.run.path / "profile")] if tc.profile else []),
            SkipLimit(),
            logger,
            self.checkpointing,
            GracefulStop(self.checkpointing),
        ]
        self._stopping = False
        completed = False
        try:
            for callback in callbacks:
                callback.on_fit_start(self)
            while self.step < tc.steps and not self._stopping:
                out = self.train_step()
                for callback in callbacks:
                    callback.on_step_end(self, out)
            completed = True
        finally:
            for callback in reversed(callbacks):
                callback.on_fit_end(self, completed)
        self.checkpointing.finish()
        self.summary.update(self._final_summary(logger.last_val))
        self.run.write_summary(self.summary)
        if tc.plot and self.par.is_main:
            self.summary["plot"] = str(plot_run(self.run.path))
        return self.summary

    def stop(self, **summary: Any) -> None:
        """End `fit` after the current step's callbacks; `summary` (e.g. stopped_at_step=N)
        goes into the run's summary."""
        self._stopping = True
        self.summary.update(summary)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self) -> Path:
        """Checkpoint this step now (see `Checkpointing.save`)."""
        return self.checkpointing.save(self)

    def finish_checkpoint(self) -> None:
        """Complete a checkpoint being written in the background (train.async_checkpoint)."""
        self.checkpointing.finish()

    def _start_fresh(self) -> None:
        """With train.init_from, from that checkpoint's model weights and a fresh optimizer."""
        self.run.start_fresh()
        if self.cfg.train.init_from:
            path = ckpt.resolve_checkpoint(self.cfg.train.init_from)
            self.engine.load_model_weights(path)
            if not self.quiet:
                print(f"initialized the model from {path} (train.init_from)", file=sys.stderr)

    def _resume(self) -> None:
        found = self.run.checkpoints()
        partial = self.run.partial_checkpoints()
        if partial and not self.quiet:
            print(
                f"--resume: ignoring {len(partial)} incomplete checkpoint(s) (interrupted while writing): "
                f"{', '.join(p.name for p in partial)}",
                file=sys.stderr,
            )
        if not found:
            if not self.quiet:
                print(f"--resume: no complete checkpoint in {self.run.path}; starting from step 0", file=sys.stderr)
            self._start_fresh()  # the records of the lost steps go too
            return
        path = found[-1][1]
        group = cpu_group() if self.par.dims.world_size > 1 else None
        trainer_state = ckpt.load_checkpoint(
            path, self.engine.checkpoint_state(), rank=self.par.rank, restore_rng=True, process_group=group
        )
        self.engine.checkpoint_loaded()
        self.step = trainer_state["step"]
        self.loader.load_state_dict(trainer_state["loader"])
        if "guard" in trainer_state:
            self.engine.guard.load_state_dict(trainer_state["guard"])
        self.resumed_from = path
        self.run.keep_records_up_to(self.step)
        if not self.quiet:
            print(f"resumed from {path} (step {self.step})", file=sys.stderr)

    # ---- the rest ------------------------------------------------------------------------------
    def profiler(self, out_dir: Path, wait: int | None = None) -> StepProfiler:
        """A profiler over `train.profile_steps` steps after `wait` (default train.profile_wait);
        with several ranks each writes its own rank-R subdirectory."""
        tc = self.cfg.train
        if self.par.dims.world_size > 1:
            out_dir = out_dir / f"rank{self.par.rank}"
        return StepProfiler(
            out_dir, tc.profile_wait if wait is None else wait, tc.profile_steps, self.device, quiet=self.quiet
        )

    def _final_summary(self, last_val: float | None) -> dict[str, Any]:
        counts = count_params(self.cfg.model)
        return {
            "run_dir": str(self.run.path),
            "steps": self.step,
            "final_val_loss": last_val,
            "total_params": counts.total,
            "active_params": counts.active,
            "checkpoint": self.run.last_checkpoint(),
            "metrics": str(self.run.metrics_file),
        }
