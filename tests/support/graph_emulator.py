"""`EmulatedGraph`: a CPU stand-in for a CUDA graph (the `GraphBackend` of
src/moetrain/train/cuda_graphs.py), so that code written to be captured and replayed is tested
where there is no GPU.

A CUDA graph keeps the kernels a capture launched, with their arguments as they were then:
tensors as memory, Python numbers as values. Capturing runs nothing; a replay runs the same
kernels on the same memory. Code written for eager execution goes wrong under a graph where it
- passes a number that changes from step to step (a learning rate, a step count read on the
  host): the graph keeps the captured one;
- rebinds an attribute to a new tensor (`self.n = self.n + 1`): the graph keeps reading and
  writing the old one, and the attribute stops changing;
- drops a tensor made before the capture that the graph reads (the old one above, once nothing
  else refers to it): a graph holds no reference, so at the next replay that memory is free and
  may hold anything (`FreedBeforeReplay`, checked at each replay);
- reads a device value on the host (`.item()`, `bool(t)`): that cannot be captured at all.

The emulator records the aten operations of the captured function (a `TorchDispatchMode`) with
their arguments, then puts back every tensor the capture wrote (snapshots of their storages taken
before each first write), so that capturing has no effect. A replay runs the recorded operations
again: in-place ones on the same tensors; a fresh result is copied into the tensor the capture
returned, which later operations read. So the three faults above show as they would on the GPU.
What the capture allocated holds NaN (or the most negative integer) until a replay writes it, as
a CUDA capture leaves its memory unwritten: a value of the capture read outside the graph shows.
It is filled so again before each replay, and a replay runs nothing for an allocation
(`ALLOCATIONS`): on the GPU such a block may also hold a temporary the captured step wrote
earlier, so what the program wrote there between replays, or the last replay left there, is gone
when the step reads it.
Random numbers: as with CUDA's generator, the capture leaves the generator where it was and
each replay draws the next numbers, as the eager operations would have. Streams: there is one;
`on_capture_stream` counts the eager calls made through it, and a test may set `stale_stream` to
have `stream_capturing` say that gradient accumulation ran off the capture's stream.

Aten operations only: Triton launches are not recorded, so the device path checked here is
torch's (fused AdamW, foreach norms); the Triton one is checked on the GPU
(tests/gpu/test_cuda.py).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from moetrain.train.cuda_graphs import CaptureFailed

HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}
"""Operations that read device values on the host: a CUDA capture fails on them."""
ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}
"""Operations that only allocate: a replay runs no kernel for them."""


class HostReadInCapture(CaptureFailed):
    """A captured function read a device value on the host (on the GPU the capture fails, and
    `CudaGraph` raises `CaptureFailed`)."""


class FreedBeforeReplay(RuntimeError):
    """A replay would read memory the program has let go of (`EmulatedGraph._check_lifetimes`)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class _Op:
    __slots__ = ("func", "args", "kwargs", "out")

    def __init__(self, func, args, kwargs, out):
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: EmulatedGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            reason = f"{func} reads a device value on the host"
            raise HostReadInCapture(f"{reason} inside a captured function", reason)
        for t in _written(func, args, kwargs):
            self.graph._snapshot(t)
        out = func(*args, **kwargs)
        self.graph.ops.append(_Op(func, args, kwargs, out))
        return out


