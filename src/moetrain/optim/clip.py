"""The global gradient norm over every rank's gradients, and clipping to it, without a host sync."""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_grad_norm(
    grads: list[torch.Tensor], expert_grads: list[torch.Tensor], ep_group=None, pp_group=None
) -> torch.Tensor:
    """The L2 norm of all gradients of the model (`grads` of dense parameters, `expert_grads` of
    expert ones: this rank's gradient tensors), as a device tensor (no host sync): the experts'
    squared norms summed over the expert-parallel group (each rank holds its own experts), the
    stage totals over the pipeline group, so that every rank sees the norm of the whole model."""
    device = (grads or expert_grads)[0].device
    dense_sq, expert_sq = _sum_sq(grads, device), _sum_sq(expert_grads, device)
    if ep_group is not None:
        dist.all_reduce(expert_sq, group=ep_group)
    total_sq = dense_sq + expert_sq
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def _sum_sq(grads: list[torch.Tensor], device) -> torch.Tensor:
    """Σ‖g‖² in fp32; norms of lower-precision gradients (optim.bf16_weights) computed in fp32. On
    CUDA one Triton pass over plain contiguous tensors (`sum_squares`: at the bandwidth, where
    `_foreach_norm` reads bf16 under half of it); elsewhere, and for DTensors, `_foreach_norm`."""
    if grads and all(type(g) is torch.Tensor and g.is_cuda and g.is_contiguous() for g in grads):
        from moetrain.optim.triton_kernels import sum_squares

        return sum_squares(grads)
    total = torch.zeros((), device=device)
    fp32 = [g for g in grads if g.dtype == torch.float32]
    low = [g for g in grads if g.dtype != torch.float32]
    if fp32:
        total = torch.stack(torch._foreach_norm(fp32)).square().sum()
    if low:
        total = total + torch.stack(torch._foreach_norm(low, 2, dtype=torch.float32)).square().sum()
    return total


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that brings a gradient of norm `total_norm` to at most `max_norm` (≤ 1)."""
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
