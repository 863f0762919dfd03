"""`moetrain plan`'s console report and JSON line: per layout its memory, step time, tokens/s and
time to a token budget (`Budget`), the line that launches it, and a table across GPU counts."""

from __future__ import annotations

import dataclasses

from moetrain.parallel.config import layout_legend
from moetrain.plan.estimate import Plan
from moetrain.plan.hardware import GPU
from moetrain.plan.search import MAX_GPUS, MoreGpus, larger_counts
from moetrain.plan.time import EXPOSED_PARTS


@dataclasses.dataclass(frozen=True)
class Budget:
    """The tokens `moetrain plan` times each layout on: --tokens, or the run's own length."""

    tokens: int
    steps: int | None = None
    """The run's train.steps where the budget is its length (steps × global batch × seq_len, as
    the config gives them); None where --tokens set it."""

    def __str__(self) -> str:
        tokens = f"{tokens_text(self.tokens)} tokens"
        return tokens if self.steps is None else f"the run's {self.steps:,} steps ({tokens})"

    def seconds(self, p: Plan, gpus: int) -> float:
        """How long `p` on `gpus` GPUs takes to train the budget's tokens."""
        return self.tokens / (p.tokens_per_sec_per_device * gpus)


def tokens_text(n: float) -> str:
    """A token count as people say it: 3.36T, 250B, 500M, 12K."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def duration_text(seconds: float) -> str:
    """A training time in seconds (under 2 minutes), minutes (under 2 hours), hours (under 2 days)
    or days."""
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 86400:,.1f} days"


def gpus_text(gpus: int) -> str:
    """ "1 GPU", "256 GPUs"."""
    return f"{gpus} GPU" + ("s" if gpus != 1 else "")


def speed_text(p: Plan, gpus: int, budget: Budget) -> str:
    """ "12,345 tokens/s per GPU, 3,160,320 on 256 GPUs: 250B tokens in 9.2 days"."""
    return (
        f"{p.tokens_per_sec_per_device:,.0f} tokens/s per GPU, {p.tokens_per_sec_per_device * gpus:,.0f} on "
        f"{gpus_text(gpus)}: {tokens_text(budget.tokens)} tokens in {duration_text(budget.seconds(p, gpus))}"
    )


def speed_json(p: Plan, gpus: int, budget: Budget) -> dict:
    """The JSON line's tokens/s on all `gpus` GPUs and seconds to the budget of a layout."""
    return {
        "tokens_per_sec": round(p.tokens_per_sec_per_device * gpus, 1),
        "time_to_budget_s": round(budget.seconds(p, gpus), 3),
    }


def launch_command(spec: str, gpus: int, gpu: GPU, flags: list[str]) -> str:
    """The line that trains `spec` with `flags` on `gpus` GPUs: torchrun on one node; srun, one
    task per GPU, across several (moetrain takes the rank, world size and rank 0's address from
    SLURM's variables: src/moetrain/parallel/distributed.py, `adopt_launcher_env`)."""
    train = ["-m moetrain train", spec, *flags]
    if gpus <= gpu.gpus_per_node:
        return " ".join([f"torchrun --nproc-per-node={gpus}", *train])
    tasks = f"srun --ntasks={gpus} --ntasks-per-node={gpu.gpus_per_node} --gpus-per-task=1 python"
    return " ".join([tasks, *train])


