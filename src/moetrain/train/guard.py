"""Guarded steps: an update whose loss or gradient norm is not finite, or spikes far above its
recent history, is skipped (Olmo-core's skip-step idea), and the run stops after too many in a
row — all decided on the device, so the guard adds no host sync to a step.

Per step, with L the LM loss and G the global gradient norm (device scalars):

    skip = not finite(L) or not finite(G)
           or (history ≥ window / 2 and (L > mean_L + σ·std_L or G > mean_G + σ·std_G))

over the last `guard.skip_window` *accepted* steps (σ = `guard.skip_spike_sigma`; 0 turns spike
detection off). The optimizer receives `skip` and leaves parameters and AdamW state untouched
when it is set (the fused CUDA kernel takes it as its `found_inf`). Skipped steps are counted;
the consecutive count is read on the host only on logging steps, or one step late through a
non-blocking copy, never by waiting for the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetrain.errors import MoetrainError

COUNTERS = ("count", "skipped_total", "consecutive")
"""The guard's device counters, saved after its history (trainer_state.json's "guard")."""


class TooManySkippedSteps(MoetrainError):
    """Raised when `guard.max_consecutive_skips` updates in a row were skipped."""


class StepGuard:
    def __init__(self, window: int, sigma: float, max_consecutive: int, device: torch.device):
        self.window, self.sigma, self.max_consecutive = window, sigma, max_consecutive
        self.history_W2 = torch.zeros(window, 2, dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # accepted steps seen
        self.skipped_total = torch.zeros((), dtype=torch.int64, device=device)
        self.consecutive = torch.zeros((), dtype=torch.int64, device=device)
        self._positions_W = torch.arange(window, device=device)

    @torch.no_grad()
    def check(self, lm_loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """The device bool `skip` for this step; records the values of an accepted step."""
        values_2 = torch.stack([lm_loss.detach().float(), grad_norm.detach().float()])
        skip = ~torch.isfinite(values_2).all()
        if self.sigma > 0:
            filled = self.count.clamp(max=self.window)
            valid_W1 = (self._positions_W < filled).unsqueeze(1)
            n = filled.clamp(min=1).float()
            mean_2 = (self.history_W2 * valid_W1).sum(0) / n
            var_2 = (((self.history_W2 - mean_2) ** 2) * valid_W1).sum(0) / n
            spike = (values_2 > mean_2 + self.sigma * var_2.sqrt()).any() & (filled >= max(self.window // 2, 2))
            skip = skip | spike
        accepted = (~skip).long()
        slot = (self.count % self.window).reshape(1)
        # An accepted step's values enter the window (a skipped one leaves it as it was).
        row_12 = torch.where(skip, self.history_W2.index_select(0, slot).squeeze(0), values_2).unsqueeze(0)
        self.history_W2.index_copy_(0, slot, row_12)
        # In place, every one: a CUDA graph of the update (src/moetrain/train/cuda_graphs.py)
        # writes the tensors it captured.
        self.count += accepted
        self.skipped_total += 1 - accepted
        self.consecutive.add_(1).mul_(1 - accepted)
        return skip

    def raise_if_stuck(
        self, consecutive: int, step: int, last_checkpoint: Callable[[], str | None] = lambda: None
    ) -> None:
        """Stop the run after too many skips in a row; `last_checkpoint` is asked only then."""
        if self.max_consecutive > 0 and consecutive >= self.max_consecutive:
            path = last_checkpoint()
            kept = f"the last good checkpoint is {path}" if path else "no checkpoint was written yet"
            raise TooManySkippedSteps(
                f"{consecutive} optimizer steps in a row were skipped (non-finite or spiking loss / gradient "
                f"norm) up to step {step}: training stopped; {kept}. Lower optim.lr, raise "
                "guard.skip_spike_sigma or check the data, then continue with --resume."
            )

    def state_dict(self) -> dict:
        """Plain JSON types (read on the host: at checkpoint time only)."""
        return {"history": self.history_W2.tolist()} | {name: int(getattr(self, name)) for name in COUNTERS}

    def load_state_dict(self, state: dict) -> None:
        """A state saved with another window (guard.skip_window changed on resume) keeps its
        newest accepted values, oldest first, as many as both windows hold."""
        history_W2, count = torch.tensor(state["history"], dtype=torch.float32).reshape(-1, 2), state["count"]
        if len(history_W2) != self.window:
            kept = min(count, len(history_W2), self.window)
            newest = history_W2[torch.arange(count - kept, count) % len(history_W2)]
            history_W2, count = torch.cat([newest, torch.zeros(self.window - kept, 2)]), kept
        self.history_W2.copy_(history_W2)
        for name in COUNTERS:
            getattr(self, name).fill_(count if name == "count" else state[name])
