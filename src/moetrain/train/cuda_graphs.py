"""train.cuda_graphs=optimizer: the optimizer's part of a training step replayed from one CUDA graph.

`TrainEngine.update` launches a few hundred small kernels a step (the clipping norm, the step
guard, torch's fused AdamW, the split masters' Triton update, the router bias). Launched from
Python they can leave the GPU idle between kernels where the update is short; a CUDA graph
launches them all at once. A graph replays the kernels it captured with the arguments they had
then: tensors at their addresses, numbers at their values. So what the update reads must either
live at one address for the whole run, or be checked before each replay:

- the parameters, AdamW's moments and step counts, the split masters' buffers, the step guard's
  history and the router biases are allocated once and written in place (the guard and the
  optimizers are written so; tests/train/test_cuda_graphs.py checks it on the CPU through
  `moetrain.testing.graph_emulator`);
- the learning rate is a 0-d device tensor the optimizer reads (`put_lr_on_device`), filled before
  each step; the LM loss is copied into a tensor of the graph's;
- the gradients are allocated anew by each step's backward, so each step compares their
  addresses, dtypes and shapes (`places`, no device work) with the captured ones: equal, the
  graph replays; not, the step runs eagerly, and once two steps in a row put the gradients in one
  place the graph is captured again, on the second of them, after its eager update (capturing
  runs nothing, and the tables the optimizer's kernels read were built by that update). A capture
  that served fewer than `PAYING_REPLAYS` replays did not pay, and after `MAX_UNPAID` such
  captures the steps stay eager. Measured on one H200 (docs/benchmarks.md, "CUDA graphs"), the
  caching allocator puts every gradient at a new address in every training step, so in training
  the graph is never captured, and a run says so after `NOTE_AFTER` steps; over gradients that
  stay put (`moetrain bench --also-optimizer-step`) it replays, no faster than the eager update.

The norm the graph computed is copied out after each replay, so a step's `StepOutput` keeps its
own. No host sync is added: a replay is one launch; a capture is once or a few times a run.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from moetrain.errors import MoetrainError
from moetrain.train.config import CudaGraphs

if TYPE_CHECKING:
    from moetrain.train.engine import TrainEngine

NOTE_AFTER = 10
"""Eager steps with no replay after which the run says so, once."""
PAYING_REPLAYS = 8
"""Replays a capture must serve to count as paid for."""
MAX_UNPAID = 3
"""Captures that did not pay before the updates stay eager for the run (the gradients never
settle)."""


class CaptureFailed(MoetrainError):
    """The update could not be captured as a CUDA graph."""


class GraphBackend(Protocol):
    """What `UpdateGraph` needs of a graph: `CudaGraph` on the GPU, `EmulatedGraph`
    (src/moetrain/testing/graph_emulator.py) in tests on the CPU."""

    def places(self, tensors: list[torch.Tensor]) -> tuple:
        """What must be equal between capture and replay for `tensors` (the step's gradients)."""
        ...

    def capture(self, fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
        """Record `fn` (its device work is not run) and return its result, which each replay
        rewrites; `inputs` are the tensors `places` was taken of."""
        ...

    def replay(self, inputs: list[torch.Tensor]) -> None:
        """Run the recorded work again (`inputs` at the places of the capture)."""
        ...


class CudaGraph:
    """`GraphBackend` over `torch.cuda.CUDAGraph`: captured on a side stream into one private
    memory pool (a new capture first frees the last), replayed on the current stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool = torch.cuda.graph_pool_handle()
        self.tables: list[torch.Tensor] = []
        """The optimizer kernels' device tables the graph reads (src/moetrain/optim/triton_kernels.py)."""

    def places(self, tensors: list[torch.Tensor]) -> tuple:
        return tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors)

    def capture(self, fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
        from moetrain.optim.triton_kernels import tables_for_graph

        if self.graph is not None:
            self.graph.reset()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Not `torch.cuda.graph`: it synchronizes and empties the allocator's cache, after which the
        # next step's gradients would land elsewhere.
        with torch.cuda.stream(stream), tables_for_graph() as tables:
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except Exception as error:
                try:
                    graph.capture_end()
                except RuntimeError:
                    pass  # the capture was invalidated by the error itself
                raise CaptureFailed(
                    f"the optimizer step could not be captured as a CUDA graph ({type(error).__name__}: {error}); "
                    "set train.cuda_graphs=off"
                ) from error
            graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph, self.tables = graph, tables
        return out

    def replay(self, inputs: list[torch.Tensor]) -> None:
        self.graph.replay()


class UpdateGraph:
    """`TrainEngine.update`'s device work (`TrainEngine.update_tensors`) replayed from a graph
    while the step's gradients lie where they lay at capture (module docstring)."""

    def __init__(self, engine: TrainEngine, backend: GraphBackend):
        self.engine, self.backend = engine, backend
        engine.optimizer.put_lr_on_device()
        self.loss: torch.Tensor | None = None
        """The graph's copy of the step's LM loss."""
        self.norm: torch.Tensor | None = None
        """The gradient norm each replay writes."""
        self.captured: tuple | None = None
        self._last: tuple | None = None
        self.captures = self.replays = self.eager = 0
        """Captures made, steps replayed, steps run eagerly."""
        self.unpaid = 0
        """Captures that served fewer than `PAYING_REPLAYS` replays (the current one not yet counted)."""
        self._served = 0

    def run(self, lm_loss: torch.Tensor) -> torch.Tensor:
        """The update of this step (the optimizer's learning rate set); the gradient norm."""
        inputs = self.engine.optimizer.graph_inputs()
        places = self.backend.places(inputs)
        if places == self.captured:
            self.loss.copy_(lm_loss)
            self.backend.replay(inputs)
            self.replays += 1
            self._served += 1
            return self.norm.clone()
        grad_norm = self.engine.update_tensors(lm_loss)
        self.eager += 1
        if self.eager == NOTE_AFTER and self.replays == 0:
            print(
                f"note: train.cuda_graphs={CudaGraphs.optimizer}: in each of the first {NOTE_AFTER} steps the "
                "gradients lay at new addresses, so every update ran eagerly (as with train.cuda_graphs=off); "
                'see docs/benchmarks.md, "CUDA graphs".',
                file=sys.stderr,
            )
        if places == self._last and self.unpaid + self._unpaid_now() < MAX_UNPAID:
            self.unpaid += self._unpaid_now()
            if self.loss is None:
                self.loss = torch.zeros_like(lm_loss)
            self.norm = self.backend.capture(lambda: self.engine.update_tensors(self.loss), inputs)
            self.captured, self._served = places, 0
            self.captures += 1
        self._last = places
        return grad_norm

    def _unpaid_now(self) -> int:
        """1 if the current graph exists and has served fewer than `PAYING_REPLAYS` replays."""
        return int(self.captured is not None and self._served < PAYING_REPLAYS)

    def counts(self) -> dict[str, int]:
        """{"captures", "replays", "eager"} so far."""
        return {"captures": self.captures, "replays": self.replays, "eager": self.eager}
