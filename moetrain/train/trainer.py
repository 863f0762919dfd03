"""The training loop: get batch → forward/backward over micro-batches → clip → step → log →
maybe evaluate → maybe checkpoint.

Legend: B micro-batch sequences (this rank), T sequence length, V vocabulary.

Nothing in `train_step` copies from the device to the host: losses, gradient norms and routing
statistics stay device tensors, and are read only on logging steps (every `train.log_every`).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetrain.data.loader import SyntheticLoader, TokenLoader, resolve_val_path, val_batches
from moetrain.data.tokens import open_source
from moetrain.errors import CheckpointError, ConfigError
from moetrain.model.counting import count_params, flops_per_token, peak_flops
from moetrain.model.transformer import Transformer
from moetrain.parallel.dist_optim import DistributedAdamW
from moetrain.parallel.dims import ParallelDims, ParallelState, Stack
from moetrain.parallel.distributed import cpu_group, init_distributed
from moetrain.parallel.fsdp import init_full_then_shard, is_sharded, reshard
from moetrain.parallel.pipeline import Pipeline, build_pipeline
from moetrain.parallel.parallelize import parallelize
from moetrain.train import checkpoint as ckpt
from moetrain.train.config import Precision, RunConfig
from moetrain.train.metrics import MetricsWriter, peak_mem_gib, read_metrics, routing_metrics
from moetrain.train.optim import FSDPAdamW, ReplicatedAdamW, lr_at
from moetrain.train.guard import StepGuard
from moetrain.train.profiling import StepProfiler
from moetrain.train.wandb_sink import WandbSink, require_wandb


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available here: use --device cpu.")
    return torch.device(name)


def autocast_dtype(precision: Precision, device: torch.device) -> torch.dtype | None:
    """None = plain fp32. bf16 autocast keeps fp32 master weights, gradients and AdamW state."""
    if precision == Precision.bf16 or (precision == Precision.auto and device.type == "cuda"):
        return torch.bfloat16
    return None


def document_ids(tokens_BT: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index of each position; an EOS token belongs to the document it ends."""
    is_eos_BT = (tokens_BT == eos_id).to(torch.int32)
    return is_eos_BT.cumsum(dim=1) - is_eos_BT


@dataclass
class StepOutput:
    """One optimizer step's results, as device tensors (no host sync)."""

    lm_loss: torch.Tensor
    grad_norm: torch.Tensor
    routing: list[dict[str, torch.Tensor]]
    lr: float


