"""Pipeline parallelism with torch.distributed.pipelining (docs/architecture.md, "Pipeline
parallelism").

Legend: S = pp × v pipeline stages, v stages per rank, n micro-batches per optimizer step,
B sequences per micro-batch on this rank, T sequence length, D model dim, V vocabulary.

The layers are cut into S stages of equal numbers of blocks (`stage_layers`); stage s runs on
pipeline rank s mod pp ("looped" for v > 1, as the interleaved schedule expects). The model stays
one `Transformer` per rank (`split_model`), and the stages are `StageModule` views over it, so
the optimizer, the gradient reducer and checkpoints keep working on the one `Transformer`.

One optimizer step = one `schedule.step()` over the step's n micro-batches. The loss of each is
the micro-batch's mean cross-entropy / n (× the gradient reduction's `loss_scale` for the
backward only) and gradients are not rescaled (scale_grads=False): the same sum as the plain
loop. Load-balancing / z losses ride on each MoE layer's output (`AttachAuxLoss`), so a stage's
backward applies them. So the loss and every gradient are those of the single-process run.

Multi-token prediction (model.mtp_depth = K, src/moetrain/model/mtp.py) runs on the last stage, which
holds the LM head; the embedding is the first stage's. So the first stage embeds the K rolled
token sequences and sends them along with the hidden state (B, T, (1 + K)·D); middle stages pass
them on untouched; the last stage takes each micro-batch's targets from a queue
(`queue_targets`) and attaches the MTP loss to its logits.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from moetrain.model.mtp import MultiTokenPrediction
from moetrain.model.transformer import Transformer
from moetrain.parallel.config import PipelineSchedule
from moetrain.parallel.dims import ParallelDims, ParallelState


def stage_layers(n_layers: int, num_stages: int) -> list[list[str]]:
    """Block keys (layer indices) of each stage: contiguous ranges, as equal as the numbers allow;
    when they do not divide, the first n_layers mod S stages take one block more (the last
    stage, which also runs the LM head and the loss, is never the longer one)."""
    per, extra = divmod(n_layers, num_stages)
    start = [s * per + min(s, extra) for s in range(num_stages + 1)]
    return [[str(i) for i in range(start[s], start[s + 1])] for s in range(num_stages)]


def stages_of_rank(pp_rank: int, dims: ParallelDims) -> list[int]:
    return [pp_rank + i * dims.pp for i in range(dims.stages_per_rank)]


def split_model(model: Transformer, dims: ParallelDims, pp_rank: int) -> None:
    """Keep only what pipeline rank `pp_rank`'s stages run (on a meta-device model, before
    anything else)."""
    stages = stages_of_rank(pp_rank, dims)
    layout = stage_layers(model.cfg.n_layers, dims.num_stages)
    keep = {key for s in stages for key in layout[s]}
    for key in list(model.blocks.keys()):
        if key not in keep:
            del model.blocks[key]
    if 0 not in stages:
        model.embed = None
    if dims.num_stages - 1 not in stages:
        model.norm = None
        model.lm_head = None
        model.mtp = None


class StageModule(nn.Module):
    """One pipeline stage: a view over the blocks (and embedding / head) of a split model. First
    stage: tokens (B, T) -> hidden (B, T, D); middle: hidden -> hidden; last: hidden -> logits
    (B, T, V). Hidden states travel between stages in fp32 (the residual stream's dtype).

    Document masking: only tokens travel into the first stage, so every stage gets the
    micro-batches' document ids beforehand (`queue_doc_ids`, in micro-batch order, as every
    schedule runs a stage's forwards) and takes one per forward."""

    def __init__(self, model: Transformer, keys: list[str], first: bool, last: bool, amp_dtype: torch.dtype | None):
        super().__init__()
        self.first, self.last = first, last
        self.embed = model.embed if first else None
        self.rope = model.rope
        self.sequence = model.sequence
        self.blocks = nn.ModuleList([model.blocks[k] for k in keys])
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.mtp_depth = model.cfg.mtp_depth
        """Shifted embeddings (K·D channels) travel beside the hidden state (module docstring)."""
        self.mtp = model.mtp if last else None
        self.amp_dtype = amp_dtype
        self._doc_ids: collections.deque[torch.Tensor] | None = None
        self._targets: collections.deque[torch.Tensor] | None = None

    def queue_doc_ids(self, doc_ids: list[torch.Tensor] | None) -> None:
        self._doc_ids = collections.deque(doc_ids) if doc_ids is not None else None

    def queue_targets(self, targets: list[torch.Tensor] | None) -> None:
        """The micro-batches' targets, for the last stage's multi-token prediction loss."""
        self._targets = collections.deque(targets) if targets is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        doc_ids_BT = self._doc_ids.popleft() if self._doc_ids else None
        autocast = (
            torch.autocast(x.device.type, dtype=self.amp_dtype)
            if self.amp_dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            if self.first:
                x_BTD = self.embed(x)
                shifted = self.mtp_depth and MultiTokenPrediction.shifted_embeddings(self.embed, x, self.mtp_depth)
            else:
                x_BTD, *shifted = x.chunk(1 + self.mtp_depth, dim=-1)
            attention = self.sequence.attention_inputs(self.rope, x_BTD.shape[1], doc_ids_BT, x_BTD.device)
            for block in self.blocks:
                x_BTD = block(x_BTD, *attention)
            if self.last:
                logits_BTV = self.lm_head(self.norm(x_BTD))
                targets_BT = self._targets.popleft() if self._targets else None
                if self.mtp is not None and self.training and targets_BT is not None:
                    mtp_loss = self.mtp.loss(x_BTD, shifted, targets_BT, self.norm, self.lm_head, attention, 0)
                    logits_BTV = self.mtp.attach(logits_BTV, mtp_loss)
                return logits_BTV
        return torch.cat([x_BTD.float(), *(e.float() for e in shifted)], dim=-1) if self.mtp_depth else x_BTD.float()


@dataclass
class Pipeline:
    """This rank's stages and the schedule that drives them."""

    stages: list[StageModule]
    stage_ids: list[int]
    schedule: object
    state: ParallelState
    n_microbatches: int
    width: int
    """Channels of the hidden state between stages: D, and K·D more with multi-token prediction."""
    losses: list[torch.Tensor]
    """The step's micro-batch losses (mean cross-entropy / n), filled by the schedule's loss_fn."""

    @property
    def has_last(self) -> bool:
        return self.state.dims.num_stages - 1 in self.stage_ids

    def train_step(
        self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None
    ) -> torch.Tensor:
        """Forward and backward of the step's n micro-batches (inputs of n·B rows, micro-batch
        i = rows [i·B, (i+1)·B)); return the summed loss on the last stage's ranks, 0 elsewhere."""
        n = self.n_microbatches
        for stage in self.stages:
            stage.queue_doc_ids(list(doc_ids_BT.chunk(n)) if doc_ids_BT is not None else None)
            stage.queue_targets(list(targets_BT.chunk(n)) if stage.last and stage.mtp is not None else None)
        self.losses.clear()
        args = (inputs_BT,) if 0 in self.stage_ids else ()  # the first stage takes the tokens
        kwargs = {"target": targets_BT} if self.has_last else {}
        self.schedule.step(*args, **kwargs, return_outputs=False)  # the loss is all we need: no logits kept
        if not self.losses:
            return torch.zeros((), device=inputs_BT.device)
        return torch.stack(self.losses).sum()

    @torch.no_grad()
    def eval_loss_sum(
        self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, doc_ids_BT: torch.Tensor | None
    ) -> torch.Tensor:
        """Forward only, one micro-batch through the stages in order (point-to-point sends of
        the (B, T, D) hidden state); the mean cross-entropy on the last stage's ranks, 0
        elsewhere. Evaluation is rare: no overlap is attempted."""
        dims = self.state.dims
        group = self.state.group("pp")
        B, T = inputs_BT.shape
        x = inputs_BT
        for s in range(dims.num_stages):
            owner = s % dims.pp
            if owner != self.state.index("pp"):
                continue
            stage = self.stages[self.stage_ids.index(s)]
            if s > 0:
                x = torch.empty(B, T, self.width, dtype=torch.float32, device=inputs_BT.device)
                dist.recv(x, src=dist.get_global_rank(group, (s - 1) % dims.pp), group=group)
            stage.queue_doc_ids([doc_ids_BT] if doc_ids_BT is not None else None)
            x = stage(x)
            if s < dims.num_stages - 1:
                dist.send(x.contiguous(), dst=dist.get_global_rank(group, (s + 1) % dims.pp), group=group)
        if not self.has_last:
            return torch.zeros((), device=inputs_BT.device)
        return F.cross_entropy(x.float().flatten(0, 1), targets_BT.flatten())


def build_pipeline(
    model: Transformer,
    state: ParallelState,
    schedule: PipelineSchedule,
    n_microbatches: int,
    micro_batch_rows: int,
    seq_len: int,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    loss_scale: float = 1.0,
) -> Pipeline:
    """Stages over the (split, materialized, initialized) model and their schedule. Stage shapes are
    given to `PipelineStage` up front (fixed by the config): no shape-inference pass, which would
    run the MoE layers' collectives."""
    dims = state.dims
    S = dims.num_stages
    cfg = model.cfg
    layout = stage_layers(cfg.n_layers, S)
    stage_ids, group = stages_of_rank(state.index("pp"), dims), state.group("pp")
    B, T, V = micro_batch_rows, seq_len, cfg.vocab_size
    D = cfg.d_model * (1 + cfg.mtp_depth)  # the shifted embeddings travel beside the hidden state
    # requires_grad marks what carries a gradient back to the previous stage.
    hidden = torch.empty(B, T, D, dtype=torch.float32, device="meta", requires_grad=True)
    logits = torch.empty(B, T, V, dtype=amp_dtype or torch.float32, device="meta", requires_grad=True)
    modules, stages = [], []
    for s in stage_ids:
        first, last = s == 0, s == S - 1
        module = StageModule(model, layout[s], first, last, amp_dtype)
        inputs = torch.empty(B, T, dtype=torch.long, device="meta") if first else hidden
        outputs = logits if last else hidden
        stages.append(PipelineStage(module, s, S, device, input_args=inputs, output_args=outputs, group=group))
        modules.append(module)

    # The schedule backpropagates loss_fn's value, scaled for the gradient reduction; the
    # unscaled micro-batch losses are kept for the caller (`Pipeline.train_step`).
    unscaled: list[torch.Tensor] = []

    def loss_fn(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten()) / n_microbatches
        unscaled.append(loss.detach())
        return loss * loss_scale

    if schedule == PipelineSchedule.interleaved_1f1b:
        sched = ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        cls = ScheduleGPipe if schedule == PipelineSchedule.gpipe else Schedule1F1B
        sched = cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(modules, stage_ids, sched, state, n_microbatches, D, unscaled)