def report(p: Plan) -> str:
    """The human-readable per-GPU table that `moetrain plan` prints before its JSON line."""
    L, g = p.layout, p.gpu
    lines = [
        f"layout: {L.describe()} on {g.name} ({g.memory_gib:g} GiB usable)",
        f"parameters per GPU: {p.params_per_device / 1e9:.3f}B",
        "memory per GPU (GiB, the pipeline rank that needs most):",
        f"  weights (fp32)      {p.memory_gib['weights']:8.2f}",
        f"  gradients           {p.memory_gib['grads']:8.2f}",
        f"  optimizer state     {p.memory_gib['optimizer']:8.2f}",
        f"  activations         {p.memory_gib['activations']:8.2f}   (this layout, with the logits and bf16 "
        f"weight copies; none: {p.activations_without_recompute_gib:.2f}, full recompute: "
        f"{p.activations_full_recompute_gib:.2f})",
        f"  peak                {p.peak_mem_gib_per_device:8.2f}   -> {'fits' if p.fits else 'does NOT fit'}",
        f"  while saving        {p.save_peak_gib_per_device:8.2f}   -> "
        f"{'fits' if p.fits_while_saving else 'does NOT fit'} (state + gradient buckets + the save's temporaries)",
        f"  while loading       {p.load_peak_gib_per_device:8.2f}   -> "
        f"{'fits' if p.fits_while_loading else 'does NOT fit'} (state + gradient buckets + the load's temporaries)",
    ]
    if len(p.peak_gib_per_pipeline_rank) > 1:
        lines.append("  peak per pipeline rank: " + ", ".join(f"{x:.1f}" for x in p.peak_gib_per_pipeline_rank))
    comm = [f"  {k:22s} {v:10.3f}" for k, v in p.comm_gb_per_step.items()] or ["  none (one GPU)"]
    lines += ["communication per GPU per step (GB sent):", *comm, "step time (s), by part:", *_time_lines(p)]
    lines.append(
        f"  step                   {p.step_time_s:10.4f}   tokens/s per GPU {p.tokens_per_sec_per_device:,.0f}, "
        f"MFU {100 * p.mfu:.1f}%"
    )
    return "\n".join(lines)


def _time_lines(p: Plan) -> list[str]:
    """The step's parts that take time; a communication part is only what compute does not hide
    of its transfer, so it is labelled exposed, with the transfer's whole time beside it."""
    lines = []
    for k, v in p.time_s.items():
        if k in EXPOSED_PARTS and p.transfer_s(k) > 0:
            lines.append(f"  {k:22s} {v:10.4f}   exposed, of {p.transfer_s(k):.4f} s of transfer")
        elif v > 0:
            lines.append(f"  {k:22s} {v:10.4f}")
    transfers = [p.transfer_s(k) for k in EXPOSED_PARTS if p.transfer_s(k) > 0]
    if len(transfers) > 1:
        lines.append(
            f"  {'communication exposed':22s} {p.exposed_comm_s:10.4f}   of {sum(transfers):.4f} s of transfers "
            "(compute hides the rest)"
        )
    return lines


def budget_line(p: Plan, gpus: int, budget: Budget) -> str:
    """The time a layout takes to train the budget, with its tokens/s on all its GPUs."""
    return (
        f"  time to train {budget}: {duration_text(budget.seconds(p, gpus))} at "
        f"{p.tokens_per_sec_per_device * gpus:,.0f} tokens/s on {gpus_text(gpus)}"
    )


def layouts_text(
    suggestions: list[Plan], flags: list[list[str]], commands: list[str], gpus: int, budget: Budget
) -> list[str]:
    """`suggest`'s layouts on `gpus` GPUs, each with its speed and time to the budget, the flags
    to paste and the command that rehearses it."""
    lines = [
        "layouts that fit (ddp stack, sharded optimizer), those with headroom first, fastest first; each with "
        "the flags to paste and its rehearsal:"
    ]
    for s, pasted, command in zip(suggestions, flags, commands):
        lines.append(
            f"  {s.layout.describe():70s} peak {s.peak_mem_gib_per_device:6.1f} GiB, "
            f"step {s.step_time_s:.3f} s, MFU {100 * s.mfu:.1f}%{'  TIGHT' if s.tight else ''}\n"
            f"      {speed_text(s, gpus, budget)}\n      {' '.join(pasted)}\n      {command}"
        )
    return lines


