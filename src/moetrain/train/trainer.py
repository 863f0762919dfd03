"""The training loop.

`Trainer(cfg)` builds a run (runtime, data loader, `TrainEngine`, run directory, callbacks) and
starts it fresh or resumes it; `fit()` is the loop and nothing else: the step's micro-batches →
`engine.train_step` → every callback's `on_step_end` (docs/architecture.md, "Who owns what").
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moetrain.config import load_yaml
from moetrain.data.tokens import same_tokenizer
from moetrain.errors import CheckpointError, ConfigError, MoetrainError
from moetrain.model.counting import count_params
from moetrain.optim.schedule import lr_at
from moetrain.parallel.config import EVERY_ROW, ParallelConfig
from moetrain.parallel.dims import ParallelState
from moetrain.parallel.distributed import from_rank_0
from moetrain.parallel.rehearsal import Rehearsal
from moetrain.train import console, oom
from moetrain.train.callbacks import Callback, Checkpointing, Evaluator, MetricsLogger, callbacks_from_config
from moetrain.train.checkpoint_index import diagnose, read_index, unexpected
from moetrain.train.checkpoint_io import ShardRole, check_loadable, load_checkpoint, model_state_dict
from moetrain.train.config import Extend, RunConfig
from moetrain.train.engine import Batch, StepOutput, TrainEngine
from moetrain.train.plot import plot_run
from moetrain.train.profiling import StepProfiler
from moetrain.train.run_dir import RunDir, checkpoints_dir, default_run_dir, estimated_bytes, resolve_checkpoint
from moetrain.train.runtime import dotted, setup_runtime
from moetrain.train.wandb_sink import require_wandb


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        resume: bool = False,
        quiet: bool = False,
        name: str = "run",
        rehearsal: Rehearsal | None = None,
        capacity_floor: CapacityFloor | None = None,
    ):
        """Build the run on this rank; with `resume`, from the run directory's newest complete
        checkpoint (without train.run_dir: `default_run_dir(name, resume)`, kept in `self.cfg`).
        With `rehearsal`, this process is that one rank of that world. See `CapacityFloor`."""
        cfg = copy.deepcopy(cfg)  # the run's own: the caller may change `cfg` for another run
        if cfg.logging.wandb:
            require_wandb()
        runtime = setup_runtime(cfg, rehearsal)
        self.device, self.par = runtime.device, runtime.par
        self.quiet = quiet or not self.par.is_main
        run_dir, note, self.run = self._take_run_dir(cfg, name, resume)
        self.cfg = cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=run_dir))
        try:
            self._build(resume, capacity_floor)
        except BaseException:
            self.run.abandon()
            raise
        # Once nothing can refuse the run any more: a user mistake stays one paragraph.
        if not self.quiet:
            rehearsed = self.par.rank if self.par.rehearsed else None
            lines = [console.header(cfg, self.par.dims, self.device, self.run.path, note, rehearsed), *self._notes]
            print("\n".join(lines), file=sys.stderr, flush=True)

    def _build(self, resume: bool, capacity_floor: CapacityFloor | None) -> None:
        """Loader, engine and callbacks, then the fresh start or the resume."""
        cfg, tc = self.cfg, self.cfg.train
        torch.manual_seed(tc.seed)
        self.loader = cfg.data.build(
            micro_batch_size=tc.micro_batch_size,
            seed=tc.seed,
            vocab_size=cfg.model.vocab_size,
            dp_rank=self.par.index("dp"),
            dp_size=self.par.dims.dp,
        )
        parallel, capacity_note = _resolved_capacity(cfg, self.par, self.device, capacity_floor)
        self.engine = TrainEngine(
            dataclasses.replace(cfg, parallel=parallel), self.par, self.device, self.loader.eos_id
        )
        self.evaluator = Evaluator(cfg, self.par.index("dp"), self.par.dims.dp)
        self.checkpointing = Checkpointing()
        self.callbacks: list[Callback] = callbacks_from_config(cfg, self.run.path, self.evaluator, self.checkpointing)
        """What `fit` calls at its start, after each step (in this order) and at its end."""
        self.step = 0
        """Optimizer steps done."""
        self.resumed_from: Path | None = None
        self.summary: dict[str, Any] = {}
        self._stopping = False
        self._notes: list[str] = [capacity_note] if capacity_note else []
        self.finished_at: int | None = None
        """With `resume`: the step of a checkpoint at or past train.steps (nothing left to do)."""
        if resume:
            self._resume()
        else:
            self._start_fresh()
        self._note_warmup()
        if tc.eval_every > 0 and self.evaluator.path is None and not cfg.data.synthetic:
            self._notes.append(
                f"train.eval_every={tc.eval_every}, but {cfg.data.sources[0]} has no validation split and data.val "
                "is not set: no step evaluates (prepare-data --val-frac 0.02 holds some documents out)"
            )
        if self.finished_at is None:  # a finished run stays exactly as it was
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
        if self.finished_at is not None:
            return self._already_finished()
        if self.step >= tc.steps:  # an earlier fit of this Trainer finished the run
            return self.summary
        # A resumed run, or a second fit in this process, goes on with the summary written so far.
        self.summary = self.run.read_summary() if self.resumed_from is not None or self.step > 0 else {}
        self.summary.pop("stopped_at_step", None)  # an earlier stop's: this fit says its own
        # Step 0's loss, kept at once should the run stop before its end; a resumed run that lost it
        # cannot measure it again (its weights are no longer step 0's).
        if "initial_val_loss" not in self.summary and tc.eval_every > 0 and self.step == 0:
            self.summary["initial_val_loss"] = self.evaluator(self.engine)
            self.run.write_summary(self.summary)
        callbacks = list(self.callbacks)
        self._stopping = False
        completed = False
        first_step = self.step
        try:
            for callback in callbacks:
                callback.on_fit_start(self)
            while self.step < tc.steps and not self._stopping:
                out_of_memory = None
                try:
                    out = self.train_step()
                except torch.OutOfMemoryError as e:
                    out_of_memory = self._out_of_memory(e, first=self.step == first_step)
                if out_of_memory is not None:  # raised here: the step's frames (and memory) are gone
                    raise out_of_memory
                for callback in callbacks:
                    callback.on_step_end(self, out)
            completed = True
        finally:
            for callback in reversed(callbacks):
                callback.on_fit_end(self, completed)
        self.checkpointing.finish()
        last_val = next((c.last_val for c in callbacks if isinstance(c, MetricsLogger)), None)
        self.summary.update(self._final_summary(last_val))
        self.run.write_summary(self.summary)
        if self.cfg.logging.plot and self.par.is_main:
            self.summary["plot"] = str(plot_run(self.run.path))
        return self.summary

    def stop(self, **summary: Any) -> None:
        """End `fit` after the current step's callbacks; `summary` joins the run's summary."""
        self._stopping = True
        self.summary.update(summary)

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self) -> Path:
        """Checkpoint this step now (see `Checkpointing.save`)."""
        return self.checkpointing.save(self)

    def finish_checkpoint(self) -> None:
        """Complete a checkpoint being written in the background (checkpoint.async_save)."""
        self.checkpointing.finish()

    def _start_fresh(self) -> None:
        """With checkpoint.init_from, from that checkpoint's model weights and a fresh optimizer."""
        self.run.start_fresh()
        if self.cfg.checkpoint.init_from:
            path = resolve_checkpoint(self.cfg.checkpoint.init_from)
            ours, theirs = path / "tokenizer.json", self.loader.tokenizer_path
            if ours.is_file() and theirs is not None and theirs.is_file() and not same_tokenizer(ours, theirs):
                raise ConfigError(
                    f"checkpoint.init_from: {path} was trained on the ids of another tokenizer ({ours}) than "
                    f"data.sources' ({theirs}): the same ids mean other text. Prepare the data with the checkpoint's "
                    f"tokenizer: `moetrain prepare-data … --tokenizer {ours}`."
                )
            whole = _whole_model(self.cfg)
            check_loadable(path, {"model": whole})  # every rank alike, whatever stage it holds
            self.engine.load_model_weights(path)
            extra = unexpected(read_index(path)[0], whole)
            left = f"; not read: {len(extra)} of its tensors this model lacks ({extra[0]}, …)" if extra else ""
            self._notes.append(f"initialized the model from {path} (checkpoint.init_from){left}")

    def _resume(self) -> None:
        """From the newest intact complete checkpoint: damaged ones are skipped and moved aside
        (so that retention never keeps them over good ones); none complete: a fresh start."""
        found = self.run.checkpoints()
        partial = self.run.partial_checkpoints()
        if partial:
            self._notes.append(
                f"--resume: ignoring {len(partial)} incomplete checkpoint(s) (interrupted while writing): "
                f"{', '.join(p.name for p in partial)}"
            )
        if not found:
            self._notes.append(f"--resume: no complete checkpoint in {self.run.path}; starting from step 0")
            self._start_fresh()  # the records of the lost steps go too
            return
        damaged = []
        for _, path in reversed(found):
            if (damage := diagnose(path)) is None:
                break
            damaged.append((path, damage))
        else:
            raise CheckpointError(
                f"--resume: every checkpoint in {checkpoints_dir(self.run.path)} is damaged: "
                + "; ".join(f"{p.name}: {d}" for p, d in damaged)
                + ". Restore the files from a copy, or start a new run with another --run-dir."
            )
        for candidate, damage in damaged:
            aside = self.run.move_aside(candidate)
            self._notes.append(
                f"--resume: skipped {candidate.name}, which is damaged ({damage})"
                + (f"; moved to {aside.name}" if aside else "")
            )
        state, rehearsal = self.engine.checkpoint_state(), ShardRole.of(self.par).rehearsal
        check_loadable(path, state, rehearsal, _whole_model(self.cfg))
        saved_step = json.loads((path / "trainer_state.json").read_text())["step"]
        if saved_step >= self.cfg.train.steps:
            self.finished_at, self.resumed_from = saved_step, path
            return
        trainer_state = load_checkpoint(path, state, rank=self.par.rank, restore_rng=True, rehearsal=rehearsal)
        self.engine.checkpoint_loaded()
        self.step = trainer_state["step"]
        self.loader.load_state_dict(trainer_state["loader"])
        if "guard" in trainer_state:
            self.engine.guard.load_state_dict(trainer_state["guard"])
        self._resume_schedule(path, trainer_state)
        self.resumed_from = path
        self.run.keep_records_up_to(self.step)
        init = self.cfg.checkpoint.init_from
        unread = f"; checkpoint.init_from={init} is for a fresh start, not read" if init else ""
        self._notes.append(f"resumed from {path} (step {self.step}){unread}{_model_changes(path, self.cfg)}")

    def _note_warmup(self) -> None:
        """A schedule that ends inside its warm-up never decays: said at start-up."""
        planned, warmup = self.engine.schedule_steps, self.cfg.schedule.warmup_steps
        if planned <= warmup:
            last = lr_at(planned - 1, planned, self.cfg.optim.lr, self.cfg.schedule)
            self._notes.append(
                f"the schedule's {planned} steps end inside its warm-up of {warmup} (schedule.warmup_steps): the "
                f"rate rises to {last:.3g} of a peak of {self.cfg.optim.lr:.3g} and never decays; for a warm-up "
                f"and a decay set --schedule.warmup_steps={max(1, planned // 10)} or so"
            )

    def _resume_schedule(self, path: Path, trainer_state: dict) -> None:
        """The schedule a resumed run follows: the one it planned (trainer_state's schedule_steps,
        else its config.yaml's train.steps) unless train.extend=replan; a changed count is said."""
        planned = trainer_state.get("schedule_steps")
        if planned is None:
            planned = load_yaml(path / "config.yaml").get("train", {}).get("steps", self.cfg.train.steps)
        tc, cfg = self.cfg.train, self.cfg
        keep = tc.extend == Extend.keep
        self.engine.schedule_steps = planned if keep else tc.steps
        if planned == tc.steps:
            return
        # the steps as the logs number them (from 1): the next one is self.step + 1
        kept = lr_at(self.step, planned, cfg.optim.lr, cfg.schedule)
        replanned = lr_at(self.step, tc.steps, cfg.optim.lr, cfg.schedule)
        before = lr_at(self.step - 1, planned, cfg.optim.lr, cfg.schedule) if self.step else kept
        final = lr_at(planned - 1, planned, cfg.optim.lr, cfg.schedule)
        if keep:
            longer = tc.steps > planned and self.step < planned
            then = f", and every step from {planned + 1} on at its last rate, {final:.3g}" if longer else ""
            what = (
                f"the schedule stays the one planned over {planned} steps (train.extend=keep): step {self.step + 1} "
                f"runs at {kept:.3g}{then}; --train.extend=replan would plan it over {tc.steps} steps (step "
                f"{self.step + 1} at {replanned:.3g})"
            )
        else:
            what = (
                f"the schedule is planned again over {tc.steps} steps (train.extend=replan): the rate goes from "
                f"{before:.3g} at step {self.step} to {replanned:.3g} at step {self.step + 1}; train.extend=keep "
                f"would keep the plan over {planned} steps ({kept:.3g})"
            )
        self._notes.append(f"--resume from step {self.step}: train.steps={tc.steps}, the run planned {planned}: {what}")

    def _already_finished(self) -> dict[str, Any]:
        """The summary of a run whose checkpoint is at train.steps already (written if missing)."""
        self.summary, changed = self.run.read_summary(), "nothing changed"
        if "steps" not in self.summary:  # none, or only step 0's loss: killed before the end
            self.step = self.finished_at
            self.summary |= self._final_summary(self.run.last_val_loss(self.finished_at))
            self.run.write_summary(self.summary)
            changed = "wrote its missing summary.json"
        if self.par.is_main:
            print(
                f"--resume: {self.run.path} already finished at step {self.finished_at} (train.steps="
                f"{self.cfg.train.steps}; checkpoint {self.resumed_from}): nothing to do, {changed}. "
                "Raise --steps to train further.",
                file=sys.stderr,
                flush=True,
            )
        return self.summary

    def _out_of_memory(self, error: torch.OutOfMemoryError, first: bool) -> oom.OutOfMemory:
        """The run's end after a step ran out of device memory (see src/moetrain/train/oom.py)."""
        self.checkpointing.finish()  # a background write holds an earlier step: complete it
        return oom.OutOfMemory(
            step=self.step + 1, first=first, device=self.device, last_checkpoint=self.run.last_checkpoint(), error=error
        )

    # ---- the rest ------------------------------------------------------------------------------
    def _take_run_dir(self, cfg: RunConfig, name: str, resume: bool) -> tuple[str, str, RunDir]:
        """Rank 0 chooses, checks and takes the run directory; the other ranks take its answer or
        its refusal, so that none waits on a peer that stopped."""
        run, answer = None, None
        if self.par.is_main:
            try:
                path, note = (cfg.train.run_dir, "") if cfg.train.run_dir is not None else default_run_dir(name, resume)
                run = RunDir(path, main=True, **_checkpoint_need(cfg))
                answer = (str(path), note)
            except MoetrainError as e:
                answer = e
        if not self.par.rehearsed:
            answer = from_rank_0(answer)
        if isinstance(answer, MoetrainError):
            raise answer
        path, note = answer
        return path, note, run or RunDir(path, main=False)

    def profiler(self, out_dir: Path, wait: int | None = None, kinds_only: bool = False) -> StepProfiler:
        """A profiler over logging.profile_steps steps after `wait` (default logging.profile_wait),
        in a rank-R subdirectory with several ranks."""
        lc = self.cfg.logging
        if self.par.dims.world_size > 1:
            out_dir = out_dir / f"rank{self.par.rank}"
        wait = lc.profile_wait if wait is None else wait
        return StepProfiler(out_dir, wait, lc.profile_steps, self.device, quiet=self.quiet, kinds_only=kinds_only)

    def _final_summary(self, last_val: float | None) -> dict[str, Any]:
        counts = count_params(self.cfg.model)
        return {
            "run_dir": str(self.run.path),
            "steps": self.step,
            "final_val_loss": last_val,
            "val_loss_tokens": self.evaluator.tokens() if last_val is not None else None,
            "total_params": counts.total,
            "active_params": counts.active,
            "checkpoint": self.run.last_checkpoint(),
            "metrics": str(self.run.metrics_file),
        }


