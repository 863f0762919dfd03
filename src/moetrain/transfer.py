"""Host-to-device copies that do not hold the host back.

From pageable host memory CUDA first waits until the stream has run everything queued before the
copy (the CUDA runtime API's "API synchronization behavior"), so a step's batch, or an optimizer
kernel's table, would keep the host from launching more work until the GPU had caught up. From
page-locked memory the copy is queued like a kernel; torch's caching host allocator keeps each
page-locked block until the copies that read it are done.
"""

from __future__ import annotations

import torch


def pinned_for(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t`, copied into page-locked host memory if it is a CPU tensor bound for a CUDA device;
    anything else as it is."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        return t.pin_memory()
    return t


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, the copy queued without waiting for the stream (`pinned_for`)."""
    return pinned_for(t, device).to(device, non_blocking=True)
