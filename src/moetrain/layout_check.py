"""`moetrain check-layout`: the first steps of a parallel layout against one process training the
same run, compared step by step: what to run on one's own cluster before the expensive job
(docs/reliability.md, "check-layout": what it guarantees and how the tolerances were set).

Both runs train the same config (seed, global batch, hence the same batches) for `steps` steps,
with evaluation, checkpoints, plots and CUDA graphs off. The layout runs on every rank of the
launch (torchrun, srun or mpirun). Then the reference (`reference_kind`; `--reference`):
- `one`: rank 0 starts a child process training the same config with every `parallel.*` key at
  its default, alone on rank 0's device;
- `fsdp`, for a model one device cannot hold: every rank of the launch trains it with the FSDP
  stack and nothing else, the simplest layout that holds it.
`auto` (the default) takes `one` where the planner's modelled peak of one process fits the
device (the machine's memory on CPUs), else `fsdp`.

Per step it compares (`compare`) the LM loss, the optimizer's global gradient norm, the norm of
each parameter group's reduced gradient before clipping (`GROUPS`, `Optimizer.grad_parts`), and
the fraction of expert assignments dropped. Each quantity's largest relative difference over the
steps is held against a tolerance set by the precision (`TOLERANCES`, `precision_of`); past it the
check fails, naming the quantity and the first step past it.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moetrain.errors import ConfigError, MoetrainError
from moetrain.model.config import Routing
from moetrain.optim.config import StateDtype
from moetrain.parallel.config import ParallelConfig, Stack
from moetrain.parallel.distributed import from_rank_0, refuse_unless_alike, shutdown
from moetrain.train.config import CudaGraphs, Fp8, RunConfig
from moetrain.train.metrics import read_metrics

GROUPS = (
    "embeddings",
    "attention",
    "norms",
    "dense_mlp",
    "router",
    "routed_experts",
    "shared_experts",
    "head",
    "mtp",
)
"""The parameter groups whose gradient norms are compared (`group_of`)."""


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """(the loss's, the gradient norms') largest relative differences allowed: at the first step,
    whose gradients both runs compute from the same parameters (a difference is the layout's
    arithmetic alone), and at the later ones, whose parameters carry the earlier steps' rounding,
    which Adam's division by √v amplifies where v is small."""

    first: tuple[float, float]
    later: tuple[float, float]


TOLERANCES = {
    "fp32": Tolerance(first=(1e-6, 1e-4), later=(1e-4, 1e-1)),
    "bf16": Tolerance(first=(1e-3, 1e-2), later=(1e-2, 1e-1)),
    "fp8": Tolerance(first=(2e-3, 2e-2), later=(2e-2, 2e-1)),
}
"""Compute precision → the largest relative differences allowed (how they were set, and what was
measured: docs/reliability.md, "check-layout")."""


def group_of(name: str) -> str:
    """The group (`GROUPS`) of a canonical parameter name."""
    for prefix, group in (("mtp.", "mtp"), ("embed.", "embeddings"), ("lm_head.", "head")):
        if name.startswith(prefix):
            return group
    for part, group in (
        (".router.", "router"),
        (".experts.", "routed_experts"),
        (".shared_expert.", "shared_experts"),
        (".attn.", "attention"),
        (".ffn.", "dense_mlp"),
    ):
        if part in name:
            return group
    return "norms"


def for_check(cfg: RunConfig, steps: int, run_dir: str) -> RunConfig:
    """`cfg` as a check runs it: `steps` steps logged every step into `run_dir`, nothing else
    written or evaluated, no CUDA graph (the gradients are read between reduction and clipping)."""
    new = dataclasses.replace
    return new(
        cfg,
        train=new(cfg.train, steps=steps, log_every=1, eval_every=0, run_dir=run_dir),
        checkpoint=new(cfg.checkpoint, save_every=0, save_final=False),
        logging=new(cfg.logging, plot=False, tensorboard=False, wandb=False, profile=False),
        compute=new(cfg.compute, cuda_graphs=CudaGraphs.off),
    )