class Trainer:
    def __init__(self, cfg: RunConfig, *, resume: bool = False, quiet: bool = False):
        self.cfg = cfg
        tc = cfg.train
        if tc.wandb:
            require_wandb()
        self.device = resolve_device(tc.device)
        rank, world = init_distributed(self.device.type, cfg.parallel.timeout_s, cfg.parallel.peer_timeout_s)
        if self.device.type == "cuda" and world > 1:
            self.device = torch.device("cuda", torch.cuda.current_device())
        dims = ParallelDims.from_config(
            cfg.parallel, world, cfg.model.moe.num_experts, cfg.model.num_moe_layers > 0,
            n_layers=cfg.model.n_layers, micro_batches=tc.grad_accum_steps,
        )
        if tc.micro_batch_size % dims.dp:
            raise ConfigError(
                f"train.micro_batch_size={tc.micro_batch_size} (sequences per micro-batch, summed over "
                f"ranks) is not divisible by the {dims.dp} data-parallel ranks."
            )
        self.par = ParallelState.create(dims, self.device.type, rank)
        self.quiet = quiet or not self.par.is_main
        self.run_dir = Path(tc.run_dir)
        if self.par.is_main:
            _ensure_writable(self.run_dir)
        self.amp_dtype = autocast_dtype(tc.precision, self.device)
        if tc.fp8 != "none" and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ConfigError(
                f"train.fp8={tc.fp8} needs FP8 tensor cores (compute capability ≥ 8.9: Ada, Hopper or newer); "
                f"{torch.cuda.get_device_name(self.device)} has {torch.cuda.get_device_capability(self.device)}. "
                "Use train.fp8=none."
            )
        torch.manual_seed(tc.seed)

        if cfg.data.synthetic:
            self.eos_id, self.tokenizer_file, self.val_path = None, None, None
            self.loader = SyntheticLoader(
                seq_len=cfg.data.seq_len, micro_batch_size=tc.micro_batch_size, seed=tc.seed,
                vocab_size=cfg.model.vocab_size, dp_rank=self.par.dp_rank, dp_size=dims.dp,
            )
        else:
            train_source = open_source(cfg.data.sources[0])
            self.eos_id = train_source.eos_id
            self.tokenizer_file = train_source.tokenizer_path
            self.loader = TokenLoader(
                cfg.data, micro_batch_size=tc.micro_batch_size, seed=tc.seed, vocab_size=cfg.model.vocab_size,
                dp_rank=self.par.dp_rank, dp_size=dims.dp,
            )
            self.val_path = resolve_val_path(cfg.data)

        # Build on the meta device, apply the layout, then allocate only what this rank holds.
        model = cfg.model.build(device="meta")
        model = parallelize(model, self.par, tc, cfg.parallel)
        model.to_empty(device=self.device)
        fsdp = cfg.parallel.stack == Stack.fsdp
        # Under FSDP each parameter is a shard: initialized on a full temporary, shard kept.
        model.init_weights(seed=tc.seed, fill=init_full_then_shard if fsdp else None)
        self.model: Transformer = model
        # The optimizer owns the data-parallel gradient reduction and clipping too.
        if fsdp:
            self.optimizer = FSDPAdamW(model, self.par, cfg.optim)
        elif cfg.parallel.shard_optimizer:
            self.optimizer = DistributedAdamW(model, self.par, cfg.optim)
        else:
            self.optimizer = ReplicatedAdamW(model, self.par, cfg.optim)
        # Every backward's loss is scaled by 1/micro-batches × the optimizer's `loss_scale` (1/dp
        # where the gradient reduction sums): the reduced gradient is then the mean over the
        # global batch with no pass over the gradients. Aux losses get the same factor.
        self.backward_scale = self.optimizer.loss_scale / tc.grad_accum_steps
        for moe in self.model.moe_layers():
            moe.aux_loss_scale = self.backward_scale
        self.pipeline: Pipeline | None = None
        if dims.num_stages > 1:
            self.pipeline = build_pipeline(
                model, self.par, cfg.parallel.pp_schedule, n_microbatches=tc.grad_accum_steps,
                loss_scale=self.optimizer.loss_scale,
                micro_batch_rows=tc.micro_batch_size // dims.dp, seq_len=cfg.data.seq_len,
                device=self.device, amp_dtype=self.amp_dtype,
            )

        self._pending_checkpoint: ckpt.PendingCheckpoint | None = None
        self.guard = StepGuard(tc.skip_window, tc.skip_spike_sigma, tc.max_consecutive_skips, self.device)
        self.tokens_per_step = tc.global_batch_size * cfg.data.seq_len
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak_flops = peak_flops(torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None)
        self.step = 0
        self.resumed_from: Path | None = None
        if resume:
            self._resume()
        else:
            self._check_fresh_start()
        if self.par.is_main:
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
            if self.tokenizer_file is not None and self.tokenizer_file.is_file():
                shutil.copyfile(self.tokenizer_file, self.run_dir / "tokenizer.json")

    # ---- one step ------------------------------------------------------------------------
    def train_step(self) -> StepOutput:
        tc = self.cfg.train
        self.model.train()
        if self.pipeline is not None:
            lm_loss = self._pipeline_forward_backward()
        else:
            lm_loss = self._forward_backward()

        self.optimizer.finish()
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        grad_norm = self.optimizer.clip_grad_norm(max_norm)
        # The skip decision must be the same on every rank: the gradient norm is global already,
        # the loss is made global (mean over dp; pipeline: from the last stage) by one all-reduce.
        skip = self.guard.check(self._global_mean(lm_loss.float().reshape(1))[0], grad_norm)
        lr = lr_at(self.step, tc.steps, self.cfg.optim.lr, self.cfg.schedule)
        self.optimizer.set_lr(lr)
        self.optimizer.step(skip)
        self.optimizer.zero_grad()
        routing = [moe.end_step(skip) for moe in self.model.moe_layers()]
        self.step += 1
        if self.device.type == "cpu":  # no device to wait for: check every step
            self.guard.raise_if_stuck(int(self.guard.consecutive), self.step, self._last_checkpoint)
        return StepOutput(lm_loss, grad_norm, routing, lr)

    def _last_checkpoint(self) -> str | None:
        found = ckpt.list_checkpoints(self.run_dir)
        return str(found[-1][1]) if found else None

    def _forward_backward(self) -> torch.Tensor:
        """The step's micro-batches one after the other; the summed (accumulated) LM loss."""
        tc = self.cfg.train
        lm_loss = torch.zeros((), device=self.device)
        for micro in range(tc.grad_accum_steps):
            self.optimizer.prepare(sync=micro == tc.grad_accum_steps - 1)
            inputs_BT, targets_BT = self.loader.next_batch()
            inputs_BT = inputs_BT.to(self.device, non_blocking=True)
            targets_BT = targets_BT.to(self.device, non_blocking=True)
            loss = self._lm_loss(inputs_BT, targets_BT)
            (loss * self.backward_scale).backward()
            lm_loss += loss.detach() / tc.grad_accum_steps
        return lm_loss

    def _pipeline_forward_backward(self) -> torch.Tensor:
        """The step's micro-batches through the pipeline schedule (one call runs every forward
        and backward); the summed LM loss on the last stage's ranks, 0 on the others. Every rank
        reads the same micro-batches (its dp rank's), so the loader state stays layout-free."""
        n = self.cfg.train.grad_accum_steps
        batches = [self.loader.next_batch() for _ in range(n)]
        inputs_BT = torch.cat([b[0] for b in batches]).to(self.device, non_blocking=True)
        targets_BT = torch.cat([b[1] for b in batches]).to(self.device, non_blocking=True)
        doc_ids_BT = document_ids(inputs_BT, self.eos_id) if self.cfg.data.document_masking else None
        self.optimizer.prepare(sync=True, backward_passes=n)
        return self.pipeline.train_step(inputs_BT, targets_BT, doc_ids_BT)

    def _lm_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        doc_ids_BT = document_ids(inputs_BT, self.eos_id) if self.cfg.data.document_masking else None
        with self._autocast():
            logits_BTV = self.model(inputs_BT, doc_ids_BT)
        return F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten())

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    # ---- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over `train.eval_batches` fixed micro-batches; None without data."""
        if self.val_path is None:
            return None
        tc = self.cfg.train
        batches = val_batches(
            self.val_path, seq_len=self.cfg.data.seq_len, micro_batch_size=tc.micro_batch_size,
            num_batches=tc.eval_batches, vocab_size=self.cfg.model.vocab_size,
            dp_rank=self.par.dp_rank, dp_size=self.par.dims.dp,
        )
        self.model.eval()
        total, count = torch.zeros((), device=self.device), 0
        # Eval must not shift the training RNG stream (random routing draws from it).
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for inputs_BT, targets_BT in batches:
                inputs_BT, targets_BT = inputs_BT.to(self.device), targets_BT.to(self.device)
                if self.pipeline is not None:
                    doc_ids_BT = document_ids(inputs_BT, self.eos_id) if self.cfg.data.document_masking else None
                    total += self.pipeline.eval_loss_sum(inputs_BT, targets_BT, doc_ids_BT)
                else:
                    total += self._lm_loss(inputs_BT, targets_BT)
                count += 1
        self.model.train()
        reshard(self.model)  # FSDP: no gathered root parameters left between steps
        return self._global_mean(total / max(count, 1)).item()

    def _global_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per-rank values held by one pipeline stage's dp ranks (zeros elsewhere) -> their mean
        over dp, on every rank: one all-reduce over all ranks, divided by dp."""
        if self.par.world_group is None:
            return values
        values = values.clone()
        dist.all_reduce(values, group=self.par.world_group)
        return values / self.par.dims.dp

    # ---- the loop ------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        tc = self.cfg.train
        main = self.par.is_main
        writer = None
        if main:
            sink = None
            if tc.wandb:
                sink = WandbSink(self.run_dir, self.cfg.to_dict(), project=tc.wandb_project, name=tc.wandb_name,
                                 resumed=self.resumed_from is not None)
            writer = MetricsWriter(self.run_dir, tensorboard=tc.tensorboard, wandb=sink)
        summary = self._read_summary()
        if "initial_val_loss" not in summary and tc.eval_every > 0:
            summary["initial_val_loss"] = self.evaluate()
        progress = _Progress(start=self.step, total=tc.steps, quiet=self.quiet)
        profiler = self.profiler(self.run_dir / "profile") if tc.profile else None
        stop = GracefulStop(self.par, quiet=not self.par.is_main)  # said even under --quiet
        window_start, window_steps = time.perf_counter(), 0
        last_val = None
        completed = False
        try:
            while self.step < tc.steps:
                out = self.train_step()
                if profiler is not None:
                    profiler.step()
                window_steps += 1
                is_last = self.step == tc.steps
                do_eval = tc.eval_every > 0 and (self.step % tc.eval_every == 0 or is_last)
                do_log = self.step % tc.log_every == 0 or self.step == 1 or is_last or do_eval
                if do_log:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    elapsed = time.perf_counter() - window_start
                    record = self._record(out, window_steps, elapsed)
                    if do_eval:
                        record["val_loss"] = last_val = self.evaluate()
                    if writer is not None:
                        writer.write(record)
                    progress.update(self.step, record)
                    window_start, window_steps = time.perf_counter(), 0
                else:
                    progress.update(self.step, None)
                saved = (tc.save_every > 0 and self.step % tc.save_every == 0) or (is_last and tc.save_final)
                if saved:
                    self.save()
                if not is_last and stop.requested():
                    path = self.save() if not saved else ckpt.checkpoints_dir(self.run_dir) / f"step-{self.step}"
                    self.finish_checkpoint()
                    if self.par.is_main:
                        print(f"stopped by {stop.signal_name} after step {self.step}; checkpoint {path}; "
                              "continue with --resume", file=sys.stderr, flush=True)
                    summary["stopped_at_step"] = self.step
                    break
            completed = True
        finally:
            stop.restore()
            if profiler is not None:
                profiler.close()
            progress.close()
            if writer is not None:
                writer.close(failed=not completed)
        self.finish_checkpoint()
        summary.update(self._final_summary(last_val))
        if main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if tc.plot and main:
            from moetrain.train.plot import plot_run

            summary["plot"] = str(plot_run(self.run_dir))
        return summary

    def profiler(self, out_dir: Path, wait: int | None = None) -> StepProfiler:
        """A profiler over `train.profile_steps` steps after `wait` (default train.profile_wait);
        with several ranks each writes its own rank-R subdirectory."""
        tc = self.cfg.train
        if self.par.dims.world_size > 1:
            out_dir = out_dir / f"rank{self.par.rank}"
        return StepProfiler(out_dir, tc.profile_wait if wait is None else wait, tc.profile_steps, self.device,
                            quiet=self.quiet)

    def _record(self, out: StepOutput, steps: int, elapsed: float) -> dict[str, Any]:
        tokens_per_sec = self.tokens_per_step * steps / max(elapsed, 1e-9)
        per_device = tokens_per_sec / self.par.dims.world_size
        tflops = self.flops_per_token * per_device / 1e12
        # One collective for every logged value. The LM loss (on the last pipeline stage) and each
        # MoE layer's lb/z losses, drops and global expert counts (on the stage holding it) are
        # placed at the layer's global index, zeros elsewhere; summed over all ranks and divided
        # by dp, that is the mean over dp (drops × dp is then the global count; counts, equal
        # on a stage's dp ranks, come back unchanged). float64 keeps large counts exact.
        L, E = self.cfg.model.num_moe_layers, self.cfg.model.moe.num_experts
        packed = torch.zeros(1 + L * (3 + E), dtype=torch.float64, device=self.device)
        packed[0] = out.lm_loss
        for i, s in zip(self.model.moe_layer_indices(), out.routing):
            packed[1 + i], packed[1 + L + i], packed[1 + 2 * L + i] = s["lb_loss"], s["z_loss"], s["dropped"]
            packed[1 + 3 * L + i * E : 1 + 3 * L + (i + 1) * E] = s["tokens_per_expert"]
        mean = self._global_mean(packed)
        counts_LE = mean[1 + 3 * L :].view(L, E).round().long()
        routing = routing_metrics([
            {"lb_loss": mean[1 + i], "z_loss": mean[1 + L + i], "dropped": mean[1 + 2 * L + i] * self.par.dims.dp,
             "tokens_per_expert": counts_LE[i]}
            for i in range(L)
        ], ep=self.par.dims.ep)
        lm_loss, grad_norm, skipped, consecutive = torch.stack([
            mean[0], out.grad_norm.double(), self.guard.skipped_total.double(), self.guard.consecutive.double(),
        ]).tolist()
        self.guard.raise_if_stuck(int(consecutive), self.step, self._last_checkpoint)
        moe = self.cfg.model.moe
        num_moe = self.cfg.model.num_moe_layers
        aux = num_moe * (moe.lb_loss_weight * routing["lb_loss"] + moe.z_loss_weight * routing["z_loss"])
        return {
            "step": self.step,
            "loss": lm_loss + aux,
            "lm_loss": lm_loss,
            "lb_loss": routing["lb_loss"],
            "z_loss": routing["z_loss"],
            "lr": out.lr,
            "grad_norm": grad_norm,
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": per_device,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / self.peak_flops if self.peak_flops else None,
            "peak_mem_gib": peak_mem_gib(self.device),
            "expert_load_max_over_mean": routing["expert_load_max_over_mean"],
            "ep_load_max_over_mean": routing["ep_load_max_over_mean"],
            "dropped_token_frac": routing["dropped_token_frac"],
            "unused_experts": routing["unused_experts"],
            "skipped_steps": int(skipped),
        }

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self) -> Path:
        """Checkpoint this step. With train.async_checkpoint the tensors are staged now and
        written in the background; the checkpoint appears (complete) at the next save or at the
        end of `fit` — `finish_checkpoint()`. Returns where it is (or will be)."""
        self.finish_checkpoint()  # one write at a time
        self._check_finite()
        state = {"step": self.step, "loader": self.loader.state_dict(), "guard": self.guard.state_dict()}
        extra = {"config.yaml": self.run_dir / "config.yaml"}
        if self.tokenizer_file is not None:
            extra["tokenizer.json"] = self.tokenizer_file
        tc = self.cfg.train
        result = ckpt.save_checkpoint(
            self.run_dir, self.step, self.model, self.optimizer, state, extra,
            keep_last=tc.keep_last, rank=self.par.rank, async_write=tc.async_checkpoint,
            process_group=cpu_group() if self.par.dims.world_size > 1 else None,
        )
        if isinstance(result, ckpt.PendingCheckpoint):
            self._pending_checkpoint = result
            return ckpt.checkpoints_dir(self.run_dir) / f"step-{result.step}"
        return result

    def finish_checkpoint(self) -> None:
        """Wait for a background checkpoint write and complete it (no-op without one)."""
        pending, self._pending_checkpoint = self._pending_checkpoint, None
        if pending is not None:
            pending.finish()

    def _check_finite(self) -> None:
        """Never write a checkpoint holding NaN or inf (one host read, at save time only)."""
        # This rank's values (its shards under FSDP); the all-reduce covers the rest.
        params = [p.detach().to_local() if is_sharded(p) else p.detach() for p in self.model.parameters()]
        bad = torch.stack([(~torch.isfinite(p)).any() for p in params]).any() if params else torch.tensor(False)
        if self.par.world_group is not None:
            bad = bad.to(torch.int32)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.par.world_group)
        if bool(bad):
            raise CheckpointError(
                f"Refusing to save step {self.step}: the parameters hold NaN or inf. The last good checkpoint "
                f"({self._last_checkpoint() or 'none yet'}) is kept; lower optim.lr or check the data, then --resume."
            )

    def _check_fresh_start(self) -> None:
        """A new run must not mix with an earlier run's records or checkpoints. With
        train.init_from it starts from that checkpoint's model weights."""
        found = ckpt.list_checkpoints(self.run_dir)
        if found:
            raise ConfigError(
                f"Run directory '{self.run_dir}' already holds checkpoints (newest: step "
                f"{found[-1][0]}). Pass --resume to continue that run, or choose another --run-dir."
            )
        if self.par.is_main:
            for stale in ("metrics.jsonl", "summary.json", "wandb_id.txt"):
                (self.run_dir / stale).unlink(missing_ok=True)
        if self.cfg.train.init_from:
            path = ckpt.resolve_checkpoint(self.cfg.train.init_from)
            ckpt.load_checkpoint(path, self.model, optimizer=None, rank=self.par.rank)
            if hasattr(self.optimizer, "sync_master_from_params"):  # the sharded optimizer's fp32 copies
                self.optimizer.sync_master_from_params()
            if not self.quiet:
                print(f"initialized the model from {path} (train.init_from)", file=sys.stderr)

    def _resume(self) -> None:
        found = ckpt.list_checkpoints(self.run_dir)
        partial = sorted(ckpt.checkpoints_dir(self.run_dir).glob(".step-*.tmp"))
        if partial and not self.quiet:
            print(f"--resume: ignoring {len(partial)} incomplete checkpoint(s) (interrupted while writing): "
                  f"{', '.join(p.name for p in partial)}", file=sys.stderr)
        if not found:
            if not self.quiet:
                print(f"--resume: no complete checkpoint in {self.run_dir}; starting from step 0", file=sys.stderr)
            self._check_fresh_start()  # the records of the lost steps go too
            return
        path = found[-1][1]
        state = ckpt.load_checkpoint(path, self.model, self.optimizer, rank=self.par.rank)
        self.step = state["step"]
        self.loader.load_state_dict(state["loader"])
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
        self.resumed_from = path
        if self.par.is_main:
            # Records past the checkpoint will be produced again: drop them so the file stays a log.
            metrics = self.run_dir / "metrics.jsonl"
            kept = [r for r in read_metrics(metrics) if r["step"] <= self.step]
            metrics.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if not self.quiet:
            print(f"resumed from {path} (step {self.step})", file=sys.stderr)

    # ---- summary ---------------------------------------------------------------------------------
    def _read_summary(self) -> dict[str, Any]:
        path = self.run_dir / "summary.json"
        if self.resumed_from is not None and path.is_file():
            return json.loads(path.read_text())
        return {}

    def _final_summary(self, last_val: float | None) -> dict[str, Any]:
        counts = count_params(self.cfg.model)
        found = ckpt.list_checkpoints(self.run_dir)
        return {
            "run_dir": str(self.run_dir),
            "steps": self.step,
            "final_val_loss": last_val,
            "total_params": counts.total,
            "active_params": counts.active,
            "checkpoint": str(found[-1][1]) if found else None,
            "metrics": str(self.run_dir / "metrics.jsonl"),
        }


