"""`moetrain bench`: how fast a preset trains, how much memory it takes, and whether its step
waits on the host — one JSON line per configuration (routing mode) and timed window.

Per configuration: warm-up steps (compilation, allocator growth, a step graph's capture), then
`steps` timed steps between two device synchronizations, then one more step under CUDA's sync
debug mode ("warn"), which counts every device-to-host synchronization it makes. The steps are
the trainer's own `train_step` on random token ids (`data.synthetic=true`); the windows besides
it (`--forward-backward-only`, `--also-forward-backward`, `--also-optimizer-step`) time parts of
it, the line's `timed` saying which. The routing mode is switched in place between
configurations (`TrainEngine.set_routing`: the model, its optimizer state and compiled code are
kept). Everything here goes through the trainer's and the engine's public methods.

FLOPs and MFU follow Olmo-core's formula (src/moetrain/model/counting.py), over the device's dense
BF16 peak.
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from moetrain import rehearse as rehearse_mod
from moetrain.errors import ConfigError
from moetrain.model.config import Routing
from moetrain.model.counting import count_params
from moetrain.optim.rule import local_tensor
from moetrain.parallel.distributed import refuse_unless_alike
from moetrain.parallel.rehearsal import LEDGER, is_rehearsal
from moetrain.plan import device_capacity_floor
from moetrain.presets import resolve_config
from moetrain.train.console import rehearsal_notice
from moetrain.train.cuda_graphs import JUDGED_REPLAYS
from moetrain.train.cuda_graphs import WARMUP_STEPS as STEP_GRAPH_WARMUP
from moetrain.train.engine import StepOutput
from moetrain.train.metrics import peak_mem_gib
from moetrain.train.trainer import Trainer
from moetrain.version import code_version

BENCH_OVERRIDES = [
    "data.synthetic=true",
    "train.eval_every=0",
    "checkpoint.save_every=0",
    "checkpoint.save_final=false",
    "logging.plot=false",
    "logging.tensorboard=false",
]


def run_bench(
    spec: str,
    overrides: list[str],
    *,
    warmup: int = 5,
    steps: int = 15,
    routings: list[str] | None = None,
    sync_check: bool = True,
    run_dir: str | None = None,
    progress: bool = True,
    forward_backward_only: bool = False,
    also_forward_backward: bool = False,
    also_optimizer_step: bool = False,
    rehearse: int | None = None,
    rank: int | None = None,
    checkpoint: bool = True,
) -> list[dict[str, Any]]:
    """`rehearse`: run rank `rank` (default: the one the planner says needs most memory) of a
    `rehearse`-rank layout alone (src/moetrain/rehearse.py); each line then has a `rehearsal` entry,
    and with `checkpoint` this rank's checkpoint shard is saved and loaded back once at the end."""
    routings = routings or [Routing.learned.value, Routing.random.value]
    known = [r.value for r in Routing]
    for r in routings:  # refused before any work
        if r not in known:
            raise ConfigError(f"--routing: unknown routing mode '{r}'; choose from {', '.join(known)}.")
    run_dir = run_dir or tempfile.mkdtemp(prefix="moetrain-bench-")
    cfg = resolve_config(
        spec, overrides + BENCH_OVERRIDES + [f"train.run_dir={run_dir}", f"model.moe.routing={routings[0]}"]
    )
    rehearsal = None if rehearse is None else rehearse_mod.resolve(cfg, rehearse, rank)
    trainer = Trainer(cfg, quiet=True, rehearsal=rehearsal, capacity_floor=device_capacity_floor)
    if rehearsal is None:  # every rank must step as often, or the ranks hang in their collectives
        flags = "warmup steps routing no-sync-check forward-backward-only also-forward-backward also-optimizer-step"
        given = (warmup, steps, routings, not sync_check, forward_backward_only, also_forward_backward)
        refuse_unless_alike({f"--{f}": v for f, v in zip(flags.split(), (*given, also_optimizer_step))})

    def say(msg: str) -> None:
        if progress and trainer.par.is_main:
            print(msg, file=sys.stderr, flush=True)

    if rehearsal is not None:
        say(f"bench {spec}: REHEARSAL: {rehearsal_notice(trainer.par.dims, rehearsal.rank)}")
        LEDGER.timing = True
    windows = _windows(trainer, forward_backward_only, also_forward_backward, also_optimizer_step)
    records = []
    for routing in routings:
        trainer.engine.set_routing(routing)
        for i, (timed, step) in enumerate(windows):
            n_warm = warm_up_steps(trainer.engine, i, timed, step, warmup)
            if i > 0 and trainer.engine.step_graph is not None:
                trainer.engine.step_graph.reset()  # the training step's graph and memory are not this window's
            record, timing = _time_window(trainer, spec, routing, timed, step, n_warm, steps, sync_check, say)
            if isinstance(step, _OptimizerStep):
                step.finish()
                trained = [r for r in records if r["routing"] == routing and r["timed"] == "training step"]
                if trained:
                    record["share_of_training_step"] = record["step_time_s"] / trained[-1]["step_time_s"]
            kinds = None
            # after the timed window: the profiler's overhead stays out of it; a rehearsal's
            # kinds of kernel come from a short profile of their own
            if (cfg.logging.profile or rehearsal is not None) and i == 0:
                record["profile_dir"], kinds = _profile(trainer, f"bench {spec} ({routing} routing)", routing, say)
            if rehearsal is not None and not isinstance(step, _OptimizerStep):  # no tokens: no projection
                LEDGER.reset()  # the ledger's counts are the timed window's
                record["rehearsal"] = timing | {"training_gib": record["peak_mem_gib"], "kinds": kinds}
            records.append(record)
    if rehearsal is not None:  # with `checkpoint`, this rank's shard saved and loaded back once
        saved = None
        if checkpoint:
            say(f"bench {spec}: REHEARSAL: saving this rank's checkpoint shard and loading it back")
            saved = rehearse_mod.checkpoint_peaks(trainer)
        for record in (r for r in records if "rehearsal" in r):
            record["rehearsal"] = rehearse_mod.record(trainer, **record["rehearsal"], checkpoint=saved)
        LEDGER.timing = False
    return records


