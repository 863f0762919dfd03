"""`moetrain plan`'s console report and JSON line."""

from __future__ import annotations

from moetrain.parallel.config import layout_legend
from moetrain.plan.estimate import Plan
from moetrain.plan.search import MAX_GPUS, MoreGpus, larger_counts
from moetrain.plan.time import EXPOSED_PARTS


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
    lines.append("communication per GPU per step (GB sent):")
    lines += [f"  {k:22s} {v:10.3f}" for k, v in p.comm_gb_per_step.items()] or ["  none (one GPU)"]
    lines.append("step time (s), by part:")
    lines += _time_lines(p)
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


def layouts_text(suggestions: list[Plan], flags: list[list[str]], commands: list[str]) -> list[str]:
    """`suggest`'s layouts, each with the flags to paste and the command that rehearses it."""
    lines = [
        "layouts that fit (ddp stack, sharded optimizer), those with headroom first, fastest first; each with "
        "the flags to paste and its rehearsal:"
    ]
    for s, pasted, command in zip(suggestions, flags, commands):
        lines.append(
            f"  {s.layout.describe():70s} peak {s.peak_mem_gib_per_device:6.1f} GiB, "
            f"step {s.step_time_s:.3f} s, MFU {100 * s.mfu:.1f}%{'  TIGHT' if s.tight else ''}\n"
            f"      {' '.join(pasted)}\n      {command}"
        )
    return lines


def more_gpus_text(more: MoreGpus, gpus: int, gpu: str, flags: list[str], command: str) -> list[str]:
    """What to do when no layout fits `gpus` GPUs: the fewest GPUs of the kind on which one fits
    (`fewest_gpus`), with its layout, flags and rehearsal, or that the model must shrink."""
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
        f"GiB, step {s.step_time_s:.3f} s, MFU {100 * s.mfu:.1f}%",
        f"  flags: {' '.join(flags)}",
        f"  rehearse one rank: {command}",
    ]


def more_gpus_json(more: MoreGpus, flags: list[str], command: str) -> dict:
    """The JSON line's `fewest_gpus` where no layout fits --gpus: the fewest GPUs (None: none up
    to `searched_up_to`) with a layout that fits with headroom, fewer where only tight ones do,
    and that layout with its flags and rehearsal."""
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
        )
    return entry


def legend_lines(texts: list[str]) -> list[str]:
    """The legend of the layout abbreviations that occur in `texts` (none: no lines)."""
    meanings = layout_legend(texts)
    return ["layout abbreviations:"] + [f"  {m}" for m in meanings] if meanings else []


def to_json(p: Plan, preset: str, gpus: int, gpu: str, suggestions: list[Plan]) -> dict:
    L = p.layout
    return {
        "preset": preset,
        "gpus": gpus,
        "gpu": gpu,
        "layout": L.describe(),
        "dp": L.dp,
        "cp": L.cp,
        "ep": L.ep,
        "pp": L.pp,
        "stages_per_rank": L.stages_per_rank,
        "stack": L.stack,
        "recompute": L.recompute,
        "micro_batches": L.micro_batches,
        "sequences_per_micro_batch_per_gpu": L.rows_per_micro_batch,
        "params_per_device": p.params_per_device,
        "memory_gib": p.memory_gib,
        "activations_without_recompute_gib": round(p.activations_without_recompute_gib, 2),
        "activations_full_recompute_gib": round(p.activations_full_recompute_gib, 2),
        "peak_mem_gib_per_device": p.peak_mem_gib_per_device,
        "capacity_gib": p.gpu.memory_gib,
        "fits": p.fits,
        "tight": p.tight,
        "save_peak_gib_per_device": p.save_peak_gib_per_device,
        "fits_while_saving": p.fits_while_saving,
        "load_peak_gib_per_device": p.load_peak_gib_per_device,
        "fits_while_loading": p.fits_while_loading,
        "comm_gb_per_step": p.comm_gb_per_step,
        "step_time_s": round(p.step_time_s, 4),
        "mfu": round(p.mfu, 4),
        "tokens_per_sec_per_device": round(p.tokens_per_sec_per_device, 1),
        "exposed_comm_s": round(p.exposed_comm_s, 4),
        "comm_transfer_s": round(sum(p.transfer_s(k) for k in EXPOSED_PARTS), 4),
        "suggested": [
            {
                "layout": s.layout.describe(),
                "peak_mem_gib_per_device": s.peak_mem_gib_per_device,
                "step_time_s": round(s.step_time_s, 4),
                "mfu": round(s.mfu, 4),
                "tight": s.tight,
            }
            for s in suggestions
        ],
    }
