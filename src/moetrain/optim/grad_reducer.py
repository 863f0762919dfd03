"""`GradReduction`, what the engine's backward passes need of the data-parallel gradient reduction;
`GradReducer`, the reduction of the resident-expert layout (the `ddp` stack), used by the
replicated and (as reduce-scatter) the sharded optimizer; `NoReduction` for one data-parallel rank.

Each optimizer holds the reduction its gradients need as its `reduction` (they share the
gradients' storage: buckets, shards, `GradStore`s); the engine calls `prepare(sync)` before each
backward and `finish()` after the last (src/moetrain/optim/base.py).

Dense gradients are summed over the dp group, experts' over edp only (the all-to-all's backward
already brought them every token of their expert-parallel group). The 1/dp that turns the sums
into the mean over the global batch is folded into each backward's loss (`loss_scale`): a
division pass would read and write every gradient once more. Only gradients that have something
to be summed with are bucketed: at edp = 1 (dp = ep) the experts' stay where autograd puts them
(`unreduced`), with no bucket to zero or copy into (at dp8·ep8 most of a rank's parameters).

Each bucketed gradient is a view into a flat bucket (like DDP's gradient_as_bucket_view), so
accumulation happens in place and a finished bucket is reduced as one message, as soon as every
parameter's post-accumulate-grad hook has fired once per micro-batch of the step: overlapped with
the rest of the backward. Counting hooks (rather than being told which backward is the last) also
serves the pipeline schedules, which run all of a step's backward passes inside one call.

With optim.grad_dtype=bf16 the buckets are bf16: an fp32 parameter's `.grad` cannot be a bf16
view, so `store` (src/moetrain/optim/grad_store.py) adds each micro-batch's gradient into the bucket
in fp32, rounding once. The all-reduce then sums in bf16 (with dp = 2 one rounded sum
round(a + b), the same on both ranks).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from moetrain.model.experts import GroupedExperts
from moetrain.optim.grad_store import GradStore
from moetrain.optim.split_master import SplitMaster
from moetrain.parallel.dims import ParallelState


@runtime_checkable
class GradReduction(Protocol):
    """The data-parallel gradient reduction of an optimizer's gradients (the optimizer's
    `reduction`): GradReducer (ddp stack), the sharded optimizer's reduce-scatter (sharded.py),
    FSDP's own (fsdp.py), or `NoReduction`."""

    loss_scale: float
    """Scale every backward's loss by this (1/dp where the reduction sums): the reduced gradients
    are then the means over the global batch, with no pass over them."""

    def prepare(self, sync: bool, backward_passes: int = 1) -> None:
        """Before a micro-batch's backward; `sync`: the last of the step (reduce now). Or once
        before `backward_passes` backward passes that end the step (a pipeline step)."""
        ...

    def finish(self) -> None:
        """After the step's last backward: wait until the reduced gradients are in place."""
        ...


class NoReduction:
    """One data-parallel rank: nothing to reduce. `finish` completes the split parameters'
    gradients (`SplitMaster.finish`), as `GradReducer.finish` does."""

    loss_scale = 1.0

    def __init__(self, split: SplitMaster | None = None):
        self.split = split

    def prepare(self, sync: bool, backward_passes: int = 1) -> None:
        """Nothing to prepare: no reduction to start."""

    def finish(self) -> None:
        if self.split is not None:
            self.split.finish()


@dataclasses.dataclass
class Bucket:
    flat: torch.Tensor
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    pending: int = 0
    work: dist.Work | None = None
    launched: bool = False
    split: bool = False
    """A stretch of `SplitMaster.grad` (the bf16 parameters' gradients)."""
    hooked: bool = False
    """Filled by `GradReducer.store`'s hook, not by autograd through `.grad` views (its
    parameters' dtype is not the gradients'): `zero_grad` leaves it alone."""


def expert_param_ids(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}


def reduced_param_ids(model: nn.Module, state: ParallelState) -> set[int]:
    """ids of the trainable parameters whose gradients a `GradReducer` sums over a group: all at
    dp·cp > 1, except the experts' when edp = 1 (nothing to sum them with); none at dp·cp = 1."""
    if state.dims.replicas == 1:
        return set()
    skip = expert_param_ids(model) if state.group("edp") is None else set()
    return {id(p) for p in model.parameters() if p.requires_grad and id(p) not in skip}


