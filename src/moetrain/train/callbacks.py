"""What hangs off the training loop: each a `Callback` the `Trainer` calls at the start of `fit`,
after every step, and at the end (also when the run fails), in the order `callbacks_from_config`
lists them: StepProfiling, SkipLimit, MetricsLogger (the records handed to each sink of
`metrics_sinks`), Checkpointing, GracefulStop. Each reads the trainer's public state (`step`,
`engine`, `cfg`, `run`) and nothing else.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moetrain.data.loader import val_batches
from moetrain.data.tokens import open_source
from moetrain.errors import CheckpointError
from moetrain.parallel.distributed import cpu_group
from moetrain.train.checkpoint_io import PendingCheckpoint, ShardRole, save_checkpoint
from moetrain.train.config import RunConfig
from moetrain.train.console import ConsoleSink
from moetrain.train.engine import StepOutput, TrainEngine
from moetrain.train.metrics import JsonlSink, MetricsSink, TensorBoardSink
from moetrain.train.profiling import StepProfiler
from moetrain.train.run_dir import checkpoints_dir
from moetrain.train.wandb_sink import WandbSink

if TYPE_CHECKING:
    from moetrain.train.trainer import Trainer


class Callback:
    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first step of `fit`."""

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        """After each optimizer step (`trainer.step` counts it already)."""

    def on_fit_end(self, trainer: Trainer, completed: bool) -> None:
        """After the last step, or when the run failed (`completed` false): release what
        `on_fit_start` took."""


def is_log_step(cfg: RunConfig, step: int) -> bool:
    """Steps that write a record (and synchronize the device): every train.log_every, the
    first, the last, and every evaluation step."""
    tc = cfg.train
    return step % tc.log_every == 0 or step == 1 or step == tc.steps or is_eval_step(cfg, step)


def is_eval_step(cfg: RunConfig, step: int) -> bool:
    tc = cfg.train
    return tc.eval_every > 0 and (step % tc.eval_every == 0 or step == tc.steps)


class Evaluator:
    """The validation loss per token over the first train.eval_tokens tokens of the validation data
    (data.val, or the first source's val split): the same sequences whatever the micro-batch and
    the layout, so curves compare across runs."""

    def __init__(self, cfg: RunConfig, dp_rank: int, dp_size: int):
        self.cfg, self.dp_rank, self.dp_size = cfg, dp_rank, dp_size
        self.path = cfg.data.val_path()

    def __call__(self, engine: TrainEngine) -> float | None:
        """Mean validation loss over all ranks (a collective); None without validation data."""
        if self.path is None:
            return None
        tc = self.cfg.train
        batches = val_batches(
            self.path,
            seq_len=self.cfg.data.seq_len,
            num_sequences=tc.eval_sequences(self.cfg.data.seq_len),
            micro_batch_size=tc.micro_batch_size,
            vocab_size=self.cfg.model.vocab_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
        )
        return engine.eval_loss(batches)

    def tokens(self) -> int | None:
        """The tokens each evaluation predicts (at most the validation split's; None without one)."""
        if self.path is None:
            return None
        seq = self.cfg.data.seq_len
        available = open_source(self.path, "val", seq_len=seq).num_windows(seq)
        return min(self.cfg.train.eval_sequences(seq), available) * seq