def warm_up_steps(engine, window: int, timed: str, step, warmup: int) -> int:
    """The warm-up calls before window number `window` (0-based; `timed` says which) of a
    configuration. The first warms up after the routing switch: `warmup`; a later one reuses the
    compiled code and needs one step to settle (allocator, gradient buckets). The optimizer
    window gets at least one (its first call runs the forward and backward too), and the
    training step and the forward+backward window, with compute.cuda_graphs=step, at least the
    step graph's eager steps and its capture, and with auto also the replays it times and the
    step that keeps or drops the graph, which then stay out of the timed window."""
    n = warmup if window == 0 else min(warmup, 1)
    if isinstance(step, _OptimizerStep):
        n = max(n, 1)
    if timed in ("training step", "forward+backward") and engine.step_graph is not None:
        judged = JUDGED_REPLAYS if engine.step_graph.judge else 0
        n = max(n, STEP_GRAPH_WARMUP + 1 + judged)
    return n


def _windows(
    trainer: Trainer, forward_backward_only: bool, also_forward_backward: bool, also_optimizer_step: bool
) -> list[tuple[str, Any]]:
    """The timed windows of each configuration: (the line's `timed`, the step it repeats)."""
    if forward_backward_only:
        return [("forward+backward", _forward_backward_step(trainer))]
    windows = [("training step", trainer.train_step)]
    if also_forward_backward:
        windows.append(("forward+backward", _forward_backward_step(trainer)))
    if also_optimizer_step:
        windows.append(("optimizer step", _OptimizerStep(trainer)))
    return windows


