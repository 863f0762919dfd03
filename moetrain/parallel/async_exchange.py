"""An equal-split all-to-all that runs while other work does: started here, finished there, in
forward and in backward.

`exchange = Exchange(group)`, `out = exchange.start(x)`, … other work …, `out = exchange.finish(out)`.
Forward: `start` enqueues `dist.all_to_all_single(async_op=True)` and returns the receive buffer
(not yet valid); `finish` waits for it (on CUDA: the compute stream waits on NCCL's, the host
does not). Backward runs the mirror image: `finish`'s backward starts the reverse all-to-all of
the gradient, `start`'s backward waits for it, and whatever autograd runs between the two (the
other chunks' expert GEMMs: see `NoSyncDispatcher.pipelined`) overlaps it.

Why not `funcol.all_to_all_single_autograd`: its forward waits lazily (at the first use of the
result), but its backward waits at once, so the reverse exchange never overlaps anything. A
`Work` handle cannot be traced: torch.compile runs the code around it eagerly
(`NoSyncDispatcher.pipelined` is excluded from compilation; `apply_compile` compiles the experts
it calls on their own).

Equal splits only (the sync-free dispatcher's): the buffer's first dimension is divisible by the
group's size and every rank sends the same share to every other. The bytes held: the send
buffer until the exchange completes (the process group keeps it), the receive buffer until its
consumer lets go; nothing is kept for backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


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
