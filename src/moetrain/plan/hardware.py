"""The GPUs the planner knows: memory, peak FLOP/s and bandwidths."""

from __future__ import annotations

import dataclasses
import os

import torch

from moetrain.errors import ConfigError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    """What torch can allocate: the device's memory as nvidia-smi reports it, less ~1.5 GiB of
    CUDA context and NCCL buffers (not counted in torch's allocated bytes)."""
    bf16_flops: float
    """Dense BF16 tensor-core peak, FLOP/s (MFU's denominator; FP8 GEMMs run at twice this)."""
    hbm_bytes_s: float
    nvlink_bytes_s: float
    """Per GPU, one direction."""
    network_bytes_s: float
    """Per GPU, one direction, across nodes (one NIC per GPU)."""
    gpus_per_node: int = 8
    fp8: bool = True
    """FP8 tensor cores (compute capability ≥ 8.9)."""


GPUS: dict[str, GPU] = {
    # A100 SXM 80 GB (nvidia-smi: 81,920 MiB): NVLink 3 (600 GB/s both directions), HDR
    # InfiniBand 200 Gb/s per GPU; no FP8. The planner's efficiencies were measured on Hopper.
    "a100": GPU("A100 SXM", 78.5, 312e12, 2.039e12, 300e9, 25e9, fp8=False),
    # H100 SXM 80 GB: NVLink 4 (900 GB/s both directions), ConnectX-7 400 Gb/s per GPU.
    "h100": GPU("H100 SXM", 78.0, 989.4e12, 3.35e12, 450e9, 50e9),
    # H200 SXM 141 GB (nvidia-smi: 143,771 MiB): as H100, more and faster memory.
    "h200": GPU("H200 SXM", 139.0, 989.4e12, 4.8e12, 450e9, 50e9),
    # B200 180 GB: NVLink 5 (1.8 TB/s both directions), ConnectX-7 400 Gb/s per GPU.
    "b200": GPU("B200", 177.0, 2250e12, 8.0e12, 900e9, 50e9),
    # B300 288 GB (275 GiB usable, as Olmo-core reports it): ConnectX-8 800 Gb/s per GPU.
    "b300": GPU("B300", 275.0, 2250e12, 8.0e12, 900e9, 100e9),
}
KNOWN_GPUS = tuple(GPUS)
"""The GPUs the planner ships with; `custom_gpu` adds others to `GPUS` for one process."""


def custom_gpu(name: str, **fields: float | int | bool) -> str:
    """Add a GPU the planner does not know to `GPUS` under `name` lower-cased, for this process
    (`moetrain plan --gpu NAME:memory_gib=…`): an H100 SXM with `fields` (the `GPU` fields
    given) in place of its own. Returns its key."""
    key = name.lower()
    if key in KNOWN_GPUS:
        raise ConfigError(
            f"--gpu {name}:…: {key} is a GPU the planner knows: plan on --gpu {key}, or give yours another name "
            f"(--gpu my{key}:memory_gib=…)."
        )
    GPUS[key] = dataclasses.replace(GPUS["h100"], name=name, **fields)
    return key


def plan_gpu(device_name: str, capacity: int | None) -> str:
    """The planner's GPU (h100, h200, …; of those it ships with) for this device: by name, else the
    nearest in memory."""
    for key in KNOWN_GPUS:
        if key in device_name.lower():
            return key
    if capacity is None:
        return "h200"
    return min(KNOWN_GPUS, key=lambda k: abs(GPUS[k].memory_gib * 2**30 - capacity))


def device_memory(device: torch.device) -> tuple[float, str | None]:
    """What a run can allocate on `device` (a GPU's memory less 1.5 GiB of CUDA context and NCCL
    buffers, as `GPU.memory_gib` counts it, or the machine's RAM), and the planner's GPU for it
    (None on a CPU)."""
    if device.type != "cuda":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), None
    total = torch.cuda.get_device_properties(device).total_memory
    return total - 1.5 * GIB, plan_gpu(torch.cuda.get_device_name(device), total)


def refuse_unless_it_fits(params: int, device: torch.device | str, what: str, fix: str) -> None:
    """Refuse to build `what`, a model of `params` fp32 parameters, whole on `device` when they
    alone exceed what it can hold (`device_memory`): the kernel would kill the process without a
    word, or the load would fail deep inside."""
    from moetrain.destinations import format_bytes

    device = torch.device(device)
    memory = device_memory(device)[0]
    if 4 * params > memory:
        where = "this machine's memory" if device.type == "cpu" else f"the memory of {device}"
        raise ConfigError(
            f"{what} is built whole in {where}, in fp32: {params / 1e6:,.1f}M parameters × 4 bytes = "
            f"{format_bytes(4 * params)}, more than its {format_bytes(memory)}. {fix}"
        )