def more_gpus_text(
    more: MoreGpus, gpus: int, gpu: str, flags: list[str], command: str, launch: str, budget: Budget
) -> list[str]:
    """What to do when no layout fits `gpus` GPUs: the fewest GPUs of the kind on which one fits
    (`fewest_gpus`), with its layout, speed and time to the budget, flags, rehearsal and launch
    line, or that the model must shrink."""
    head = f"no layout of the ddp stack fits {gpus} × {gpu}"
    if more.plan is None:
        tight = f" (from {more.tight_gpus} on, layouts fit only TIGHT)" if more.tight_gpus else ""
        return [f"{head}, nor on any count of them up to {MAX_GPUS}{tight}: shrink the model."]
    tried = [n for n in larger_counts(gpus) if n <= more.gpus]
    tight = f"; {more.tight_gpus} fit only TIGHT" if more.tight_gpus else ""
    s = more.plan
    return [
        f"{head}. The fewest {gpu} GPUs on which a layout fits with headroom: {more.gpus} (tried "
        f"{', '.join(map(str, tried))}{tight}). Or shrink the model.",
        f"  on {more.gpus} × {gpu}: {s.layout.describe()}, peak {s.largest_peak_gib:.1f} of {s.gpu.memory_gib:g} "
        f"GiB, step {s.step_time_s:.3f} s, MFU {100 * s.mfu:.1f}%; {speed_text(s, more.gpus, budget)}",
        f"  flags: {' '.join(flags)}",
        f"  rehearse one rank: {command}",
        f"  launch: {launch}",
    ]


def more_gpus_json(more: MoreGpus, flags: list[str], command: str, launch: str, budget: Budget) -> dict:
    """The JSON line's `fewest_gpus` where no layout fits --gpus: the fewest GPUs (None: none up
    to `searched_up_to`) with a layout that fits with headroom, fewer where only tight ones do,
    and that layout with its speed, time to the budget, flags, rehearsal and launch line."""
    entry = {"gpus": more.gpus, "tight_gpus": more.tight_gpus, "searched_up_to": MAX_GPUS}
    if more.plan is not None:
        s = more.plan
        entry.update(
            layout=s.layout.describe(),
            peak_mem_gib_per_device=s.peak_mem_gib_per_device,
            step_time_s=round(s.step_time_s, 4),
            mfu=round(s.mfu, 4),
            tight=s.tight,
            flags=flags,
            rehearse_command=command,
            launch=launch,
            **speed_json(s, more.gpus, budget),
        )
    return entry


@dataclasses.dataclass(frozen=True)
class CountPlan:
    """One row of `moetrain plan --gpus 64,128,…`: the fastest layout that fits `gpus` GPUs
    (`suggest`'s first, so one with headroom where any has), with its flags and launch line."""

    gpus: int
    plan: Plan | None
    """None: no layout fits."""
    flags: list[str] | None
    launch: str | None


def counts_text(rows: list[CountPlan], spec: str, gpu: str, budget: Budget) -> list[str]:
    """The table across GPU counts, one row each, then each count's launch line."""
    lines = [
        f"{spec} on {gpu}: the fastest layout that fits each count (one with headroom first), timed on {budget}:",
        f"  {'GPUs':>6} {'peak GiB':>9} {'step s':>8} {'tokens/s/GPU':>13} {'tokens/s':>14} {'time':>12} "
        f"{'MFU':>6}  layout",
    ]
    for r in rows:
        p = r.plan
        if p is None:
            lines.append(f"  {r.gpus:>6}  nothing fits")
            continue
        lines.append(
            f"  {r.gpus:>6} {p.peak_mem_gib_per_device:>9.1f} {p.step_time_s:>8.4f} "
            f"{p.tokens_per_sec_per_device:>13,.0f} {p.tokens_per_sec_per_device * r.gpus:>14,.0f} "
            f"{duration_text(budget.seconds(p, r.gpus)):>12} {100 * p.mfu:>5.1f}%  "
            f"{p.layout.describe()}{'  TIGHT' if p.tight else ''}"
        )
    launched = [r for r in rows if r.launch]
    if launched:
        lines.append("launch (each count's layout, with the flags that set it):")
        lines += [f"  {r.gpus:>6}  {r.launch}" for r in launched]
    return lines


