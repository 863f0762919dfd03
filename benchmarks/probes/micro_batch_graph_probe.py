"""What a CUDA graph of one micro-batch's forward and backward gives back of the step's idle time
(`train.cuda_graphs=step` captures the whole step instead: src/moetrain/train/cuda_graphs.py).

For a preset on one GPU, its blocks compiled as `moetrain bench` runs them, on one micro-batch:
- eager_ms: forward, loss and backward as the training loop runs them (`TrainEngine._micro_batches`'
  body; CUDA events around 10 back-to-back calls, no host wait between them, so launches queue
  ahead of the GPU as in training); the split masters' gradient hooks run as they do there;
- busy_ms: the sum of those calls' kernel times (torch.profiler, 3 calls): eager_ms − busy_ms is
  the idle time a graph could give back;
- graph_ms: the same micro-batch through `torch.cuda.make_graphed_callables` (forward and backward
  each one graph; the gradient hooks still run eagerly after the backward graph, on its static
  gradient outputs);
- parity: the loss and gradient norm of one micro-batch, eager and graphed, on the same batch;
- peak GiB of each.

It does not say whether a graphed training step is correct over several micro-batches: the
backward graph writes every gradient into the same static buffers each replay, so the split
masters, which keep the first micro-batch's gradient as it is, would see it overwritten; the step
graph has no such outputs (its gradients live in its own memory).

Run on a GPU: `python benchmarks/probes/micro_batch_graph_probe.py bench-small32e [overrides]`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import busy_ms, probe_trainer, window_ms  # noqa: E402


class MicroBatchLoss(nn.Module):
    """`TrainEngine.lm_loss` times the backward scale, as a module over the engine's model (what
    `make_graphed_callables` takes: its parameters are the model's). Autocast, where the engine
    uses it, runs without its weight cache, which graphs cannot hold."""

    def __init__(self, engine):
        super().__init__()
        self.model = engine.model
        self._engine = engine

    def forward(self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        e = self._engine
        doc_ids_BT = e._document_ids(inputs_BT)
        with torch.autocast(
            "cuda", dtype=e.amp_dtype or torch.bfloat16, enabled=e.amp_dtype is not None, cache_enabled=False
        ):
            loss = self.model(e._shard(inputs_BT), doc_ids_BT, e._shard(targets_BT), e.loss_chunk_tokens)
        return loss * e.model.runtime.backward_scale


def _one(engine, loss_fn, inputs_BT, targets_BT) -> tuple[float, float]:
    """(the loss, the gradient norm) of one micro-batch from zeroed gradients."""
    engine.optimizer.zero_grad()
    engine.optimizer.reduction.prepare(sync=True)
    loss = loss_fn(inputs_BT, targets_BT)
    loss.backward()
    engine.optimizer.reduction.finish()
    norm = engine.optimizer.clip_grad_norm(math.inf)
    engine.optimizer.zero_grad()
    return float(loss.detach()) / engine.model.runtime.backward_scale, float(norm)


def _timings(engine, loss_fn, inputs_BT, targets_BT) -> dict[str, float]:
    def micro_batch():
        engine.optimizer.reduction.prepare(sync=True)
        loss_fn(inputs_BT, targets_BT).backward()

    for _ in range(3):
        micro_batch()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = {"ms": window_ms(micro_batch), "busy_ms": busy_ms(micro_batch)}
    out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    engine.optimizer.reduction.finish()
    engine.optimizer.zero_grad()
    return {k: round(v, 3) for k, v in out.items()}


def main() -> None:
    preset, overrides, trainer = probe_trainer(__doc__, "--train.fp8=rowwise")
    engine = trainer.engine
    engine.model.train()
    inputs_BT, targets_BT = (t.to("cuda") for t in trainer.next_batches()[0])
    eager = MicroBatchLoss(engine)
    row: dict = {"preset": preset, "overrides": overrides}
    row["eager"] = _timings(engine, eager, inputs_BT, targets_BT)
    row["eager_loss"], row["eager_grad_norm"] = _one(engine, eager, inputs_BT, targets_BT)
    try:
        graphed = torch.cuda.make_graphed_callables(eager, (inputs_BT, targets_BT), num_warmup_iters=3)
        row["graph_loss"], row["graph_grad_norm"] = _one(engine, graphed, inputs_BT, targets_BT)
        row["graph"] = _timings(engine, graphed, inputs_BT, targets_BT)
    except Exception as exc:  # the probe's job is to say what does not capture, and where
        row["graph_error"] = repr(exc)[:600]
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
