"""Rehearsal: one rank of an N-rank layout, run alone on this device, its peers stood in for
(docs/architecture.md, "Rehearsal": what each collective returns, what is measured and what not).

`moetrain train|bench PRESET --rehearse N [--rank R]` builds rank R of the N-rank run as a real
launch would; the whole difference is the process group. The default group is a `StandInGroup`
(this module's torch.distributed backend) of N ranks with this process as rank R, and so is
every group made from it. Each collective returns what symmetric peers would send —
peers that hold what this rank holds and route as it routes: an all-reduce's SUM is the value ×
the group size, an all-gather puts this rank's input in every slot, an all-to-all's output is
its input, a receive is random floats (this module's own generator) or ones; what has no
symmetric answer (a scatter from another root, unequal all-to-all splits) is refused.

The stand-ins write through `.data`, as a real group writes
memory behind autograd's back: no version counter moves (an asynchronous exchange's buffer is a
view autograd watches). Their device work runs on the current stream inside a `rehearsal:OP`
profiler range, and the `Ledger` counts each collective's calls and the bytes it would send, per
group size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "moetrain_rehearsal"

_IDEMPOTENT = (dist.ReduceOp.AVG, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.BAND, dist.ReduceOp.BOR)
"""Reductions of identical copies that give the copy back."""


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """Run rank `rank` of a `world`-rank layout alone."""

    world: int
    rank: int


@dataclasses.dataclass
class Ledger:
    """What the stand-in collectives were asked to move: per (collective, group size), the calls
    and the bytes this rank's input held (an all-reduce's buffer, an all-to-all's send buffer, an
    all-gather's shard, a reduce-scatter's full input, a send's tensor)."""

    calls: dict[tuple[str, int], int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    bytes: dict[tuple[str, int], int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    log: list[tuple[str, int, tuple]] | None = None
    """With a list here: every call in order, (collective, group size, (shape, dtype) of each input)."""
    timing: bool = False
    """Time each call's own work (device events on CUDA, the host clock on CPU): `seconds()`."""
    _events: list = dataclasses.field(default_factory=list)
    _host_s: float = 0.0

    def add(self, op: str, size: int, tensors) -> None:
        self.calls[(op, size)] += 1
        self.bytes[(op, size)] += sum(t.numel() * t.element_size() for t in tensors)
        if self.log is not None:
            self.log.append((op, size, tuple((tuple(t.shape), str(t.dtype)) for t in tensors)))

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self._events.clear()
        self._host_s = 0.0

    def seconds(self) -> float:
        """The stand-ins' own time since `reset()` (with `timing`): what the copies and scales
        that replace the transfers took, to be taken out of a step's time. Synchronizes."""
        if self._events:
            self._events[-1][1].synchronize()
        return self._host_s + sum(start.elapsed_time(end) for start, end in self._events) / 1000

    @contextlib.contextmanager
    def timed(self, device: torch.device | None):
        if not self.timing:
            yield
        elif device is not None and device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._host_s += time.perf_counter() - t0

    def summary(self, steps: int = 1) -> dict[str, dict[str, float]]:
        """Per step: {"OP over G ranks": {"calls": …, "bytes": …}}."""
        return {
            f"{op} over {size} ranks": {
                "calls": self.calls[(op, size)] / steps,
                "bytes": self.bytes[(op, size)] / steps,
            }
            for op, size in sorted(self.calls)
        }


LEDGER = Ledger()


def _done(result=None):
    future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


_DEPTH = 0


def inside_stand_in() -> bool:
    """Whether a stand-in collective is running now (its copies and scales are no rank's work)."""
    return _DEPTH > 0


@contextlib.contextmanager
def _stand_in(op: str, size: int, tensors):
    """Around a stand-in collective's work: counted in the ledger, a `rehearsal:OP` profiler
    range, no autograd."""
    global _DEPTH
    LEDGER.add(op, size, tensors)
    _DEPTH += 1
    device = tensors[0].device if tensors else None
    try:
        with torch.profiler.record_function(f"rehearsal:{op}"), torch.no_grad(), LEDGER.timed(device):
            yield
    finally:
        _DEPTH -= 1


class StandInGroup(dist.ProcessGroup):
    """A process group of `size` ranks in which only this process (rank `rank`) exists (module
    docstring), with torch's current method names and the older ones (torch 2.10–2.12)."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._name = ""
        self._desc = ""
        self._recv_generators: dict[torch.device, torch.Generator] = {}

    # ---- identity --------------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    setGroupName, group_name = _set_group_name, property(getGroupName)  # noqa: N815
    setGroupDesc, group_desc = _set_group_desc, property(getGroupDesc)  # noqa: N815

    # ---- reductions ------------------------------------------------------------------------------
    def _reduce_identical(self, t: torch.Tensor, op) -> None:
        """`t` := the reduction of `size` copies of itself."""
        kind = op.op if hasattr(op, "op") else op
        n, boolean = self._size, t.dtype == torch.bool
        if kind == dist.ReduceOp.SUM and not boolean:
            t.mul_(n)
        elif kind == dist.ReduceOp.PRODUCT and not boolean:
            t.pow_(n)
        elif kind == dist.ReduceOp.BXOR and n % 2 == 0:
            t.zero_()
        elif kind not in _IDEMPOTENT + (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.BXOR):
            raise RuntimeError(
                f"a rehearsal's stand-in group reduces identical copies by SUM, PRODUCT, AVG, MIN, MAX, BAND, BOR "
                f"or BXOR; {kind} has no symmetric answer (rehearsal: src/moetrain/parallel/rehearsal.py)"
            )

    def allreduce(self, tensors, opts=None):
        with _stand_in("all_reduce", self._size, tensors):
            for t in tensors:
                self._reduce_identical(t.data, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return _done(tensors)

    allreduce_coalesced = allreduce

    def reduce(self, tensors, opts=None):
        if opts is not None and opts.rootRank != self._rank:
            with _stand_in("reduce", self._size, tensors):
                pass
            return _done(tensors)
        return self.allreduce(tensors, opts)

    def _scatter_reduced(self, out: torch.Tensor, full: torch.Tensor, op) -> None:
        out.data.view(-1).copy_(full.data.reshape(self._size, -1)[self._rank])
        self._reduce_identical(out.data, op)

    def _reduce_scatter_base(self, out, inp, opts=None):
        with _stand_in("reduce_scatter", self._size, [inp]):
            self._scatter_reduced(out, inp, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return _done(out)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        with _stand_in("reduce_scatter", self._size, inputs):
            for out, inp in zip(outputs, inputs):
                self._scatter_reduced(out, inp, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return _done(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        with _stand_in("reduce_scatter", self._size, [t for inputs in input_lists for t in inputs]):
            for out, inputs in zip(outputs, input_lists):
                out.data.copy_(inputs[self._rank])
                self._reduce_identical(out.data, opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        return _done(outputs)

    # ---- gathers ---------------------------------------------------------------------------------
    def _replicate(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out, inp = out.data, inp.data
        if out.is_contiguous():
            out.view(self._size, -1).copy_(inp.reshape(1, -1).expand(self._size, -1))
        else:
            for chunk in out.chunk(self._size):
                chunk.copy_(inp.view_as(chunk))

    def _allgather_base(self, out, inp, opts=None):
        with _stand_in("all_gather", self._size, [inp]):
            self._replicate(out, inp)
        return _done(out)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        with _stand_in("all_gather", self._size, inputs):
            for out, inp in zip(outputs, inputs):
                self._replicate(out, inp)
        return _done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather(self, output_lists, inputs, opts=None):
        with _stand_in("all_gather", self._size, inputs):
            for outs, inp in zip(output_lists, inputs):
                for out in outs:
                    out.data.copy_(inp.data)
        return _done(output_lists)

    allgather_coalesced = allgather

    def gather(self, output_lists, inputs, opts=None):
        if opts is not None and opts.rootRank != self._rank:
            with _stand_in("gather", self._size, inputs):
                pass
            return _done()
        return self.allgather(output_lists, inputs, opts)

    def scatter(self, outputs, input_lists, opts=None):
        if opts is None or opts.rootRank != self._rank:
            raise RuntimeError(
                "a rehearsal's stand-in group cannot scatter from another rank: what that root holds for this rank "
                "has no symmetric answer (rehearsal: src/moetrain/parallel/rehearsal.py)"
            )
        with _stand_in("scatter", self._size, outputs):
            for out, inputs in zip(outputs, input_lists):
                out.data.copy_(inputs[self._rank])
        return _done(outputs)

    # ---- exchanges -------------------------------------------------------------------------------
    def alltoall_base(self, out, inp, out_splits, in_splits, opts=None):
        if list(out_splits) != list(in_splits) or out.shape != inp.shape:
            raise RuntimeError(
                f"a rehearsal's stand-in all-to-all got receive splits {list(out_splits)} for send splits "
                f"{list(in_splits)}: symmetric peers send back what this rank sends"
            )
        with _stand_in("all_to_all", self._size, [inp]):
            out.data.copy_(inp.data)
        return _done(out)

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        with _stand_in("all_to_all", self._size, inputs):
            for out, inp in zip(outputs, inputs):
                out.data.copy_(inp.data)
        return _done(outputs)

    def broadcast(self, tensors, opts=None):
        with _stand_in("broadcast", self._size, tensors):
            pass
        return _done(tensors)

    def barrier(self, opts=None):
        return _done()

    # ---- point to point --------------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        with _stand_in("send", self._size, tensors):
            pass
        return _done()

    def recv(self, tensors, src: int, tag: int = 0):
        with _stand_in("recv", self._size, tensors):
            for t in tensors:
                t = t.data
                if t.is_floating_point():
                    t.normal_(generator=self._generator(t.device))
                else:
                    t.fill_(1)
        return _done(tensors)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._recv_generators:
            self._recv_generators[device] = torch.Generator(device=device).manual_seed(0)
        return self._recv_generators[device]

    def __repr__(self) -> str:
        return f"StandInGroup(rank {self._rank} of {self._size})"


def register() -> None:
    """Make `BACKEND` a torch.distributed backend (once per process)."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(
            BACKEND, lambda store, rank, size, timeout: StandInGroup(rank, size), devices=["cpu", "cuda"]
        )


def init(rehearsal: Rehearsal) -> None:
    """The default process group: rank `rehearsal.rank` of `rehearsal.world`, all stand-ins but
    this one. An in-memory store: nothing listens on the network."""
    if not 0 <= rehearsal.rank < rehearsal.world:
        raise ValueError(rehearsal)
    register()
    dist.init_process_group(BACKEND, rank=rehearsal.rank, world_size=rehearsal.world, store=dist.HashStore())
    LEDGER.reset()


def is_rehearsal() -> bool:
    """Whether the default process group is a rehearsal's."""
    return dist.is_initialized() and dist.get_backend() == BACKEND