def counts_json(rows: list[CountPlan], spec: str, gpu: str, budget: Budget) -> dict:
    """The JSON line of the table across GPU counts (a count where nothing fits: its values None)."""
    counts = []
    for r in rows:
        p = r.plan
        if p is None:
            keys = ("layout", "tight", "peak_mem_gib_per_device", "step_time_s", "tokens_per_sec_per_device")
            keys += ("tokens_per_sec", "time_to_budget_s", "mfu", "flags", "launch")
            counts.append({"gpus": r.gpus, "fits": False, **dict.fromkeys(keys)})
            continue
        counts.append(
            {
                "gpus": r.gpus,
                "layout": p.layout.describe(),
                **{k: getattr(p, k) for k in ("fits", "tight", "peak_mem_gib_per_device")},
                "step_time_s": round(p.step_time_s, 4),
                "tokens_per_sec_per_device": round(p.tokens_per_sec_per_device, 1),
                **speed_json(p, r.gpus, budget),
                "mfu": round(p.mfu, 4),
                "flags": r.flags,
                "launch": r.launch,
            }
        )
    return {"preset": spec, "gpu": gpu, "tokens_budget": budget.tokens, "counts": counts}


def legend_lines(texts: list[str]) -> list[str]:
    """The legend of the layout abbreviations that occur in `texts` (none: no lines)."""
    meanings = layout_legend(texts)
    return ["layout abbreviations:"] + [f"  {m}" for m in meanings] if meanings else []


def to_json(p: Plan, preset: str, gpus: int, gpu: str, suggestions: list[Plan], budget: Budget) -> dict:
    """The JSON line of `p` on `gpus` GPUs and of `suggest`'s layouts there, each timed on `budget`."""
    L = p.layout
    return {
        "preset": preset,
        "gpus": gpus,
        "gpu": gpu,
        "layout": L.describe(),
        **{
            k: getattr(L, k) for k in ("dp", "cp", "ep", "pp", "stages_per_rank", "stack", "recompute", "micro_batches")
        },
        "sequences_per_micro_batch_per_gpu": L.rows_per_micro_batch,
        **{k: getattr(p, k) for k in ("params_per_device", "memory_gib")},
        **{k: round(getattr(p, k), 2) for k in ("activations_without_recompute_gib", "activations_full_recompute_gib")},
        "peak_mem_gib_per_device": p.peak_mem_gib_per_device,
        "capacity_gib": p.gpu.memory_gib,
        **{k: getattr(p, k) for k in ("fits", "tight", "save_peak_gib_per_device", "fits_while_saving")},
        **{k: getattr(p, k) for k in ("load_peak_gib_per_device", "fits_while_loading", "comm_gb_per_step")},
        "step_time_s": round(p.step_time_s, 4),
        "mfu": round(p.mfu, 4),
        "tokens_per_sec_per_device": round(p.tokens_per_sec_per_device, 1),
        **speed_json(p, gpus, budget),
        "tokens_budget": budget.tokens,
        "exposed_comm_s": round(p.exposed_comm_s, 4),
        "comm_transfer_s": round(sum(p.transfer_s(k) for k in EXPOSED_PARTS), 4),
        "suggested": [
            {
                "layout": s.layout.describe(),
                "peak_mem_gib_per_device": s.peak_mem_gib_per_device,
                "step_time_s": round(s.step_time_s, 4),
                "mfu": round(s.mfu, 4),
                "tight": s.tight,
                "tokens_per_sec_per_device": round(s.tokens_per_sec_per_device, 1),
                **speed_json(s, gpus, budget),
            }
            for s in suggestions
        ],
    }