class EmulatedGraph:
    """Capture and replay of aten operations on the CPU with a CUDA graph's semantics (module
    docstring)."""

    def __init__(self):
        self.ops: list[_Op] | None = []
        """The captured operations (None after `release`)."""
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self.captures = 0
        self.replays = 0
        self.on_stream = 0
        """Eager calls run through `on_capture_stream`."""
        self.capturing = False
        self.stale_stream = False
        """A test's switch: autograd's gradient accumulation runs off the capture's stream during
        a capture (as it does on the GPU for a parameter whose accumulator was made on another
        stream), so `stream_capturing` is false there."""
        self.device_s: list[float] = []
        """A test's setting: the device seconds the next `timed` calls report, in order; once
        they run out, the host's time (the CPU runs what it is given as it is given it)."""

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.ops, self._saved = [], {}
        rng = torch.random.get_rng_state()
        self.capturing = True
        try:
            with _Recorder(self):
                out = fn()
        finally:
            self.capturing = False
            torch.random.set_rng_state(rng)  # a capture draws no numbers: each replay does
            for storage, saved in self._saved.values():  # a capture runs nothing
                storage.copy_(saved)
            self._saved = {}
            self._poison_allocated()  # and what it allocated holds no result until a replay
        self.captures += 1
        return out

    def _poison_allocated(self) -> None:
        """Fill what the capture allocated as unwritten memory (`_poison`), after the capture and
        again before each replay (module docstring)."""
        for op in self.ops:
            if not any(r.alias_info is not None for r in op.func._schema.returns):
                tree_map(_poison, op.out)

    def release(self) -> None:
        self.ops = None

    @contextlib.contextmanager
    def on_capture_stream(self):
        self.on_stream += 1
        yield

    def stream_capturing(self) -> bool:
        return self.capturing and not self.stale_stream

    @contextlib.contextmanager
    def timed(self):
        if self.device_s:
            seconds = self.device_s.pop(0)
            yield lambda: seconds
            return
        began, took = time.perf_counter(), []
        yield lambda: took[0]
        took.append(time.perf_counter() - began)

    def replay(self) -> None:
        assert self.ops is not None, "replayed after release, before a new capture"
        self._check_lifetimes()
        self._poison_allocated()
        swap: dict[int, torch.Tensor] = {}  # recorded tensor → the view or in-place result replacing it

        def current(x):
            return swap.get(id(x), x) if isinstance(x, torch.Tensor) else x

        with torch.no_grad():  # a replay is kernels, with no autograd above them
            for op in self.ops:
                if op.func in ALLOCATIONS:
                    continue  # no kernel: the memory holds what the step last wrote there
                result = op.func(*tree_map(current, op.args), **tree_map(current, op.kwargs))
                aliases = [r.alias_info is not None for r in op.func._schema.returns]
                _bind(op.out, result, any(aliases), swap)
        self.replays += 1

    def _check_lifetimes(self) -> None:
        """A CUDA graph holds no reference to the memory it reads: a tensor made before the
        capture that the program has since dropped is free memory at the next replay, which the
        allocator may have given to anything. The recorded operations keep such a tensor alive
        here, so it is looked for: one that nothing but the recorded operations refers to, and
        whose storage no other tensor holds (the bases of views counted as the view's), raises
        `FreedBeforeReplay`."""
        recorded, candidates = _made_before(self.ops)
        probe = [torch.empty(0), None]  # held as each candidate is: the references this check adds
        extra = _references(probe[0])
        for entry in candidates.values():
            if _references(entry[0]) - extra > recorded[id(entry[0])]:
                continue  # the program still refers to it
            t, op = entry
            chain, base = {id(t)}, t._base
            while base is not None:
                chain.add(id(base))
                base = base._base
            # the use count holds every tensor over the storage, and the storage object asked
            if torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1 <= len(chain):
                what = f"a {tuple(t.shape)} {t.dtype} tensor"
                reason = f"{op.func} reads {what} made before the capture and since dropped"
                raise FreedBeforeReplay(f"{reason}: on a GPU its memory is free at the replay", reason)

    def _snapshot(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._saved and storage.nbytes():
            self._saved[key] = (storage, storage.clone())


def _made_before(ops: list[_Op]) -> tuple[dict[int, int], dict[int, list]]:
    """(id → the references the recorded operations hold to each tensor; id → [tensor, the
    first operation that reads it] of the tensors read that no recorded operation made)."""
    recorded: dict[int, int] = {}
    for tree in [(op.args, op.kwargs, op.out) for op in ops]:
        for x in _tensors(tree):
            recorded[id(x)] = recorded.get(id(x), 0) + 1
    produced = {id(x) for op in ops for x in _tensors(op.out)}
    candidates: dict[int, list] = {}
    for op in ops:
        for t in _tensors((op.args, op.kwargs)):
            if id(t) not in produced and t.untyped_storage().nbytes():
                candidates.setdefault(id(t), [t, op])
    return recorded, candidates


def _references(t: torch.Tensor) -> int:
    return sys.getrefcount(t)


def _tensors(tree) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    tree_map(lambda x: out.append(x) if isinstance(x, torch.Tensor) else None, tree)
    return out


def _poison(x) -> None:
    """A tensor a capture allocated: NaN, or the most negative integer, as a stand-in for the
    memory a CUDA capture leaves unwritten."""
    if isinstance(x, torch.Tensor) and x.numel():
        if x.is_floating_point():
            x.fill_(math.nan)
        elif x.dtype != torch.bool and not x.is_complex():
            x.fill_(torch.iinfo(x.dtype).min)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors `func` writes (its schema's mutable arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += [v for v in (value if isinstance(value, list | tuple) else [value]) if isinstance(v, torch.Tensor)]
    return out


def _bind(recorded, result, aliases: bool, swap: dict[int, torch.Tensor]) -> None:
    """After a replayed operation: a result that aliases its input (a view, an in-place op)
    stands in for the recorded one from now on; a fresh one is written into the recorded tensor,
    which later operations read (as a graph's kernels read its pool's memory)."""
    if isinstance(recorded, list | tuple):
        for r, x in zip(recorded, result):
            _bind(r, x, aliases, swap)
    elif isinstance(recorded, torch.Tensor):
        if aliases:
            swap[id(recorded)] = result
        else:
            recorded.copy_(result)
