"""compute.cuda_graphs=step: a training step replayed from one CUDA graph (`StepGraph`).

A step launches thousands of kernels from Python (the blocks' forward and backward, the clipping
norm, the step guard, torch's fused AdamW, the split masters' Triton update, the router bias);
where they are short the GPU waits between them. A CUDA graph launches them all at once, and it
replays the kernels it captured with the arguments they had then: tensors at their addresses,
numbers at their values. So what a step reads and writes that outlives it lives at one address
for the whole run:

- the parameters, AdamW's moments and step counts, the split masters' buffers, the step guard's
  history and the router biases are allocated once and written in place (checked on the CPU
  through `tests/support/graph_emulator.py` by tests/train/test_cuda_graphs.py);
- the learning rate is a 0-d device tensor the optimizer reads (`put_lr_on_device`);
- what the captured step allocates comes from the graph's own memory, the same in every replay.

A graph of the update alone would never replay in training: the caching allocator puts every
gradient at a new address each step. No host sync is added: a replay is one launch.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from moetrain.errors import MoetrainError
from moetrain.train.config import CudaGraphs
from moetrain.transfer import pinned_for

if TYPE_CHECKING:
    from moetrain.train.engine import TrainEngine


class CaptureFailed(MoetrainError):
    """A step could not be captured as a CUDA graph."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason
        """What failed, in a few words (the operation and its error)."""


class GradientOffCaptureStream(CaptureFailed):
    """During a step's capture, a parameter's gradient was accumulated on a stream the capture
    does not record (`StepGraph`)."""


class GraphBackend(Protocol):
    """What `StepGraph` needs of a graph: `CudaGraph` on the GPU, `EmulatedGraph`
    (tests/support/graph_emulator.py) in tests on the CPU."""

    def capture(self, fn: Callable[[], tuple]) -> tuple:
        """Record `fn` (its device work is not run) and return its result, which each replay
        rewrites."""

    def replay(self) -> None:
        """Run the recorded work again."""

    def release(self) -> None:
        """Drop the recorded work and what it holds; the next capture starts afresh."""

    def on_capture_stream(self) -> contextlib.AbstractContextManager:
        """Around eager work that must run where the capture will (`StepGraph`'s warm-up steps):
        autograd ties each parameter's gradient accumulation to the stream it first ran on."""

    def stream_capturing(self) -> bool:
        """Whether work launched now, on this thread, is recorded by the capture underway."""

    def timed(self) -> contextlib.AbstractContextManager[Callable[[], float]]:
        """Around work on the current stream: a function that gives the seconds the device took
        to run it, from its first kernel's start to its last one's end, the gaps between them
        included (it waits for that end)."""