def run_steps(cfg: RunConfig) -> list[dict[str, Any]] | None:
    """Train `cfg` (made by `for_check`) on this launch's ranks; rank 0 gets `step_records`, the
    others None."""
    from moetrain.train.trainer import Trainer

    trainer = Trainer(cfg, quiet=True)
    norms = group_norm_probe(trainer)
    try:
        trainer.fit()
    finally:
        trainer.run.release()
    return step_records(trainer, norms)


def group_norm_probe(trainer) -> list[list[float]]:
    """Make `trainer` read each step's reduced gradients before clipping: the list it returns
    gets, per step, each group's gradient norm (`GROUPS` order), every element counted once over
    the ranks (one all-reduce and one host read a step)."""
    norms: list[list[float]] = []

    def probe(optimizer) -> None:
        sq = torch.zeros(len(GROUPS), dtype=torch.float64, device=trainer.device)
        for name, part, counts in optimizer.grad_parts():
            if counts:
                sq[GROUPS.index(group_of(name))] += part.float().square().sum().double()
        if trainer.par.dims.world_size > 1:
            dist.all_reduce(sq)
        norms.append(sq.sqrt().tolist())

    trainer.engine.grad_probe = probe
    return norms


def step_records(trainer, norms: list[list[float]]) -> list[dict[str, Any]] | None:
    """On rank 0, per step of the finished run: the LM loss, the gradient norm and the drops
    (from its metrics.jsonl) and each group's gradient norm (`group_norm_probe`'s); None elsewhere."""
    if not trainer.par.is_main:
        return None
    records = read_metrics(Path(trainer.cfg.train.run_dir) / "metrics.jsonl")
    keys = ("step", "lm_loss", "grad_norm", "dropped_token_frac")
    return [{**{k: r[k] for k in keys}, "groups": dict(zip(GROUPS, norm))} for r, norm in zip(records, norms)]