class GradReducer:
    bucket_every_parameter = False
    """Bucket also the parameters alone in their group (`unreduced`): a subclass that keeps every
    parameter in its buckets (`ShardedAdamW`'s flat buffers) sets it."""

    def __init__(
        self,
        model: nn.Module,
        state: ParallelState,
        bucket_bytes: int = 25 * 2**20,
        split: SplitMaster | None = None,
        split_ids: set[int] = frozenset(),
        grad_dtype: torch.dtype = torch.float32,
        apart: set[int] = frozenset(),
    ):
        """`split`: the bf16 parameters' gradients live in `split.grad` (their buckets are
        slices of it, in its order, which is this reducer's); build it before the reducer, so its
        accumulation hook runs before the reducer's counting hook. `split_ids`: the ids of bf16
        parameters whose buckets a subclass makes itself (`ShardedAdamW`'s); either way each
        bucket holds only split or only fp32 parameters. `grad_dtype`: the buckets' dtype
        (optim.grad_dtype). `apart`: ids of parameters bucketed apart from the others (a subclass
        updates them differently: `ShardedAdamW`'s Muon matrices)."""
        self.loss_scale = 1.0 / state.dims.replicas
        """Scale every backward's loss by this: the reduced sums are then the global means."""
        self.split = split
        self.sync = False
        self.grad_dtype = grad_dtype
        self.store = GradStore(grad_dtype)
        """The gradients of the hooked buckets' parameters (views of the buckets)."""
        elem = grad_dtype.itemsize
        expert_ids = expert_param_ids(model)
        self._split_grads = split.grad_views() if split is not None else {}
        split_ids = set(split_ids) | set(self._split_grads)
        # Reverse registration order approximates the order in which backward finishes them.
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        reduced = {id(p) for p in params} if self.bucket_every_parameter else reduced_param_ids(model, state)
        self.unreduced = [p for p in params if id(p) not in reduced]
        """Parameters whose gradients need no sum (experts at edp = 1): left where backward puts
        them — `.grad`, `split`'s own, or (another dtype) allocated by `store` — as at dp = 1."""
        split_params = {id(p) for p in split.params} if split is not None else set()
        for p in self.unreduced:
            if id(p) not in split_params and p.dtype != grad_dtype:
                self.store.add(p)
        self.buckets: list[Bucket] = []
        kinds = [(e, s, a) for e in (False, True) for s in (True, False) for a in (False, True)]
        for is_expert, is_split, is_apart in kinds:
            group = state.group("edp") if is_expert else state.group("dp", "cp")
            chosen = [
                p
                for p in params
                if id(p) in reduced
                and (id(p) in expert_ids) == is_expert
                and (id(p) in split_ids) == is_split
                and (id(p) in apart) == is_apart
            ]
            start = 0
            while start < len(chosen):
                size, end = 0, start
                while end < len(chosen) and (end == start or size + chosen[end].numel() * elem <= bucket_bytes):
                    size += chosen[end].numel() * elem
                    end += 1
                self.buckets.append(self._make_bucket(chosen[start:end], group, is_split))
                start = end

    def _make_bucket(self, params: list[nn.Parameter], group, is_split: bool) -> Bucket:
        """A bucket over `params`; split ones (bf16: their gradients adjacent in `SplitMaster`'s
        buffer) make the bucket that stretch of the buffer, else a new flat buffer becomes the
        parameters' `.grad` storage (or, in another dtype than theirs, `store`'s)."""
        if is_split:
            split_views = [self._split_grads[id(p)] for p in params]
            first, last = split_views[0], split_views[-1]
            base = first.view(-1)
            numel, elem = sum(v.numel() for v in split_views), base.element_size()
            end = base.data_ptr() + numel * elem
            assert last.data_ptr() + last.numel() * elem == end, "split gradients not adjacent"
            flat = torch.as_strided(base, (numel,), (1,))
        else:
            flat = torch.zeros(sum(p.numel() for p in params), dtype=self.grad_dtype, device=params[0].device)
        bucket = Bucket(flat, params, group, split=is_split)
        offset = 0
        for p in params:
            if not is_split:
                view = flat[offset : offset + p.numel()].view_as(p)
                if p.dtype == flat.dtype:
                    p.grad = view
                else:  # before the counting hook: the bucket is complete when that one fires
                    self.store.add(p, view)
                    bucket.hooked = True
            offset += p.numel()
            p.register_post_accumulate_grad_hook(lambda _p, b=bucket: self._on_grad_ready(b))
        return bucket

    def grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """`p`'s gradient (the reduced one after `finish`): its `.grad`, or its view in `store`."""
        return p.grad if id(p) not in self.store.views else self.store.grad(p)

    def prepare(self, sync: bool, backward_passes: int = 1) -> None:
        """`GradReduction.prepare`: with `sync`, expect every parameter's hook `backward_passes` times."""
        self.sync = sync
        if sync:
            for b in self.buckets:
                b.pending, b.work, b.launched = len(b.params) * backward_passes, None, False

    def _on_grad_ready(self, bucket: Bucket) -> None:
        if not self.sync:
            return
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        if bucket.group is not None:
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)

    def finish(self) -> None:
        """Wait for every reduction (starting those whose parameters got no gradient)."""
        # Zero the gradients no backward reached, before they are sent: the split parameters'
        # (`SplitMaster.finish`), then the hooked ones.
        if self.split is not None:
            self.split.finish()
        self.store.finish()
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
        self.sync = False

    def zero_grad(self) -> None:
        """Zero the gradients in place (the buckets must stay the gradients' storage); the split
        parameters' and the hooked buckets are left alone (their next backward copies into them:
        `SplitMaster.zero_grad`, `GradStore.zero_grad`)."""
        self.store.zero_grad()
        for b in self.buckets:
            if not b.split and not b.hooked:
                b.flat.zero_()
        for p in self.unreduced:
            p.grad = None