def _model_changes(path: Path, cfg: RunConfig) -> str:
    """The keys of what is trained and how (model, optim, schedule) that `cfg` sets otherwise than
    the checkpoint `path`'s config.yaml, which no tensor's shape tells (model.moe.gating, optim.lr),
    as the resume's note says them."""
    if not (path / "config.yaml").is_file():
        return ""
    saved = dotted(RunConfig.from_dict(load_yaml(path / "config.yaml", RunConfig)).to_dict())
    now = {k: v for k, v in dotted(cfg.to_dict()).items() if k.split(".")[0] in ("model", "optim", "schedule")}
    changed = [f"{k}={now[k]} (was {saved[k]})" for k in now if saved.get(k) != now[k]]
    return f"; changed from the checkpoint's config.yaml: {', '.join(changed)}" if changed else ""


def _whole_model(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The whole model's checkpoint entries on the meta device: what every rank checks a
    checkpoint against before it loads its own part, so that all refuse it alike."""
    return model_state_dict(cfg.model.build(device="meta"))


def _checkpoint_need(cfg: RunConfig) -> dict[str, Any]:
    """`RunDir`'s free-space check: one checkpoint of this run, when it writes any."""
    if cfg.checkpoint.save_every <= 0 and not cfg.checkpoint.save_final:
        return {}
    params = count_params(cfg.model).total
    optimizer = 2 * cfg.optim.moments_dtype.dtype.itemsize
    return {
        "checkpoint_bytes": estimated_bytes(params, optimizer),
        "checkpoint_detail": f"a checkpoint of this run ({params / 1e6:,.1f}M parameters × {4 + optimizer} bytes: "
        "fp32 weights and AdamW's two moments)",
    }


CapacityFloor = Callable[[RunConfig, int, torch.device], tuple[int | None, str | None]]
"""Resolves parallel.capacity_min_rows auto for a config on a world of devices like this one:
(rows, why). `moetrain train` and `bench` pass the planner's (`moetrain.plan.device_capacity_floor`)."""


def _resolved_capacity(
    cfg: RunConfig, par: ParallelState, device: torch.device, floor: CapacityFloor | None
) -> tuple[ParallelConfig, str | None]:
    """cfg.parallel with capacity_min_rows auto resolved by `floor` (rank 0's answer, so every
    rank sizes the exchange alike), and a line saying why (None: nothing chosen; no `floor`: 1024)."""
    p = cfg.parallel
    if p.capacity_min_rows is not None or floor is None:
        return p, None
    choice = floor(cfg, par.dims.world_size, device) if par.is_main else None
    rows, why = choice if par.rehearsed else from_rank_0(choice)
    resolved = dataclasses.replace(p, capacity_min_rows=rows)
    if why is None:
        return resolved, None
    if rows == EVERY_ROW:
        return resolved, f"parallel.capacity_min_rows=auto: every row, no expert assignment dropped ({why})"
    return resolved, (
        f"parallel.capacity_min_rows=auto: {rows} rows ({why}): assignments beyond parallel.capacity_factor="
        f"{p.capacity_factor} x the balanced load are dropped, counted in dropped_token_frac"
    )
