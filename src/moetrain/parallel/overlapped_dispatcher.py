"""The overlapped expert exchange (parallel.overlap_chunks = n): the sync-free dispatcher's
all-to-alls run beside compute instead of before and after it (docs/architecture.md, "The
overlapped exchange": the schedule, forward and backward, and what it costs).

Legend as src/moetrain/parallel/nosync_dispatcher.py: N tokens on this rank, K top-k, M = N·K
assignments, D model dim, R ep ranks, L experts on this rank, G = L / n experts per chunk (by experts),
C and W a chunk's capacity and block rows.

`OverlappedDispatcher` is a `NoSyncDispatcher` whose `expert_step` (dispatch → experts → combine
+ the shared expert) is split into n exchanges, all routed before any row moves, each with 1/n
of the capacity and spill rows (bounded capacity only: the padded mode's chunks would need n ×
its buffers). The chunks split by experts where n divides L (each expert runs once, on all its
rows: the unsplit exchange's results bit for bit on CPU), else by tokens (each expert runs n
times on 1/n of its rows: its results within rounding).

`Exchange` is one equal-split all-to-all that runs while other work does: `out =
exchange.start(x)`, … other work …, `out = exchange.finish(out)`. Backward runs the mirror
image: `finish`'s backward starts the reverse all-to-all of the gradient, `start`'s backward
waits for it. Not `funcol.all_to_all_single_autograd`: its backward waits at once, so the
reverse exchange would never overlap anything. A `Work` handle cannot be traced, so
`expert_step` runs eagerly under torch.compile (`apply_compile` compiles the experts and the
shared expert on their own).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher, _CombineRows, _Plan, _Regroup, _Ungroup

if TYPE_CHECKING:
    from moetrain.model.experts import GroupedExperts
    from moetrain.model.router import RouterOutput


class OverlappedDispatcher(NoSyncDispatcher):
    """The sync-free dispatcher with its expert step split into `chunks` exchanges that overlap
    compute (the module docstring); dispatch and combine alone are NoSyncDispatcher's."""

    def __init__(self, *args, chunks: int = 1, **kwargs):
        """`NoSyncDispatcher`'s arguments, and `chunks`."""
        super().__init__(*args, **kwargs)
        # RunConfig.validate
        assert chunks == 1 or self.capacity_factor is not None, chunks
        self.chunks = chunks
        """parallel.overlap_chunks."""

    @torch.compiler.disable  # a `Work` handle cannot be traced
    def expert_step(
        self,
        x_ND: torch.Tensor,
        route: RouterOutput,
        experts: GroupedExperts,
        shared: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        """dispatch → experts → combine (+ the shared expert), the exchanges beside compute."""
        R, n = self.ep, self.chunks
        M = route.topk_ids_NK.numel()
        C, W = self._rows(M, n)
        plan = self._plan(route.topk_ids_NK, route.tokens_per_expert_E, C, W, self._chunk_of(route.topk_ids_NK), n)
        # One exchange of every chunk's keys (destination-major: (R, n·W)), then the rows.
        keys_RnW = plan.key_S.view(n, R, W).transpose(0, 1).contiguous()
        keys_recv_RnW = torch.empty_like(keys_RnW)
        keys_work = dist.all_to_all_single(keys_recv_RnW, keys_RnW, group=self.ep_group, async_op=True)
        there, sent = self._start_rows(x_ND, plan, n * [R * W])
        shared_ND = shared(x_ND) if shared is not None else None
        keys_work.wait()
        arrivals = self._arrivals(keys_recv_RnW.transpose(0, 1).reshape(n, R * W), C, M)
        y_SD = self._experts_and_back(there, sent, arrivals, experts)
        return _CombineRows.apply(y_SD, route.topk_weights_NK, *plan.state[:4], shared_ND)

    def _chunk_of(self, topk_ids_NK: torch.Tensor) -> torch.Tensor | None:
        """Each assignment's chunk: by its local expert where n divides L (chunk i: local experts
        [i·L/n, (i+1)·L/n)), else by its token (chunk i: tokens [i·N/n, (i+1)·N/n)); None for one."""
        n, L = self.chunks, self.num_local_experts
        if n == 1:
            return None
        if L % n == 0:
            return topk_ids_NK.flatten().remainder(L) // (L // n)
        num_tokens, top_k = topk_ids_NK.shape
        return torch.arange(num_tokens * top_k, device=topk_ids_NK.device) // top_k * n // num_tokens

    def _start_rows(self, x_ND: torch.Tensor, plan: _Plan, sizes: list[int]):
        """One send buffer for all chunks, sent in slices (the chunks' rows are every token's
        copies: one gather, and in backward one sum per token, not one per chunk); the slices'
        gradients arrive in one buffer, which is the whole's gradient."""
        send_SD = self._send_rows(x_ND, plan)
        send_grads = _JoinedGrad(send_SD, sizes)
        there = [Exchange(self.ep_group, functools.partial(send_grads.part, i)) for i in range(len(sizes))]
        sent = [there[i].start(part) for i, part in enumerate(_Split.apply(send_SD, send_grads))]
        return there, sent

    def _experts_and_back(self, there, sent, arrivals, experts) -> torch.Tensor:
        """Each chunk's rows to its experts as they arrive, and back as soon as they are done, into
        one buffer (R·n·W, D) in the experts' output dtype (FP8 experts give bf16), which one combine
        reads: one (N, K, D) gather kept for backward, as `combine` keeps, not one per chunk."""
        n, L = self.chunks, self.num_local_experts
        by_experts = n > 1 and L % n == 0
        weight_grads = GroupGrads(n) if by_experts else None
        back = [Exchange(self.ep_group) for _ in range(n)]
        returned, joined, row = [], None, 0
        for i, (regroup_idx_C, inv_S, offsets) in enumerate(arrivals):
            x_local_CD = _Regroup.apply(there[i].finish(sent[i]), regroup_idx_C, inv_S)
            if not by_experts:  # every local expert: autograd sums
                y_local_CD = experts(x_local_CD, offsets)
            else:
                lo, hi = i * L // n, (i + 1) * L // n
                weights = _GroupWeights.apply(experts.w_gate_up_E2FD, experts.w_down_EDF, lo, hi, weight_grads)
                y_local_CD = experts(x_local_CD, offsets, weights)
            size = inv_S.shape[0]
            if n > 1 and joined is None:
                joined = y_local_CD.new_empty(n * size, y_local_CD.shape[1])
            into = None if joined is None else joined[row : row + size]
            returned.append(back[i].start(_Ungroup.apply(y_local_CD, regroup_idx_C, inv_S), into))
            row += size
        y_back = [back[i].finish(returned[i]) for i in range(n)]
        return y_back[0] if n == 1 else _Join.apply(joined, *y_back)


class GroupGrads:
    """The weight gradients of n expert groups of one layer (each a slice of the experts'
    weights), put together into one gradient per weight tensor. Autograd would give each group's
    slice its own full-size gradient (zeros elsewhere) and sum the n of them: n passes over the
    layer's expert weights. Here each group's backward copies its slice into one buffer, and the
    last of the n hands the whole buffer to autograd (the others give no gradient): one pass."""

    def __init__(self, groups: int):
        self.groups = groups
        self.seen = 0
        self.bufs: list[torch.Tensor] | None = None


class _GroupWeights(torch.autograd.Function):
    """Experts [lo, hi)'s slices of the expert weights (views); backward: see `GroupGrads`. A
    group whose products gave no weight gradient (deferred to the step's last backward:
    src/moetrain/model/expert_grads.py) adds nothing; when none of the n did, neither does this."""

    @staticmethod
    def forward(ctx, w_gate_up, w_down, lo, hi, grads):
        ctx.lo, ctx.hi, ctx.grads = lo, hi, grads
        ctx.shapes = (w_gate_up.shape, w_down.shape)
        ctx.set_materialize_grads(False)
        return w_gate_up[lo:hi], w_down[lo:hi]

    @staticmethod
    def backward(ctx, grad_gate_up, grad_down):
        grads = ctx.grads
        # a step's products defer both weights' gradients or neither (and all n groups alike)
        assert (grad_gate_up is None) == (grad_down is None)
        assert grads.seen == 0 or (grads.bufs is None) == (grad_gate_up is None)
        if grad_gate_up is not None:
            if grads.bufs is None:
                like = (grad_gate_up, grad_down)
                grads.bufs = [g.new_empty(shape) for g, shape in zip(like, ctx.shapes)]
            for buf, g in zip(grads.bufs, (grad_gate_up, grad_down)):
                buf[ctx.lo : ctx.hi].copy_(g)
        grads.seen += 1
        if grads.seen < grads.groups:
            return None, None, None, None, None
        bufs, grads.bufs, grads.seen = grads.bufs, None, 0
        if bufs is None:
            return None, None, None, None, None
        return bufs[0], bufs[1], None, None, None


class _JoinedGrad:
    """The gradient of a buffer sent in consecutive slices, written by the slices' exchanges in
    backward: `part(i)` is slice i of one buffer, allocated when the first is asked for."""

    def __init__(self, like: torch.Tensor, sizes: list[int]):
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self.sizes = sizes
        self.whole: torch.Tensor | None = None

    def part(self, i: int) -> torch.Tensor:
        if self.whole is None:
            self.whole = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        start = sum(self.sizes[:i])
        return self.whole[start : start + self.sizes[i]]


class _Split(torch.autograd.Function):
    """`whole` as its consecutive slices (views); backward: the slices' gradients, when they
    are `grads`' parts (written there by their exchanges), are its buffer: no copy."""

    @staticmethod
    def forward(ctx, whole, grads):
        ctx.grads = grads
        return tuple(whole.split(grads.sizes))

    @staticmethod
    def backward(ctx, *parts):
        whole, ctx.grads.whole = ctx.grads.whole, None
        sizes, start, in_place = ctx.grads.sizes, 0, whole is not None
        for part, size in zip(parts, sizes):
            in_place = in_place and part is not None and part.data_ptr() == whole[start:].data_ptr()
            start += size
        if in_place:
            return whole, None
        some = next(p for p in parts if p is not None)  # autograd calls backward with one at least
        filled = [p if p is not None else some.new_zeros(size, *some.shape[1:]) for p, size in zip(parts, sizes)]
        return torch.cat(filled), None


class _Join(torch.autograd.Function):
    """`whole`, whose consecutive slices the `parts` are (views written by their exchanges), as
    one tensor to autograd: no copy; backward hands each part its slice of the gradient."""

    @staticmethod
    def forward(ctx, whole, *parts):
        ctx.sizes = [p.shape[0] for p in parts]
        return whole.view_as(whole)

    @staticmethod
    def backward(ctx, grad_SD):
        return None, *grad_SD.split(ctx.sizes)


# --- one all-to-all beside compute, forward and backward ---------------------------------------


class Exchange:
    """One all-to-all of one buffer, forward and backward (a fresh one per use)."""

    __slots__ = ("group", "work", "grad_work", "grad_into")

    def __init__(self, group: dist.ProcessGroup, grad_into: Callable[[], torch.Tensor] | None = None):
        self.group = group
        self.work: dist.Work | None = None
        self.grad_work: dist.Work | None = None
        self.grad_into = grad_into
        """Where backward's exchange writes the gradient (called when backward gets there: a
        slice of a larger buffer, say); None: a buffer of its own."""

    def start(self, x_SD: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Enqueue the exchange of `x_SD`; the returned buffer (`out`, if given: a buffer of x's
        shape, e.g. a slice of a larger one) is valid after `finish`."""
        return _Start.apply(x_SD, self, out)

    def finish(self, recv_SD: torch.Tensor) -> torch.Tensor:
        """Wait for the exchange; the buffer `start` returned, now valid."""
        return _Finish.apply(recv_SD, self)


def _exchange(
    x_SD: torch.Tensor, group: dist.ProcessGroup, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, dist.Work]:
    out = torch.empty_like(x_SD) if out is None else out
    return out, dist.all_to_all_single(out, x_SD.contiguous(), group=group, async_op=True)


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD, exchange, out):
        ctx.exchange = exchange
        out, exchange.work = _exchange(x_SD, exchange.group, out)
        return out

    @staticmethod
    def backward(ctx, grad_SD):
        exchange = ctx.exchange
        exchange.grad_work.wait()  # `grad_SD` is the buffer _Finish.backward's exchange fills
        exchange.grad_work = None
        return grad_SD, None, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv_SD, exchange):
        ctx.exchange = exchange
        exchange.work.wait()
        exchange.work = None
        return recv_SD.view_as(recv_SD)

    @staticmethod
    def backward(ctx, grad_SD):
        exchange = ctx.exchange
        into = exchange.grad_into() if exchange.grad_into is not None else None
        out, exchange.grad_work = _exchange(grad_SD, exchange.group, into)
        return out, None