def run_reference(cfg: RunConfig, workdir: Path) -> list[dict[str, Any]]:
    """The same run (every `parallel.*` key at its default) in a child process of one rank, its
    config written to `workdir`, on this process's device: its `run_steps` records."""
    train = dataclasses.replace(cfg.train, run_dir=str(workdir / "reference"))
    config, out = workdir / "reference.yaml", workdir / "reference.json"
    config.write_text(dataclasses.replace(cfg, parallel=ParallelConfig(), train=train).to_yaml())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_"))}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if torch.cuda.is_available() and cfg.train.device != "cpu":  # this process's device, in its own list if set
        index, visible = torch.cuda.current_device(), os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
    command = [sys.executable, "-m", "moetrain", "check-layout", str(config), "--reference-out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-12:])
        raise MoetrainError(
            f"check-layout: the one-process reference run failed (exit {done.returncode}), so there is nothing to "
            f"compare the layout with. Its last lines:\n{tail}\nIf the model does not fit one device, check a "
            "shallower copy of it (e.g. --model.n_layers=2)."
        )
    return json.loads(out.read_text())


def compare(layout: list[dict], reference: list[dict], tol: Tolerance) -> dict[str, Any]:
    """Per quantity (lm_loss, grad_norm, each group present) the largest relative difference at
    the first step and at the later ones, and the first step past its tolerance; `ok` when none
    is past it."""
    if [r["step"] for r in layout] != [r["step"] for r in reference]:
        raise MoetrainError(
            f"check-layout: the layout logged steps {[r['step'] for r in layout]}, the reference "
            f"{[r['step'] for r in reference]}: a run stopped early (its messages are above)."
        )
    present = [g for g in GROUPS if any(r["groups"][g] or s["groups"][g] for r, s in zip(layout, reference))]
    report: dict[str, Any] = {}
    for name in ("lm_loss", "grad_norm", *present):
        kind = 0 if name == "lm_loss" else 1
        got = [r[name] if name in r else r["groups"][name] for r in layout]
        want = [s[name] if name in s else s["groups"][name] for s in reference]
        rel = [abs(a - b) / max(abs(b), 1e-30) if a != b else 0.0 for a, b in zip(got, want)]
        rtol = [tol.first[kind]] + [tol.later[kind]] * (len(rel) - 1)
        past = [layout[i]["step"] for i, (d, t) in enumerate(zip(rel, rtol)) if not d <= t]  # NaN is past
        report[name] = {
            "first_step_rel_diff": _finite(rel[:1]),
            "later_max_rel_diff": _finite(rel[1:]),
            "rtol": [tol.first[kind], tol.later[kind]],
            "first_step_past": past[0] if past else None,
        }
    failed = [name for name, q in report.items() if q["first_step_past"] is not None]
    dropped = max(r["dropped_token_frac"] or 0.0 for r in layout)
    return {"ok": not failed, "failed": failed, "quantities": report, "max_dropped_token_frac": dropped}


def _finite(values: list[float]) -> float | None:
    """The largest of `values` (NaN if one is NaN; None if there are none)."""
    return None if not values else math.nan if any(v != v for v in values) else max(values)


def precision_of(cfg: RunConfig, device: torch.device) -> str:
    """fp32, bf16 or fp8: the precision the tolerances are chosen by, the compute's, or bf16's
    where optim.grad_dtype=bf16 rounds the gradients that a layout sums in another order."""
    if cfg.precision.fp8 != Fp8.none:
        return "fp8"
    from moetrain.train.engine import autocast_dtype

    bf16 = autocast_dtype(cfg.precision.dtype, device) == torch.bfloat16 or cfg.optim.grad_dtype == StateDtype.bf16
    return "bf16" if bf16 else "fp32"


def reference_kind(cfg: RunConfig, device: torch.device, world: int, choice: str = "auto") -> tuple[str, str]:
    """("one" or "fsdp", why): the reference `choice` asks for, or for "auto" one process where the
    planner's modelled peak of one process fits `device` (module docstring), else the FSDP stack
    over the launch's `world` ranks."""
    if choice != "auto":
        return choice, "as --reference asked"
    from moetrain.plan import GIB, Assumptions, ParamGroups, layout_of, memory_per_rank
    from moetrain.plan.hardware import device_memory

    one = dataclasses.replace(cfg, parallel=ParallelConfig())
    memory = device_memory(device)[0]
    peak = memory_per_rank(one, layout_of(one, 1), ParamGroups.of(cfg.model), Assumptions())[0].peak
    if peak <= memory or world == 1:
        return "one", f"one process's modelled peak {peak / GIB:.1f} GiB fits the {memory / GIB:.1f} GiB of one device"
    return "fsdp", (
        f"one process would need a modelled {peak / GIB:.1f} GiB of the {memory / GIB:.1f} GiB of one device: the FSDP "
        f"stack over the launch's {world} ranks holds it"
    )


def check_layout(
    cfg: RunConfig, steps: int, rtol: tuple[float, float] | None = None, reference: str = "auto"
) -> dict[str, Any] | None:
    """The check (module docstring) on this launch's ranks, against the `reference` (auto, one or
    fsdp: `reference_kind`): rank 0 returns the result (`compare`'s, with the per-step records,
    the reference, the tolerances' precision and each run's seconds), the others None."""
    from moetrain.train.runtime import setup_runtime

    runtime = setup_runtime(cfg)  # joins the launch's process group (the trainer then finds it)
    refuse_unless_alike({"--steps": steps, "--rtol": rtol, "--reference": reference})
    main, world = runtime.par.rank == 0, runtime.par.dims.world_size
    if world > 1 and cfg.model.moe.routing == Routing.random:
        raise ConfigError(
            f"check-layout: model.moe.routing=random draws each token's experts from the random generator of "
            f"the rank that holds it, so on {world} ranks the layout and its reference send the tokens to other "
            "experts and their gradients cannot compare: check the layout with model.moe.routing=learned (the "
            "same graph and FLOPs)."
        )
    kind, why = reference_kind(cfg, runtime.device, world, reference)
    if kind == "fsdp":  # the FSDP stack over every rank and no other parallelism, the collective timeouts kept
        p = cfg.parallel
        cfg_ref = dataclasses.replace(
            cfg, parallel=ParallelConfig(stack=Stack.fsdp, timeout_s=p.timeout_s, peer_timeout_s=p.peer_timeout_s)
        )
        try:
            cfg_ref.validate(world, runtime.device)
        except ConfigError as e:
            raise ConfigError(f"check-layout: the FSDP reference ({why}) cannot run here: {e}") from None
    workdir = Path(tempfile.mkdtemp(prefix="moetrain-check-layout-")) if main else None
    layout_dir = from_rank_0(str(workdir / "layout") if main else None)
    start = time.perf_counter()
    layout = run_steps(for_check(cfg, steps, layout_dir))
    layout_s = time.perf_counter() - start
    if runtime.device.type == "cuda":  # the layout's model is gone: its memory to the reference
        gc.collect()
        torch.cuda.empty_cache()
    start = time.perf_counter()
    if kind == "fsdp":
        ref_records = run_steps(for_check(cfg_ref, steps, from_rank_0(str(workdir / "reference") if main else None)))
    if not main:
        shutdown()
        return None
    if kind == "one":
        ref_records = run_reference(for_check(cfg, steps, ""), workdir)
    precision = precision_of(cfg, runtime.device)
    tol = Tolerance(rtol, rtol) if rtol is not None else TOLERANCES[precision]
    result = compare(layout, ref_records, tol)
    result.update(
        precision=precision,
        world_size=world,
        reference="one process" if kind == "one" else f"fsdp over {world} ranks",
        reference_why=why,
        layout_seconds=round(layout_s, 1),
        reference_seconds=round(time.perf_counter() - start, 1),
        steps=[{"step": a["step"], "layout": a, "reference": b} for a, b in zip(layout, ref_records)],
    )
    shutdown()
    return result


def describe(result: dict[str, Any]) -> str:
    """The check's result as lines for a person: each quantity's largest differences, the verdict."""
    q, steps, ref, precision = result["quantities"], len(result["steps"]), result["reference"], result["precision"]
    lines = [
        f"reference: {ref} ({result['reference_why']})",
        f"{'quantity':<16}{'step 1':>10}{'later':>10}  {'tolerances':<15}first step past",
        *(
            f"{name:<16}{_e(v['first_step_rel_diff']):>10}{_e(v['later_max_rel_diff']):>10}  "
            f"{v['rtol'][0]:.0e} {v['rtol'][1]:.0e}{'':<5}{v['first_step_past'] or '-'}"
            for name, v in q.items()
        ),
    ]
    seconds = result["layout_seconds"], result["world_size"], ref, result["reference_seconds"]
    cost = "layout {} s on {} ranks, {} {} s".format(*seconds)
    if result["ok"]:
        verdict = f"OK: {steps} steps of the layout equal the reference's within the {precision} tolerances ({cost})."
    else:
        failed = ", ".join(result["failed"])
        verdict = f"FAILED: {failed} differ from the reference's beyond the {precision} tolerance ({cost})."
    lines.append(verdict)
    if result["max_dropped_token_frac"] > 0:
        lines.append(
            f"The layout dropped up to {result['max_dropped_token_frac']:.2%} of expert assignments (the reference "
            "drops none): drops change the loss and every gradient. To check the machinery alone, add "
            "--parallel.capacity_factor=null (dropless)."
        )
    return "\n".join(lines)


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def plain(value: Any) -> Any:
    """`value` with every non-finite float as its name ("nan", "inf"): what strict JSON can hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value