class CudaGraph:
    """`GraphBackend` over `torch.cuda.CUDAGraph`: captured into one private memory pool (a new
    capture first frees the last graph and its pool), replayed on the current stream. Captures
    and the eager work before them (`on_capture_stream`) run on one side stream, as torch requires
    of a captured backward: a leaf's gradient accumulation runs where its accumulator was made."""

    def __init__(self, device: torch.device, what: str = "the training step"):
        self.device, self.what = device, what
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.tables: list[torch.Tensor] = []
        """The optimizer kernels' device tables the graph reads (src/moetrain/optim/triton_kernels.py)."""

    def capture(self, fn: Callable[[], tuple]) -> tuple:
        from moetrain.optim.triton_kernels import tables_for_graph

        if self.graph is not None:
            # A pool whose graphs are all reset takes no new capture (torch asserts), so the new
            # graph gets a pool of its own.
            self.release()
        graph = torch.cuda.CUDAGraph()
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Not `torch.cuda.graph`: it synchronizes and empties the allocator's cache, after which the
        # next step's gradients would land elsewhere. The tables' arena is allocated first, on the
        # current stream (the one the replays run on).
        with tables_for_graph(self.device) as tables, torch.cuda.stream(stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except Exception as error:
                with contextlib.suppress(RuntimeError):  # the capture was invalidated by the error itself
                    graph.capture_end()
                raise self._failed(error) from error
            try:
                graph.capture_end()  # fails if another thread (autograd's) invalidated the capture
            except RuntimeError as error:
                raise self._failed(error) from error
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph, self.tables = graph, tables.kept + [tables.arena]
        tables.upload_pending()
        return out

    def replay(self) -> None:
        self.graph.replay()

    @contextlib.contextmanager
    def on_capture_stream(self):
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            yield
        # what the caller does next, and any block the work freed, is ordered after it
        current.wait_stream(self.stream)

    def stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    @contextlib.contextmanager
    def timed(self):
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def device_s() -> float:
            end.synchronize()
            return start.elapsed_time(end) / 1000

        start.record(stream)
        yield device_s
        end.record(stream)

    def _failed(self, error: Exception) -> CaptureFailed:
        first = (str(error).strip().splitlines() or [""])[0]  # torch's messages run on for lines
        reason = f"{type(error).__name__}: {first[:300]}"
        return CaptureFailed(
            f"{self.what} could not be captured as a CUDA graph ({reason}); set compute.cuda_graphs=off", reason
        )

    def release(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph, self.tables = None, []
        self.pool = torch.cuda.graph_pool_handle()  # the old pool goes once nothing in it is alive


AUTO_MIN_GAIN = 0.03
"""compute.cuda_graphs=auto keeps the step graph where its replays take at least this share less
device time than the eager steps before its capture; below it the graph's memory buys too little
(docs/benchmarks.md, "CUDA graphs")."""

JUDGED_REPLAYS = 2
"""Replays auto times before it keeps or drops the step graph."""

WARMUP_STEPS = 3
"""Eager steps before the step graph is captured (again): the compiled blocks compile, Triton
kernels pick their configurations, the optimizer builds its tables, and the caching allocator
has seen a whole step."""


class StepGraph:
    """`TrainEngine.train_step` replayed from one graph (compute.cuda_graphs=step).

    The first `WARMUP_STEPS` steps run eagerly on the capture's stream, so that autograd's
    per-parameter gradient accumulation runs there too (a hook fails a capture where one did not:
    `GradientOffCaptureStream`). The next step copies its batches into the graph's input buffers
    and captures `TrainEngine.step_tensors` over them, then replays at once (a capture runs
    nothing); later steps copy their batches in, set the learning rate and replay.

    A dropless MoE step keeps every shape fixed as long as the batches do: the grouped GEMMs
    always take T·k rows, only their split among the experts (device data) changes. `reset`
    drops the graph after anything changes what a step launches (a routing switch, loaded
    weights, batches of another shape). A capture that fails (`CaptureFailed`, e.g. a host read)
    is said once, and every step then runs eagerly.

    With `judge` (compute.cuda_graphs=auto) it times the eager steps before its first capture (but
    the first, which compiles) and its first `JUDGED_REPLAYS` replays, and keeps the graph only
    where a replay took at least `AUTO_MIN_GAIN` less device time. `run(..., update=False)` does
    the same for forward and backward alone (`moetrain bench --also-forward-backward`).
    """

    def __init__(self, engine: TrainEngine, backend: GraphBackend, judge: bool = False):
        self.engine, self.backend = engine, backend
        engine.optimizer.put_lr_on_device()
        self.judge = judge
        self.eager_timings: list[Callable[[], float]] = []
        self.replay_timings: list[Callable[[], float]] = []
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        """The graph's input buffers: (inputs_BT, targets_BT) of each micro-batch."""
        self.outputs: tuple | None = None
        """What the captured step returns and each replay rewrites (`TrainEngine.step_tensors`)."""
        self.captures = self.replays = self.eager = 0
        """Captures made, steps replayed, steps run eagerly."""
        self.failed: str | None = None
        """Why the capture failed (then every step runs eagerly)."""
        self.uncounted_bytes = 0
        """The graph's memory the caching allocator does not count as allocated: the step's
        temporaries, which the graph keeps for its replays (the capture's peak less what it left)."""
        self._warm = 0
        self._capturing = False
        self.update = True
        """What the graph holds: the training step, or (False) forward and backward alone."""
        for p in engine.model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._check_stream)

    def _check_stream(self, p: torch.nn.Parameter) -> None:
        if self._capturing and not self.backend.stream_capturing():
            reason = f"a gradient of shape {tuple(p.shape)} was accumulated outside the capture's stream"
            raise GradientOffCaptureStream(f"{reason} during the capture", reason)

    def reset(self, update: bool = True) -> None:
        """Run the next `WARMUP_STEPS` steps eagerly, then capture again (`update` False: forward
        and backward alone); the graph's memory goes back first, so the eager steps don't add to it."""
        self.update = update
        self.inputs = self.outputs = None
        self._warm = 0
        self.eager_timings, self.replay_timings = [], []
        self.uncounted_bytes = 0
        if self.engine.device.type == "cuda":
            # as before a capture: no replay still in flight may use what goes back
            torch.cuda.synchronize(self.engine.device)
        self.backend.release()
        if self.engine.device.type == "cuda":
            # cuBLAS keeps a workspace for each stream it ran on until told otherwise: the capture
            # stream's (tens of MiB) would stay allocated under the eager steps that follow
            torch._C._cuda_clearCublasWorkspaces()
            gc.collect()
            torch.cuda.empty_cache()

    def run(self, batches: list, step: int, update: bool = True):
        """Optimizer step number `step` (0-based) on `batches` (with `update` False, its forward
        and backward alone): eager, captured or replayed."""
        if update != self.update:
            self.reset(update)
        elif self.inputs is not None and _shapes(batches) != _shapes(self.inputs):
            print(
                f"note: compute.cuda_graphs={CudaGraphs.step}: the step's batches changed shape "
                f"({_shapes(self.inputs)} → {_shapes(batches)}), so the graph is captured again after "
                f"{WARMUP_STEPS} eager steps.",
                file=sys.stderr,
            )
            self.reset(update)
        if self.outputs is None and self._warm < WARMUP_STEPS:
            return self._warm_up(batches, step)
        keep = True
        if self.judge and len(self.replay_timings) == JUDGED_REPLAYS:
            keep, why = self._judged()
            if not keep:
                self.reset(self.update)  # the graph's memory goes back before the engine drops it
            self.engine.settle_cuda_graphs(keep, why)
        if keep and (self.outputs is not None or (self.failed is None and self._capture(step, batches))):
            return self._replay(batches, step)
        self.eager += 1
        return self._eager(batches, step)

    def _warm_up(self, batches: list, step: int):
        """One of the eager steps before a capture, on the capture's stream (timed while judging)."""
        self._warm += 1
        self.eager += 1
        timed = self.judge and self._warm > 1
        with self.backend.on_capture_stream(), self.backend.timed() if timed else contextlib.nullcontext() as device_s:
            out = self._eager(batches, step)
        if timed:
            self.eager_timings.append(device_s)
        return out

    def _judged(self) -> tuple[bool, str]:
        """compute.cuda_graphs=auto's choice, made once from the timed steps (the fastest of each
        kind): (whether to keep the graph, the times that say so)."""
        self.judge = False
        eager = min(device_s() for device_s in self.eager_timings)
        replay = min(device_s() for device_s in self.replay_timings)
        self.eager_timings, self.replay_timings = [], []
        gain = 1 - replay / max(eager, 1e-12)
        measured = (
            f"a replayed step took the device {1000 * replay:.1f} ms against {1000 * eager:.1f} ms eager "
            f"({gain:+.1%}; the graph stays from {AUTO_MIN_GAIN:+.0%})"
        )
        if gain >= AUTO_MIN_GAIN:
            return True, f"{measured}: the step graph replays the step"
        return False, f"{measured}: its memory goes back and the steps run eagerly, as with compute.cuda_graphs=off"

    def _eager(self, batches: list, step: int):
        lm_loss = self.engine.forward_backward(batches)
        return self.engine.optim_step(lm_loss, step) if self.update else self.engine.drop_step(lm_loss)

    def _replay(self, batches: list, step: int):
        from moetrain.train.engine import StepOutput

        lr = self.engine.set_step_lr(step) if self.update else 0.0
        with self.backend.timed() if self.judge else contextlib.nullcontext() as device_s:
            self._load(batches)
            self.backend.replay()
        if self.judge:
            self.replay_timings.append(device_s)
        self.replays += 1
        lm_loss, grad_norm, routing, mtp = self.outputs
        return StepOutput(
            lm_loss.clone(),
            grad_norm.clone(),
            [{k: v.clone() for k, v in layer.items()} for layer in routing],
            lr,
            mtp.clone() if mtp is not None else None,
        )

    def counts(self) -> dict[str, int]:
        """{"captures", "replays", "eager"} so far."""
        return {"captures": self.captures, "replays": self.replays, "eager": self.eager}

    def _capture(self, step: int, batches: list) -> bool:
        """Capture the step over the input buffers (filled with `batches`); False if it failed."""
        device = self.engine.device
        self.inputs = [tuple(torch.empty(t.shape, dtype=t.dtype, device=device) for t in batch) for batch in batches]
        self._load(batches)  # the emulator runs what it captures; a CUDA capture reads nothing
        if device.type == "cuda":
            # The eager steps' cached blocks go back to the device, so the graph's memory can take
            # their place instead of coming on top of them (as torch.cuda.graph does too).
            torch.cuda.synchronize(device)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        if self.update:
            self.engine.set_step_lr(step)
        tensors = self.engine.step_tensors if self.update else self.engine.pass_tensors
        self._capturing = True
        try:
            self.outputs = self.backend.capture(lambda: tensors(self.inputs))
        except CaptureFailed as error:
            self._give_up(error)
            return False
        finally:
            self._capturing = False
        if device.type == "cuda":
            self.uncounted_bytes = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
            # the capture's own allocations are in uncounted_bytes now; counted again, the peak
            # would hold the step's temporaries twice
            torch.cuda.reset_peak_memory_stats(device)
        self.captures += 1
        return True

    def _give_up(self, error: CaptureFailed) -> None:
        self.failed = error.reason
        self.inputs = self.outputs = None
        self.backend.release()
        self.engine.optimizer.zero_grad()
        self.engine.discard_step_statistics()
        what = "the training step" if self.update else "the forward and backward passes"
        print(
            f"note: compute.cuda_graphs={CudaGraphs.step}: {what} could not be captured as a CUDA graph "
            f"({error.reason}), so every step runs eagerly, as with compute.cuda_graphs=off.",
            file=sys.stderr,
        )

    def _load(self, batches: list) -> None:
        """Copy the step's batches into the input buffers (shapes checked in `run`: a copy would
        broadcast silently)."""
        for buffers, batch in zip(self.inputs, batches, strict=True):
            for buffer, t in zip(buffers, batch, strict=True):
                buffer.copy_(pinned_for(t, buffer.device), non_blocking=True)


def _shapes(batches: list) -> list[list[tuple[int, ...]]]:
    """Each micro-batch's tensors' shapes: what the captured step's input buffers fix."""
    return [[tuple(t.shape) for t in batch] for batch in batches]