def _time_window(
    trainer: Trainer, spec: str, routing: str, timed: str, step, n_warm: int, steps: int, sync_check: bool, say
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`n_warm` warm-up calls of `step`, then `steps` timed ones (and, with `sync_check` on GPU,
    one counting its host syncs): the window's JSON line, and what a rehearsal's entry takes of
    the window (step_s, stand_in_s: the stand-ins' share of it, collectives)."""
    label = f"bench {spec} ({routing} routing, {timed})"
    say(f"{label}: {n_warm} warm-up step{'' if n_warm == 1 else 's'}")
    for _ in range(n_warm):
        step()
    _synchronize(trainer.device)
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.device)
    say(f"{label}: {steps} timed steps")
    LEDGER.reset()
    start = time.perf_counter()
    for _ in range(steps):
        out = step()
    _synchronize(trainer.device)
    elapsed = time.perf_counter() - start
    timing = dict(
        step_s=elapsed / steps,
        stand_in_s=LEDGER.seconds() / steps if trainer.par.rehearsed else 0.0,
        collectives=LEDGER.summary(steps),
    )
    if isinstance(step, _OptimizerStep):  # no tokens pass: no rates, no routing of its own
        balance = dict.fromkeys(
            ("tokens_per_sec", "tokens_per_sec_per_device", "tflops_per_device", "mfu", "expert_load_max_over_mean",
             "ep_load_max_over_mean", "dropped_token_frac"),
        )  # fmt: skip
        balance["lm_loss"] = trainer.engine.global_mean(step.lm_loss.float().reshape(1))[0].item()
    else:  # one collective: loss and routing balance over all ranks
        balance = trainer.engine.metrics(out, step=trainer.step, steps=steps, seconds=elapsed)
    syncs = _count_host_syncs(step) if sync_check and trainer.device.type == "cuda" else None
    return _record(trainer, spec, routing, steps, elapsed, balance, syncs) | {"timed": timed}, timing


def _profile(trainer: Trainer, label: str, routing: str, say) -> tuple[str, dict[str, Any] | None]:
    """logging.profile_steps more training steps under the profiler, into RUN_DIR/profile-ROUTING
    (kinds.json alone without logging.profile): that directory and the kinds of kernel per step."""
    cfg = trainer.cfg
    profile_dir = trainer.run.path / f"profile-{routing}"
    say(f"{label}: {cfg.logging.profile_steps} profiled steps -> {profile_dir}")
    profiler = trainer.profiler(profile_dir, wait=0, kinds_only=not cfg.logging.profile)
    for _ in range(cfg.logging.profile_steps):
        trainer.train_step()
        profiler.step()
    profiler.close()
    kinds = profiler.kinds and {
        **profiler.kinds["ms_per_step"],
        "everything else, top kernels": profiler.kinds["everything_else_top_ms"],
    }
    return str(profile_dir), kinds


def _peak_mem_per_rank(device: torch.device, graph_bytes: int = 0) -> list[float]:
    """Every rank's peak (GiB, rank order): ranks differ (pipeline stages, expert loads), and the
    largest is the one that must fit. One all-gather; on one process (or in a rehearsal, whose
    peers hold nothing) just this one."""
    mine = peak_mem_gib(device, graph_bytes)
    if not dist.is_initialized() or is_rehearsal():
        return [round(mine, 3)]
    t = torch.tensor([mine], dtype=torch.float64, device=device)
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [round(x.item(), 3) for x in out]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def _forward_backward_step(trainer: Trainer):
    """The forward and backward passes of a step's micro-batches (with their data-parallel
    gradient reduction, if any) alone: no clipping, no optimizer step. Gradients are dropped
    after each step and the routing statistics reset (`TrainEngine.drop_step`). With
    compute.cuda_graphs=step they are replayed from the step graph, as the training step is."""

    def step() -> StepOutput:
        engine = trainer.engine
        if engine.step_graph is not None:
            return engine.step_graph.run(trainer.next_batches(), trainer.step, update=False)
        return engine.drop_step(engine.forward_backward(trainer.next_batches()))

    return step


class _OptimizerStep:
    """The optimizer's part of a training step (`TrainEngine.update`) on its own: the first call
    runs one forward and backward for gradients, every call updates from them (they are kept:
    each call does the same work on the same kind of data). `finish` drops the gradients and
    the routing statistics, as `drop_step` does."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.lm_loss: torch.Tensor | None = None

    def __call__(self) -> None:
        engine = self.trainer.engine
        if self.lm_loss is None:
            self.lm_loss = engine.forward_backward(self.trainer.next_batches())
        engine.update(self.lm_loss, self.trainer.step)

    def finish(self) -> None:
        if self.lm_loss is not None:
            self.trainer.engine.drop_step(self.lm_loss)
        self.lm_loss = None


def _count_host_syncs(step) -> int:
    """Run one training step with CUDA's sync debug mode on "warn" and count its warnings
    (every stream/device synchronization, `.item()`, blocking device-to-host copy)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # Only the per-sync warning counts (not the one-time "prototype feature" notice).
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def _record(
    trainer: Trainer, spec: str, routing: str, steps: int, elapsed: float, balance: dict[str, Any], syncs: int | None
) -> dict[str, Any]:
    """`balance` is `TrainEngine.metrics` of the timed window: its rates are the line's."""
    cfg, dims, engine = trainer.cfg, trainer.par.dims, trainer.engine
    m, tc, counts = cfg.model, cfg.train, count_params(cfg.model)
    peaks = _peak_mem_per_rank(trainer.device, engine.graph_memory_bytes())
    # the optimizer's state on this rank (moments, Muon momentum, fp32 masters or their split
    # remainders), also per parameter element this rank holds
    held = sum(local_tensor(p).numel() for p in engine.model.parameters())
    state = engine.optimizer.memory_bytes()
    return {
        "preset": spec,
        "routing": routing,
        **{k: balance[k] for k in ("tokens_per_sec", "tokens_per_sec_per_device", "tflops_per_device", "mfu")},
        "peak_mem_gib": max(peaks),
        "peak_mem_gib_per_rank": peaks,
        "sync_free": None if syncs is None else syncs == 0,
        "host_syncs_per_step": syncs,
        "step_time_s": elapsed / steps,
        "timed_steps": steps,
        "loss": balance["lm_loss"],
        **{k: balance[k] for k in ("expert_load_max_over_mean", "ep_load_max_over_mean", "dropped_token_frac")},
        "shape": {
            **{k: getattr(m, k) for k in ("d_model", "n_layers", "num_dense_layers", "n_heads", "n_kv_heads")},
            "head_dim": m.resolved_head_dim,
            **{k: getattr(m.moe, k) for k in ("num_experts", "top_k", "expert_hidden", "shared_hidden")},
            "dense_hidden": m.resolved_dense_hidden,
            **{k: getattr(m, k) for k in ("vocab_size", "peri_norm")},
            "total_params": counts.total,
            "active_params": counts.active,
        },
        "batch": {
            "seq_len": cfg.data.seq_len,
            **{k: getattr(tc, k) for k in ("micro_batch_size", "grad_accum_steps")},
            "tokens_per_step": engine.tokens_per_step,
        },
        "precision": _precision(trainer),
        "optimizer": {"name": str(cfg.optim.name), "state_bytes": state, "state_bytes_per_param": state / held},
        "flops_per_token": engine.flops_per_token,
        "compile": cfg.compute.compile,
        "loss_chunk_tokens": engine.loss_chunk_tokens,
        "recompute": str(cfg.compute.recompute),
        "defer_expert_weight_grad": engine.model.runtime.expert_grads is not None,
        "cuda_graphs": str(engine.cuda_graphs),
        "cuda_graphs_why": engine.cuda_graphs_why,
        "cuda_graph_counts": engine.cuda_graph_counts(),
        "layout": {
            "world": dims.world_size,
            **{k: getattr(dims, k) for k in ("dp", "cp", "ep", "pp")},
            "stack": str(cfg.parallel.stack),
        },
        "device": torch.cuda.get_device_name(trainer.device) if trainer.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "commit": code_version(),
    }


def _precision(trainer: Trainer) -> str:
    amp_dtype = trainer.engine.amp_dtype
    state = {"adamw": "AdamW", "muon": "Muon and AdamW", "lion": "Lion"}[trainer.cfg.optim.name]
    if amp_dtype is None:
        base = "fp32"
    elif trainer.engine.bf16_weights:
        base = f"bf16 weights (matrices) with split fp32 masters, fp32 gradients and {state} state"
    else:
        base = f"{str(amp_dtype).removeprefix('torch.')} autocast, fp32 master weights, gradients and {state} state"
    if trainer.cfg.precision.fp8 != "none":
        base += f"; {trainer.cfg.precision.fp8} fp8 (e4m3) expert and block-linear GEMMs"
    return base
