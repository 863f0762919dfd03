"""`moetrain plan`'s console report and JSON line."""

from __future__ import annotations

from moetrain.plan.estimate import Plan


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
    lines += [f"  {k:22s} {v:10.4f}" for k, v in p.time_s.items() if v > 0]
    lines.append(
        f"  step                   {p.step_time_s:10.4f}   tokens/s per GPU {p.tokens_per_sec_per_device:,.0f}, "
        f"MFU {100 * p.mfu:.1f}%"
    )
    return "\n".join(lines)


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