class StepProfiling(Callback):
    """torch.profiler (and a CUDA memory snapshot) over a window of steps (src/moetrain/train/profiling.py)."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.profiler: StepProfiler | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        self.profiler = trainer.profiler(self.out_dir)

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        self.profiler.step()

    def on_fit_end(self, trainer: Trainer, completed: bool) -> None:
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.close()


class SkipLimit(Callback):
    """Ends the run (`TooManySkippedSteps`) after guard.max_consecutive_skips skipped updates in
    a row. The count is a device value: read every step on CPU, on logging steps on GPU (the
    device is synchronized there anyway), so the check adds no host sync to a step."""

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        if trainer.device.type == "cpu" or is_log_step(trainer.cfg, trainer.step):
            guard, step = trainer.engine.guard, trainer.step
            consecutive = int(guard.consecutive)
            # The streak began at step − consecutive + 1, whose loss came from the parameters the
            # update before it made: a checkpoint is good up to the step before that update.
            good = functools.partial(trainer.run.last_checkpoint, at_most=step - consecutive - 1)
            guard.raise_if_stuck(consecutive, step, good)


class MetricsLogger(Callback):
    """On logging steps: one record of the steps since the last one (rates over that window), with
    the validation loss on evaluation steps, handed to each sink of `metrics_sinks` in order."""

    def __init__(self, evaluator: Evaluator):
        self.evaluator = evaluator
        self.last_val: float | None = None
        """The last validation loss of this `fit` (None before the first)."""
        self.sinks: list[MetricsSink] = []

    def on_fit_start(self, trainer: Trainer) -> None:
        self.last_val = None
        self.sinks = metrics_sinks(trainer)
        self._restart_window()

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        self.window_steps += 1
        step = trainer.step
        if not is_log_step(trainer.cfg, step):
            for sink in self.sinks:
                sink.step_done(step)
            return
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        seconds = time.perf_counter() - self.window_start
        record = trainer.engine.metrics(out, step=step, steps=self.window_steps, seconds=seconds)
        if is_eval_step(trainer.cfg, step):
            record["val_loss"] = self.last_val = self.evaluator(trainer.engine)
        for sink in self.sinks:
            sink.write(record, (seconds, self.window_steps))
        self._restart_window()  # evaluation and logging stay out of the next window's rate

    def on_fit_end(self, trainer: Trainer, completed: bool) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in reversed(sinks):
            sink.close(failed=not completed)

    def _restart_window(self) -> None:
        self.window_start, self.window_steps = time.perf_counter(), 0


def metrics_sinks(trainer: Trainer) -> list[MetricsSink]:
    """Where the records go, in order: on rank 0 metrics.jsonl, TensorBoard (logging.tensorboard)
    and W&B (logging.wandb), then the console unless the trainer is quiet (other ranks are)."""
    lc = trainer.cfg.logging
    sinks: list[MetricsSink] = []
    if trainer.par.is_main:
        wandb = None
        if lc.wandb:
            wandb = WandbSink(
                trainer.run.path,
                trainer.cfg.to_dict(),
                project=lc.wandb_project,
                name=lc.wandb_name,
                resumed=trainer.resumed_from is not None,
            )
        sinks.append(JsonlSink(trainer.run.metrics_file))
        resumed_at = trainer.step if trainer.resumed_from is not None else None
        tensorboard = TensorBoardSink.open(trainer.run.path, resumed_at) if lc.tensorboard else None
        sinks += [sink for sink in (tensorboard, wandb) if sink is not None]
    if not trainer.quiet:
        sinks.append(ConsoleSink(start=trainer.step, total=trainer.cfg.train.steps, device_type=trainer.device.type))
    return sinks


class Checkpointing(Callback):
    """Checkpoints every checkpoint.save_every steps and after the last (checkpoint.save_final);
    an async save completes at the next save or the end of `fit`. Never saves NaN or inf."""

    def __init__(self) -> None:
        self._pending: PendingCheckpoint | None = None
        self.last_saved_step: int | None = None

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        cc, step = trainer.cfg.checkpoint, trainer.step
        if step == trainer.cfg.train.steps and cc.save_final:
            self.save(trainer)
        elif cc.save_every > 0 and step % cc.save_every == 0:
            skipping = int(trainer.engine.guard.consecutive)  # read at save steps only
            if not skipping:
                self.save(trainer)
            elif trainer.par.is_main:  # a checkpoint inside a streak of skips would be no good one
                print(
                    f"step {step}: no checkpoint: the step guard skipped the last {skipping} update(s); the next "
                    f"save is at step {step + cc.save_every}",
                    file=sys.stderr,
                    flush=True,
                )

    def save(self, trainer: Trainer) -> Path:
        """Checkpoint `trainer.step` (every rank); returns where it is (or will be)."""
        self.finish()  # one write at a time
        if not trainer.engine.parameters_finite():
            raise CheckpointError(
                f"Refusing to save step {trainer.step}: the parameters hold NaN or inf. The last good checkpoint "
                f"({trainer.run.last_checkpoint() or 'none yet'}) is kept; lower optim.lr or check the data, "
                "then --resume."
            )
        cc = trainer.cfg.checkpoint
        state = {
            "step": trainer.step,
            "loader": trainer.loader.state_dict(),
            "guard": trainer.engine.guard.state_dict(),
            "schedule_steps": trainer.engine.schedule_steps,
        }
        extra = {"config.yaml": trainer.run.config_file}
        if trainer.loader.tokenizer_path is not None:
            extra["tokenizer.json"] = trainer.loader.tokenizer_path
        result = save_checkpoint(
            trainer.run.path,
            trainer.step,
            trainer.engine.checkpoint_state(),
            state,
            extra,
            keep_last=cc.keep_last,
            role=ShardRole.of(trainer.par),
            async_write=cc.async_save,
            process_group=cpu_group() if trainer.par.dims.world_size > 1 else None,
        )
        self.last_saved_step = trainer.step
        if isinstance(result, PendingCheckpoint):
            self._pending = result
            return checkpoints_dir(trainer.run.path) / f"step-{result.step}"
        return result

    def finish(self) -> None:
        """Wait for a background checkpoint write and complete it (no-op without one)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()


