"""`TrainEngine`: the model, its optimizer and pipeline, and what one training step does with them.

Legend: B micro-batch sequences (this rank), T sequence length, V vocabulary.

Built once per run (by `Trainer`, `bench`, tests). One step is `forward_backward(batches)` (the
gradients end reduced over dp) then `optim_step(lm_loss, step)`; with compute.cuda_graphs=step
both replay from one CUDA graph (`StepGraph`, through `train_step`). Nothing here copies from the
device to the host: `metrics()` reads the `StepOutput` only when the caller logs
(docs/architecture.md, "One training step").
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moetrain.model.counting import flops_per_token, peak_flops
from moetrain.model.expert_grads import DeferredExpertGrads
from moetrain.model.transformer import Transformer
from moetrain.optim.base import Optimizer
from moetrain.optim.schedule import lr_at
from moetrain.parallel.config import Stack
from moetrain.parallel.dims import ParallelState
from moetrain.parallel.fsdp import init_full_then_shard, is_sharded, reshard
from moetrain.parallel.parallelize import parallelize
from moetrain.parallel.pipeline import Pipeline, build_pipeline
from moetrain.train import checkpoint_io
from moetrain.train.config import CudaGraphs, Precision, RunConfig
from moetrain.train.cuda_graphs import CudaGraph, StepGraph
from moetrain.train.guard import StepGuard
from moetrain.train.metrics import peak_mem_gib, routing_metrics
from moetrain.transfer import to_device

Batch = tuple[torch.Tensor, torch.Tensor]
"""(inputs_BT, targets_BT): one micro-batch, this rank's rows."""


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
    """Mean LM loss over the step's micro-batches (on the last pipeline stage; 0 elsewhere)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping (0 when the step made no update)."""
    routing: list[dict[str, torch.Tensor]]
    """Per MoE layer this rank holds: `MoE.end_step()`'s statistics."""
    lr: float
    mtp: torch.Tensor | None = None
    """With multi-token prediction, on the rank holding it: each depth's loss averaged over the
    step's micro-batches, (model.mtp_depth,)."""


