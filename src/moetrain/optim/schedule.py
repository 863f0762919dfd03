"""The learning-rate schedule: warmup, then cosine, warmup-stable-decay or constant."""

from __future__ import annotations

import math

from moetrain.optim.config import ScheduleConfig, ScheduleKind


def lr_at(step: int, total_steps: int, peak_lr: float, cfg: ScheduleConfig) -> float:
    """Learning rate for optimizer step `step` (0-based) of a schedule planned over `total_steps`;
    a step past its end runs at the rate of its last step (a run extended with train.extend=keep),
    whether the schedule had decayed or was still warming up."""
    step = min(step, total_steps - 1)
    min_lr = peak_lr * cfg.min_lr_ratio
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return peak_lr * (step + 1) / cfg.warmup_steps
    if cfg.kind == ScheduleKind.constant:
        return peak_lr
    if cfg.kind == ScheduleKind.cosine:
        span = max(1, total_steps - cfg.warmup_steps - 1)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return min_lr + 0.5 * (peak_lr - min_lr) * (1 + math.cos(math.pi * progress))
    # Warmup-stable-decay: linear decay over the last decay_fraction of the run.
    decay_steps = max(1, round(total_steps * cfg.decay_fraction))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return peak_lr
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    return peak_lr + (min_lr - peak_lr) * progress