class GracefulStop(Callback):
    """SIGTERM (what schedulers and torchrun send) or Ctrl-C: finish the current step, save a
    checkpoint, return normally; a second Ctrl-C interrupts at once. The ranks agree to stop after
    the same step through a MAX all-reduce of a CPU flag over a gloo group (no host sync on GPU)."""

    def __init__(self, checkpointing: Checkpointing):
        self.checkpointing = checkpointing
        self.flag = 0
        self.signal_name = ""
        self.previous: dict = {}

    def on_fit_start(self, trainer: Trainer) -> None:
        self.flag, self.signal_name = 0, ""
        self.quiet = not trainer.par.is_main  # said even under --quiet
        self.collective = trainer.par.dims.world_size > 1
        self.group = cpu_group() if self.collective else None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def on_step_end(self, trainer: Trainer, out: StepOutput) -> None:
        if trainer.step == trainer.cfg.train.steps or not self.requested():
            return
        if self.checkpointing.last_saved_step == trainer.step:
            path = checkpoints_dir(trainer.run.path) / f"step-{trainer.step}"
        else:
            path = self.checkpointing.save(trainer)
        self.checkpointing.finish()
        if trainer.par.is_main:
            print(
                f"stopped by {self.signal_name} after step {trainer.step}; checkpoint {path}; continue with --resume",
                file=sys.stderr,
                flush=True,
            )
        trainer.stop(stopped_at_step=trainer.step)

    def on_fit_end(self, trainer: Trainer, completed: bool) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        if self.flag and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag = 1
        self.signal_name = signal.Signals(signum).name
        if not self.quiet:
            again = " again" if signum == signal.SIGINT else ""
            print(
                f"{self.signal_name}: stopping after this step and saving a checkpoint "
                f"(Ctrl-C{again} to abort at once)",
                file=sys.stderr,
                flush=True,
            )

    def requested(self) -> bool:
        """Whether any rank got the signal (collective)."""
        if not self.collective:
            return bool(self.flag)
        flag = torch.tensor([self.flag], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and not self.signal_name:
            self.signal_name = "a signal on another rank"
        return bool(flag.item())


def callbacks_from_config(
    cfg: RunConfig, run_dir: Path, evaluator: Evaluator, checkpointing: Checkpointing
) -> list[Callback]:
    """The loop's callbacks for `cfg`, in the order they run."""
    return [
        *([StepProfiling(run_dir / "profile")] if cfg.logging.profile else []),
        SkipLimit(),
        MetricsLogger(evaluator),
        checkpointing,
        GracefulStop(checkpointing),
    ]
