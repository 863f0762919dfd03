"""`GradReducer`: data-parallel gradient reduction for the resident-expert layout (the `ddp` stack),
used by the replicated and (as reduce-scatter) the sharded optimizer.

Dense parameters are replicated on every data-parallel rank: their gradients are summed over the
dp group. Expert parameters live on the ranks of their expert-replica group (edp): their
gradients already hold the contributions of every token of their expert-parallel group (the
all-to-all's backward brought them), so they are summed over edp only. The 1/dp that turns these
sums into the gradient of the mean loss over the global batch is not a pass over the gradients:
the caller scales each backward's loss by `loss_scale` = 1/dp (the engine folds it into the LM
and aux losses' 1/micro-batches factor), so the sums are the means: a division pass would read
and write every gradient once more.

Each gradient is a view into a flat fp32 bucket (like DDP's gradient_as_bucket_view), so
accumulation over micro-batches happens in place and a finished bucket is reduced as one
message. A bucket's all-reduce starts as soon as all its gradients are final — every parameter's
post-accumulate-grad hook has fired once per micro-batch of the step — overlapping communication
with the rest of the backward pass; `finish()` waits for them before the optimizer step. Counting
hooks (rather than being told which backward is the last) also serves the pipeline schedules,
which run all of a step's backward passes inside one call.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from moetrain.model.experts import GroupedExperts
from moetrain.optim.split_master import SplitMaster
from moetrain.parallel.dims import ParallelState


@dataclasses.dataclass
class Bucket:
    flat: torch.Tensor
    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    pending: int = 0
    work: dist.Work | None = None
    launched: bool = False
    split: bool = False
    """A stretch of `SplitMaster.grad` (the bf16 parameters' fp32 gradients)."""


def expert_param_ids(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}


class GradReducer:
    def __init__(
        self,
        model: nn.Module,
        state: ParallelState,
        bucket_bytes: int = 25 * 2**20,
        split: SplitMaster | None = None,
        split_ids: set[int] = frozenset(),
    ):
        """`split`: the bf16 parameters' fp32 gradients live in `split.grad` (their buckets are
        slices of it, in its order, which is this reducer's); build it before the reducer, so its
        accumulation hook runs before the reducer's counting hook. `split_ids`: the ids of bf16
        parameters whose buckets a subclass makes itself (`ShardedAdamW`'s); either way each
        bucket holds only split or only fp32 parameters."""
        self.loss_scale = 1.0 / state.dims.dp
        """Scale every backward's loss by this: the reduced sums are then the global means."""
        self.sync = False
        expert_ids = expert_param_ids(model)
        self._split_grads = split.grad_views() if split is not None else {}
        split_ids = set(split_ids) | set(self._split_grads)
        # Reverse registration order approximates the order in which backward finishes them.
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.buckets: list[Bucket] = []
        for is_expert, is_split in ((False, True), (False, False), (True, True), (True, False)):
            group = state.edp_group if is_expert else state.dp_group
            chosen = [p for p in params if (id(p) in expert_ids) == is_expert and (id(p) in split_ids) == is_split]
            start = 0
            while start < len(chosen):
                size, end = 0, start
                while end < len(chosen) and (end == start or size + chosen[end].numel() * 4 <= bucket_bytes):
                    size += chosen[end].numel() * 4
                    end += 1
                self.buckets.append(self._make_bucket(chosen[start:end], group, is_split))
                start = end

    def _make_bucket(self, params: list[nn.Parameter], group, is_split: bool) -> Bucket:
        """A bucket over `params`; split ones (bf16: their fp32 gradients adjacent in
        `SplitMaster`'s buffer) make the bucket that stretch of the buffer, else a new flat
        buffer becomes the parameters' `.grad` storage."""
        split_views = [self._split_grads[id(p)] for p in params] if is_split else None
        if split_views is not None:
            first, last = split_views[0], split_views[-1]
            base = first.view(-1)
            numel = sum(v.numel() for v in split_views)
            assert last.data_ptr() + last.numel() * 4 == base.data_ptr() + numel * 4, "split gradients not adjacent"
            flat = torch.as_strided(base, (numel,), (1,))
        else:
            flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=params[0].device)
        bucket = Bucket(flat, params, group)
        offset = 0
        for p in params:
            if split_views is None:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            p.register_post_accumulate_grad_hook(lambda _p, b=bucket: self._on_grad_ready(b))
        bucket.split = split_views is not None
        return bucket

    def prepare(self, sync: bool, backward_passes: int = 1) -> None:
        """Call before each micro-batch's backward, `sync=True` for the last one of the step; or
        once before `backward_passes` backward passes that end the step (a pipeline step)."""
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
        """Wait for every reduction (starting those whose parameters got no gradient). With the
        losses scaled by `loss_scale`, the reduced gradients are the means over the global batch."""
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
        self.sync = False

    def zero_grad(self) -> None:
        """Zero the gradients in place (the buckets must stay the gradients' storage); the split
        parameters' buckets are left alone (`SplitMaster.zero_grad`: their next backward copies)."""
        for b in self.buckets:
            if not b.split:
                b.flat.zero_()
