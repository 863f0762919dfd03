"""Which part of the captured training step makes train.cuda_graphs=step's replays fault.

tiny on the GPU (two micro-batches, bf16 weights with split masters, clipping that bites),
train.cuda_graphs=off with `StepGraph` attached, 8 steps (3 eager, the capture, replays), each
synchronized so a fault names its step. Each variant runs in a process of its own (a fault
ends the CUDA context) and prints one JSON line: the variant, the steps that finished, their
losses, the graph's counts and the error, if any.

Variants (`--variants`, comma-separated; all by default):
- eager: no graph, the learning rate on the device as a graph's update reads it, the reference:
  each other variant's record says whether its losses are this one's (`matches_eager`), bit for
  bit;
- full: the step as train.cuda_graphs=step captures it;
- pool_tables: the optimizer kernels' address tables made inside the capture allocated from the
  graph's own pool (whose blocks the captured step reuses) instead of the arena allocated before
  it, the way they were when the replays faulted on an H100;
- no_update: forward, backward, zeroed gradients and statistics only (no clipping, no AdamW);
- torch_norm: the clipping norm by torch operations instead of the Triton `sum_squares`;
- no_split_adamw: the split masters' Triton AdamW left out of the update;
- host_tables: the optimizer kernels' address tables copied inside the capture from pinned
  host buffers the graph keeps (each replay copies them again) instead of filled after it.

`--sanitize` runs each variant under compute-sanitizer's memcheck (slow), which names the
kernel that faults. Usage: python benchmarks/probes/step_graph_probe.py [--variants full,no_update]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = ("eager", "full", "pool_tables", "no_update", "torch_norm", "no_split_adamw", "host_tables")


def _patch(variant: str) -> None:
    """Change the captured step as `variant` says (module docstring)."""
    import torch

    import moetrain.optim.clip as clip
    import moetrain.optim.triton_kernels as tk
    from moetrain.optim import adamw
    from moetrain.train.engine import TrainEngine

    if variant == "no_update":

        def step_tensors(self, batches):
            lm_loss = self.forward_backward(batches)
            self.optimizer.zero_grad()
            return lm_loss, torch.zeros((), device=self.device), self._end_routing_step(), self._end_mtp_step()

        TrainEngine.step_tensors = step_tensors
    elif variant == "torch_norm":
        clip_sum_sq = clip._sum_sq

        def sum_sq(grads, device):
            if grads and all(g.is_cuda for g in grads):
                return torch.stack([g.float().square().sum() for g in grads]).sum()
            return clip_sum_sq(grads, device)

        clip._sum_sq = sum_sq
    elif variant == "pool_tables":

        def take(self, values):
            table = torch.empty(values.shape, dtype=values.dtype, device="cuda")
            self.pending.append((table, values))
            self.kept.append(table)
            return table

        tk.GraphTables.take = take
    elif variant == "no_split_adamw":
        update = adamw.adamw_update  # the split masters' groups are those with remainders
        adamw.adamw_update = lambda groups, *args, **kw: update([g for g in groups if g.los is None], *args, **kw)
    elif variant == "host_tables":

        def upload(t, device):
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                host = t.pin_memory()
                tk._graph_tables.kept.append(host)  # the graph's copy reads it at every replay
                return host.to(device, non_blocking=True)
            return tk._upload_eager(t, device)

        tk._upload_eager = tk._upload
        tk._upload = upload


def run_variant(variant: str) -> dict:
    """One variant in this process: the record of its steps."""
    import torch

    from moetrain.parallel.dims import ParallelDims, ParallelState
    from moetrain.presets import resolve_config

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # tests/support
    from support.steps import synthetic_batches

    from moetrain.train.cuda_graphs import CudaGraph, StepGraph
    from moetrain.train.engine import TrainEngine

    _patch(variant)
    overrides = [
        "data.synthetic=true",
        f"train.run_dir={tempfile.mkdtemp()}",
        "train.device=cuda",
        "train.micro_batch_size=12",
        "optim.grad_clip=0.05",
        "schedule.warmup_steps=4",
        "model.moe.bias_update_rate=0.01",
    ]
    cfg = resolve_config("tiny", overrides)
    torch.manual_seed(0)
    device = torch.device("cuda")
    engine = TrainEngine(cfg, ParallelState(ParallelDims(world_size=1, dp=1, ep=1)), device)
    if variant == "eager":
        engine.optimizer.put_lr_on_device()  # the graph's update numerics (capturable AdamW)
    else:
        engine.step_graph = StepGraph(engine, CudaGraph(device, "the training step"))
    record = {"variant": variant, "losses": [], "error": None}
    try:
        for n in range(8):
            torch.manual_seed(n)
            out = engine.train_step(synthetic_batches(cfg, n), n)
            torch.cuda.synchronize()
            record["losses"].append(round(float(out.lm_loss), 5))
    except Exception as error:  # the fault is the finding
        record["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
    record["steps_done"] = len(record["losses"])
    record["counts"] = engine.cuda_graph_counts()
    record["failed_capture"] = engine.step_graph.failed if engine.step_graph is not None else None
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--sanitize", action="store_true", help="under compute-sanitizer --tool memcheck")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: run this variant
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_variant(args.one)), flush=True)
        return
    sanitizer = shutil.which("compute-sanitizer") if args.sanitize else None
    if args.sanitize and sanitizer is None:
        sys.exit("--sanitize: compute-sanitizer is not on PATH")
    variants = args.variants.split(",")
    for variant in variants:
        if variant not in VARIANTS:
            sys.exit(f"--variants: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    reference = None
    for variant in sorted(variants, key=lambda v: v != "eager"):  # the reference first
        command = [sys.executable, __file__, "--one", variant]
        if sanitizer:
            command = [sanitizer, "--tool", "memcheck", "--print-limit", "3", *command]
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ, timeout=900)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        record = json.loads(lines[-1]) if lines else {"variant": variant, "error": f"exit {done.returncode}"}
        if sanitizer or not lines:
            record["report"] = [line for line in (done.stdout + done.stderr).splitlines() if "=====" in line][:30]
            if not lines:
                record["stderr_tail"] = done.stderr[-2000:]
        if variant == "eager":
            reference = record.get("losses")
        elif reference is not None:
            record["matches_eager"] = record.get("losses") == reference
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