class GracefulStop:
    """SIGTERM (what schedulers and torchrun send) or Ctrl-C: finish the current step, save a
    checkpoint, return normally. A second Ctrl-C interrupts at once.

    Ranks must stop after the same step: each step they agree through a MAX all-reduce of a CPU
    flag over a gloo group (a few microseconds; no device involved, so no host sync on GPU)."""

    def __init__(self, par: ParallelState, quiet: bool = False):
        self.flag = 0
        self.signal_name = ""
        self.quiet = quiet
        self.group = None
        self.collective = par.dims.world_size > 1
        if self.collective:
            self.group = cpu_group()
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.flag and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag = 1
        self.signal_name = signal.Signals(signum).name
        if not self.quiet:
            print(f"{self.signal_name}: stopping after this step and saving a checkpoint "
                  "(Ctrl-C again to abort at once)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        if not self.collective:
            return bool(self.flag)
        flag = torch.tensor([self.flag], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and not self.signal_name:
            self.signal_name = "a signal on another rank"
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


def _ensure_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"Run directory '{run_dir}' is not writable ({e.strerror}): pass --run-dir to a "
            "directory you can write."
        ) from None


class _Progress:
    """A tqdm bar on a terminal; a plain line per logged step otherwise (CI logs, pipes)."""

    def __init__(self, start: int, total: int, quiet: bool):
        self.quiet = quiet
        self.bar = None
        if not quiet and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
        self.last = start

    def update(self, step: int, record: dict[str, Any] | None) -> None:
        if self.bar is not None:
            self.bar.update(step - self.last)
            if record is not None:
                self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
        elif record is not None and not self.quiet:
            val = f" val_loss {record['val_loss']:.4f}" if record.get("val_loss") is not None else ""
            print(
                f"step {step:>6}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                f"{record['tokens_per_sec']:,.0f} tok/s{val}",
                file=sys.stderr,
                flush=True,
            )
        self.last = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
