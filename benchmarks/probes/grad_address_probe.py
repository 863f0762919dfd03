"""Whether a step's gradients lie where an earlier step's did: what train.cuda_graphs=optimizer
needs to replay its graph (src/moetrain/train/cuda_graphs.py compares the gradients' addresses,
dtypes and shapes before each replay).

For a preset on one GPU, as `moetrain bench` runs it: 8 training steps; after each forward and
backward, the optimizer's gradients (`ReplicatedAdamW.graph_inputs`) are compared with those of
each of the 3 steps before, and one JSON line per step says how many of them lie elsewhere.

Run on a GPU: `python benchmarks/probes/grad_address_probe.py bench-small32e [overrides]`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cuda_timing import probe_trainer  # noqa: E402

STEPS = 8
BACK = 3


def main() -> None:
    preset, _, trainer = probe_trainer(__doc__, "--optim.grad_dtype=bf16")
    engine = trainer.engine
    history: list[list[tuple]] = []
    for step in range(STEPS):
        lm_loss = engine.forward_backward(trainer.next_batches())
        grads = engine.optimizer.graph_inputs()
        places = [(g.data_ptr(), str(g.dtype), tuple(g.shape)) for g in grads]
        moved = {
            f"vs_{back}_before": sum(a != b for a, b in zip(places, history[-back]))
            for back in range(1, BACK + 1)
            if len(history) >= back
        }
        print(json.dumps(dict(preset=preset, step=step, gradients=len(grads), moved=moved)), flush=True)
        history.append(places)
        engine.optim_step(lm_loss, step)


if __name__ == "__main__":
    main()