class TrainEngine:
    """Owns the model, the optimizer, the pipeline and the step guard of one rank."""

    grad_probe: Callable[[Optimizer], None] | None = None
    """Called with the optimizer between the gradients' reduction and clipping, where
    `moetrain check-layout` reads them (`Optimizer.grad_parts`); None in training."""

    def __init__(self, cfg: RunConfig, par: ParallelState, device: torch.device, eos_id: int | None = None):
        """`eos_id`: the data's end-of-document id (needed with data.document_masking)."""
        self.cfg, self.par, self.device = cfg, par, device
        self.eos_id = eos_id
        tc, pc, cc, gc = cfg.train, cfg.precision, cfg.compute, cfg.guard
        self.amp_dtype = autocast_dtype(pc.dtype, device)
        self.loss_chunk_tokens = cc.resolved_loss_chunk_tokens(device.type)

        # Build on the meta device, apply the layout, then allocate only what this rank holds.
        model = cfg.model.build(device="meta")
        model = parallelize(
            model,
            par,
            cfg.parallel,
            fp8=pc.fp8,
            fp8_select=pc.fp8_select,
            fp8_lm_head=cfg.fp8_lm_head,
            fp8_fast_backward=cfg.fp8_fast_backward,
            rows=cfg.rows_per_micro_batch,
            recompute=cc.recompute,
            recompute_every=cc.recompute_every,
            compile=cc.compile,
            param_dtype=self.amp_dtype,
            grad_dtype=cfg.optim.grad_dtype.dtype,
        )
        model.to_empty(device=device)
        # Under FSDP each parameter is a shard: initialized on a full temporary, shard kept.
        model.init_weights(seed=tc.seed, fill=init_full_then_shard if cfg.parallel.stack == Stack.fsdp else None)
        self.model: Transformer = model
        # The optimizer owns the data-parallel gradient reduction and clipping too.
        self.bf16_weights = cfg.optim.resolved_bf16_weights(cfg.parallel, self.amp_dtype, device)
        """bf16 matrices with fp32 masters split in the optimizer (src/moetrain/optim/split_master.py)."""
        self.optimizer: Optimizer = cfg.optim.build(model, par, cfg.parallel, bf16_weights=self.bf16_weights)
        self.optimizer.register_step_post_hook(self._update_router_biases)
        # Every backward's loss is scaled by 1/micro-batches × the gradient reduction's `loss_scale`
        # (1/dp where it sums): the reduced gradient is then the mean over the global batch with no
        # pass over the gradients. The losses attached to activations get the same factor.
        model.runtime.backward_scale = self.optimizer.reduction.loss_scale / tc.grad_accum_steps
        model.runtime.expert_grads = DeferredExpertGrads() if cfg.defers_expert_weight_grads else None
        self.pipeline: Pipeline | None = None
        if par.dims.num_stages > 1:
            self.pipeline = build_pipeline(
                model,
                par,
                cfg.parallel.pp_schedule,
                n_microbatches=tc.grad_accum_steps,
                loss_scale=self.optimizer.reduction.loss_scale,
                micro_batch_rows=tc.micro_batch_size // par.dims.dp,
                seq_len=cfg.data.seq_len // par.dims.cp,
                device=device,
                amp_dtype=self.amp_dtype,
            )
        self.guard = StepGuard(gc.skip_window, gc.skip_spike_sigma, gc.max_consecutive_skips, device)
        self.step_graph: StepGraph | None = None
        """compute.cuda_graphs=step: `train_step` replayed from a CUDA graph (src/moetrain/train/cuda_graphs.py)."""
        self.cuda_graphs, self.cuda_graphs_why = cfg.cuda_graphs_choice(par.dims.world_size, device)
        """compute.cuda_graphs as this run resolves it (auto: step or off; an auto step graph then
        stays or goes by measurement, `settle_cuda_graphs`), and why, for auto."""
        self._build_graphs(self.cuda_graphs, device, judge=cc.cuda_graphs == CudaGraphs.auto)
        self.schedule_steps = tc.steps
        """The steps the learning-rate schedule is planned over: train.steps, or, for a run
        resumed with another train.steps and train.extend=keep, the count it started with."""
        self.tokens_per_step = tc.global_batch_size * cfg.data.seq_len
        """Tokens of one optimizer step, summed over all ranks."""
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak_flops = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else None)

    def _build_graphs(self, mode: CudaGraphs, device: torch.device, judge: bool) -> None:
        if mode == CudaGraphs.step:
            self.step_graph = StepGraph(self, CudaGraph(device), judge=judge)

    def settle_cuda_graphs(self, keep: bool, why: str) -> None:
        """compute.cuda_graphs=auto's measured choice (`StepGraph.judge`): keep the step graph, or
        drop it (its memory already released) and run every step eagerly; said either way."""
        self.cuda_graphs_why = why
        if not keep:
            self.step_graph = None
            self.cuda_graphs = CudaGraphs.off
        print(f"note: compute.cuda_graphs=auto: {why}.", file=sys.stderr)

    # ---- one step ----------------------------------------------------------------------------------
    def train_step(self, batches: list[Batch], step: int) -> StepOutput:
        """`forward_backward` then `optim_step`: optimizer step number `step` (0-based); with
        compute.cuda_graphs=step, replayed from a CUDA graph once captured (`step_graph`)."""
        if self.step_graph is not None:
            return self.step_graph.run(batches, step)
        return self.optim_step(self.forward_backward(batches), step)

    def step_tensors(self, batches: list[Batch]) -> tuple:
        """The device work of `train_step` (what compute.cuda_graphs=step captures): (mean LM
        loss, gradient norm, routing statistics, multi-token losses or None)."""
        lm_loss = self.forward_backward(batches)
        grad_norm = self.update_tensors(lm_loss)
        self.optimizer.zero_grad()
        return lm_loss, grad_norm, self._end_routing_step(), self._end_mtp_step()

    def pass_tensors(self, batches: list[Batch]) -> tuple:
        """`step_tensors` of forward and backward alone (`drop_step`; `moetrain bench`'s
        forward+backward window), the gradient norm zero."""
        out = self.drop_step(self.forward_backward(batches))
        return out.lm_loss, out.grad_norm, out.routing, out.mtp

    def graph_memory_bytes(self) -> int:
        """The step graph's memory the allocator does not count as allocated (0 without one)."""
        return self.step_graph.uncounted_bytes if self.step_graph is not None else 0

    def cuda_graph_counts(self) -> dict[str, int] | None:
        """With compute.cuda_graphs: {"captures", "replays", "eager"} so far."""
        return self.step_graph.counts() if self.step_graph is not None else None

    def forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        """Forward and backward of the step's micro-batches (this rank's rows of each), the
        gradients then reduced over dp. Returns the mean LM loss over them (device scalar)."""
        self.model.train()
        expert_grads = self.model.runtime.expert_grads
        with expert_grads.step(len(batches)) if expert_grads is not None else contextlib.nullcontext():
            lm_loss = (
                self._pipeline_forward_backward(batches) if self.pipeline is not None else self._micro_batches(batches)
            )
        self.optimizer.reduction.finish()
        return lm_loss

    def optim_step(self, lm_loss: torch.Tensor, step: int) -> StepOutput:
        """Close the step after `forward_backward`: `update`, zero grad, the routing statistics."""
        grad_norm, lr = self.update(lm_loss, step)
        self.optimizer.zero_grad()
        return StepOutput(lm_loss, grad_norm, self._end_routing_step(), lr, self._end_mtp_step())

    def update(self, lm_loss: torch.Tensor, step: int) -> tuple[torch.Tensor, float]:
        """`set_step_lr`, then `update_tensors`: the norm before clipping (device) and the lr."""
        lr = self.set_step_lr(step)
        return self.update_tensors(lm_loss), lr

    def set_step_lr(self, step: int) -> float:
        """Give the optimizer the schedule's learning rate of step `step` (0-based); returns it."""
        lr = lr_at(step, self.schedule_steps, self.cfg.optim.lr, self.cfg.schedule)
        self.optimizer.set_lr(lr)
        return lr

    def update_tensors(self, lm_loss: torch.Tensor) -> torch.Tensor:
        """Clip, decide whether to skip (alike on every rank: the norm is global, the loss made
        global by one all-reduce), update (and the router-bias hook), all in place so that a CUDA
        graph can replay it. Returns the norm before clipping."""
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        if self.grad_probe is not None:
            self.grad_probe(self.optimizer)
        grad_norm = self.optimizer.clip_grad_norm(max_norm)
        skip = self.guard.check(self.global_mean(lm_loss.float().reshape(1))[0], grad_norm)
        self.optimizer.step(skip)
        return grad_norm

    def drop_step(self, lm_loss: torch.Tensor) -> StepOutput:
        """Close the step after `forward_backward` without an update (benchmarks): gradients
        dropped, routing statistics read and reset, nothing else changed."""
        self.optimizer.zero_grad()
        return StepOutput(
            lm_loss, torch.zeros((), device=self.device), self._end_routing_step(), 0.0, self._end_mtp_step()
        )

    def set_routing(self, routing: str) -> None:
        """Switch every router to `routing` (learned or random); the next step uses it."""
        self.model.set_routing(routing)
        if self.step_graph is not None:
            self.step_graph.reset()

    def _micro_batches(self, batches: list[Batch]) -> torch.Tensor:
        """The micro-batches one after the other; the accumulated (mean) LM loss."""
        n = len(batches)
        lm_loss = torch.zeros((), device=self.device)
        for micro, (inputs_BT, targets_BT) in enumerate(batches):
            self.optimizer.reduction.prepare(sync=micro == n - 1)
            inputs_BT, targets_BT = to_device(inputs_BT, self.device), to_device(targets_BT, self.device)
            loss = self.lm_loss(inputs_BT, targets_BT)
            (loss * self.model.runtime.backward_scale).backward()
            lm_loss += loss.detach() / n
        return lm_loss

    def _pipeline_forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        """The step's micro-batches through the pipeline schedule: the summed LM loss on the last
        stage's ranks, 0 on the others. Every rank reads its dp rank's micro-batches."""
        inputs_BT = to_device(torch.cat([b[0] for b in batches]), self.device)
        targets_BT = to_device(torch.cat([b[1] for b in batches]), self.device)
        self.optimizer.reduction.prepare(sync=True, backward_passes=len(batches))
        doc_ids_BT = self._document_ids(inputs_BT)
        return self.pipeline.train_step(self._shard(inputs_BT), self._shard(targets_BT), doc_ids_BT)

    def lm_loss(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (fp32) of one micro-batch (no pipeline), over this cp
        rank's positions (each holds as many, so the mean over the stage's ranks is the batch's)."""
        doc_ids_BT = self._document_ids(inputs_BT)
        with self._autocast():
            return self.model(self._shard(inputs_BT), doc_ids_BT, self._shard(targets_BT), self.loss_chunk_tokens)

    def _shard(self, x_BT: torch.Tensor) -> torch.Tensor:
        """This rank's positions of whole sequences (all of them without context parallelism)."""
        return self.model.sequence.shard(x_BT)

    def _document_ids(self, inputs_BT: torch.Tensor) -> torch.Tensor | None:
        return document_ids(inputs_BT, self.eos_id) if self.cfg.data.document_masking else None

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _update_router_biases(self, skip: torch.Tensor | None) -> None:
        """The optimizer's step post-hook: the aux-free balancing biases move at optimizer time."""
        for moe in self.model.moe_layers():
            moe.update_bias(skip)

    def discard_step_statistics(self) -> None:
        """Reset the routing and multi-token accumulators unread (a step abandoned midway)."""
        self._end_routing_step()
        self._end_mtp_step()

    def _end_routing_step(self) -> list[dict[str, torch.Tensor]]:
        return [moe.end_step() for moe in self.model.moe_layers()]

    def _end_mtp_step(self) -> torch.Tensor | None:
        return self.model.mtp.end_step() if self.model.mtp is not None else None

    # ---- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor, int]]) -> float:
        """Mean LM loss per token over `batches` (`val_batches`: this rank's rows and how many
        count) on all ranks: one all-reduce, one host read, the training RNG stream untouched."""
        self.model.eval()
        # float64 sums: the result then barely depends on how the sequences were batched.
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # (Σ rows × mean loss, Σ rows)
        counts = self.pipeline is None or self.pipeline.has_last  # the ranks that hold the loss
        # Eval must not shift the training RNG stream (random routing draws from it).
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for inputs_BT, targets_BT, rows in batches:
                inputs_BT, targets_BT = inputs_BT.to(self.device), targets_BT.to(self.device)
                if self.pipeline is not None:
                    doc_ids_BT = self._document_ids(inputs_BT)
                    loss = self.pipeline.eval_loss_sum(self._shard(inputs_BT), self._shard(targets_BT), doc_ids_BT)
                else:
                    loss = self.lm_loss(inputs_BT, targets_BT)
                if rows and counts:  # a stand-in row (rows 0) only keeps the collectives in step
                    total[0] += loss.double() * rows
                    total[1] += rows
        self.model.train()
        reshard(self.model)  # FSDP: no gathered root parameters left between steps
        if (world := self.par.group("pp", "dp", "cp")) is not None:
            dist.all_reduce(total, group=world)
        loss_sum, num_rows = total.tolist()
        return loss_sum / max(num_rows, 1)

    def global_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per-rank values held by one pipeline stage's dp·cp ranks (zeros elsewhere) -> their
        mean over them, on every rank: one all-reduce over all ranks, divided by dp·cp."""
        if (world := self.par.group("pp", "dp", "cp")) is None:
            return values
        values = values.clone()
        dist.all_reduce(values, group=world)
        return values / self.par.dims.replicas

    # ---- metrics -----------------------------------------------------------------------------------
    def metrics(self, out: StepOutput, *, step: int, steps: int, seconds: float) -> dict[str, Any]:
        """The metrics.jsonl record of step `step`, whose last `steps` steps took `seconds`; one
        all-reduce and one host read: call it on every rank, on logging steps only."""
        tokens_per_sec = self.tokens_per_step * steps / max(seconds, 1e-9)
        per_device = tokens_per_sec / self.par.dims.world_size
        tflops = self.flops_per_token * per_device / 1e12
        # One collective for every logged value, each at its layer's global index (zeros on other
        # stages): `global_mean` is then the mean over a stage's ranks (drops × dp·cp the global
        # count; counts, equal on a stage's ranks, unchanged). float64 keeps large counts exact.
        L, E, K = self.cfg.model.num_moe_layers, self.cfg.model.moe.num_experts, self.cfg.model.mtp_depth
        packed = torch.zeros(1 + K + L * (3 + E), dtype=torch.float64, device=self.device)
        layers_LC = packed[1 + K :].view(L, 3 + E)  # each MoE layer's lb, z, dropped, tokens per expert
        packed[0] = out.lm_loss
        if out.mtp is not None:  # on the rank holding the LM head (the last pipeline stage)
            packed[1 : 1 + K] = out.mtp
        for i, s in zip(self.model.moe_layer_indices(), out.routing):
            layers_LC[i, 0], layers_LC[i, 1], layers_LC[i, 2] = s["lb_loss"], s["z_loss"], s["dropped"]
            layers_LC[i, 3:] = s["tokens_per_expert"]
        mean = self.global_mean(packed)
        dp = self.par.dims.replicas
        layers = [
            {"lb_loss": r[0], "z_loss": r[1], "dropped": r[2] * dp, "tokens_per_expert": r[3:].round().long()}
            for r in mean[1 + K :].view(L, 3 + E)
        ]
        routing = routing_metrics(layers, ep=self.par.dims.ep)  # in the record's order
        lb_loss, z_loss = routing.pop("lb_loss"), routing.pop("z_loss")
        lm_loss, grad_norm, skipped, mtp_loss = torch.stack(
            [
                mean[0],
                out.grad_norm.double(),
                self.guard.skipped_total.double(),
                mean[1 : 1 + K].mean() if K else mean[0] * 0,
            ]
        ).tolist()
        moe = self.cfg.model.moe
        aux = L * (moe.lb_loss_weight * lb_loss + moe.z_loss_weight * z_loss)
        aux += self.cfg.model.mtp_loss_weight * mtp_loss if K else 0.0
        record = {
            "step": step,
            "loss": lm_loss + aux,
            "lm_loss": lm_loss,
            "lb_loss": lb_loss,
            "z_loss": z_loss,
            "lr": out.lr,
            "grad_norm": grad_norm,
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": per_device,
            "tflops_per_device": tflops,
            "mfu": tflops * 1e12 / self.peak_flops if self.peak_flops else None,
            "peak_mem_gib": peak_mem_gib(self.device, self.graph_memory_bytes()),
            **routing,
            "skipped_steps": int(skipped),
        }
        if K:
            record["mtp_loss"] = mtp_loss
        return record

    # ---- state -------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, dict]:
        """This rank's part of the checkpoint's entries, which DCP saves and loads into in place."""
        return checkpoint_io.checkpoint_entries(
            self.model, self.optimizer.checkpoint_masters(), self.optimizer.checkpoint_tensors()
        )

    def checkpoint_loaded(self) -> None:
        """After a load into `checkpoint_state()`'s entries: the optimizer takes its step count and
        refreshes what derives from the weights (collective under the sharded optimizer); the step
        graph is captured again (the optimizer may hold new tensors)."""
        self.optimizer.checkpoint_loaded()
        if self.step_graph is not None:
            self.step_graph.reset()

    def load_model_weights(self, path) -> None:
        """Only the model's weights from the checkpoint at `path` (checkpoint.init_from), each rank
        reading its part; the optimizer refreshes its copies of them (moments stay fresh)."""
        entries = checkpoint_io.checkpoint_entries(self.model, self.optimizer.checkpoint_masters())
        checkpoint_io.load_checkpoint(path, entries)
        self.checkpoint_loaded()

    def parameters_finite(self) -> bool:
        """Whether every parameter of every rank is finite (a collective and one host read)."""
        # This rank's values (its shards under FSDP); the all-reduce covers the rest.
        params = [p.detach().to_local() if is_sharded(p) else p.detach() for p in self.model.parameters()]
        # min and max reach NaN and ±inf with no parameter-sized temporary (unlike isfinite)
        extremes = [torch.stack(torch.aminmax(p)).float() for p in params if p.numel()]
        bad = ~torch.isfinite(torch.cat(extremes)).all() if extremes else torch.tensor(False)
        if (world := self.par.group("pp", "dp", "cp")) is not None:
            bad = bad.to(torch.int32)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=world)
        return not bool(bad)
