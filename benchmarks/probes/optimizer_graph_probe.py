"""What a CUDA graph could save on the optimizer's part of a step (`TrainEngine.update`: clipping,
the step guard, the update, the router bias), and what it would cost to feed it.

For a preset on one GPU (blocks eager: the update does not depend on them), after one forward and
backward for gradients:
- eager_ms: `update` as the training loop runs it (CUDA events around 10 back-to-back calls, no
  host wait between them: launches may queue ahead of the GPU, as in training);
- busy_ms: the sum of its kernels' device times (torch.profiler, 3 calls);
- graph_ms: the same update captured once in a CUDA graph and replayed, as train.cuda_graphs=optimizer
  does (src/moetrain/train/cuda_graphs.py's `CudaGraph`, the learning rate a device tensor in both;
  the gradients stay where they were, so every call replays);
- grad_copy_ms: one copy of every gradient into a static buffer — what a graph that cannot rely
  on the gradients' addresses would add per step.

Run on a GPU: `python benchmarks/probes/optimizer_graph_probe.py bench-small32e`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import busy_ms, probe_trainer, timed, window_ms  # noqa: E402

from moetrain.train.cuda_graphs import CudaGraph  # noqa: E402


def main() -> None:
    preset, _, trainer = probe_trainer(__doc__, "--optim.grad_dtype=bf16", ["train.compile=false"])
    cfg = trainer.cfg
    engine = trainer.engine
    lm_loss = engine.forward_backward(trainer.next_batches())
    engine.optimizer.put_lr_on_device()
    engine.optimizer.set_lr(cfg.optim.lr)

    def update():
        engine.update_tensors(lm_loss)

    for _ in range(3):
        update()
    torch.cuda.synchronize()
    eager_ms = window_ms(update)
    busy = busy_ms(update)
    inputs = engine.optimizer.graph_inputs()
    graph = CudaGraph(torch.device("cuda"))
    graph.capture(update, inputs)
    graph_ms = window_ms(lambda: graph.replay(inputs))
    grads = [p.grad for p in engine.model.parameters() if p.grad is not None]
    split = engine.optimizer.split if getattr(engine.optimizer, "split", None) is not None else None
    grads += [g for g in (split.grads if split is not None else []) if g is not None]
    static = [torch.empty_like(g) for g in grads]
    grad_copy_ms = timed(lambda: torch._foreach_copy_(static, grads))
    n_grad = sum(g.numel() for g in grads)
    print(json.dumps(dict(preset=preset, optim=str(cfg.optim.name), eager_ms=round(eager_ms, 3),
                          busy_ms=round(busy, 3), graph_ms=round(graph_ms, 3), grad_copy_ms=round(grad_copy_ms, 3),
                          grad_tensors=len(grads), grad_elements=n_grad)), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
