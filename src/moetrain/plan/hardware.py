"""The GPUs the planner knows: memory, peak FLOP/s and bandwidths."""

from __future__ import annotations

import dataclasses

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


GPUS: dict[str, GPU] = {
    # H100 SXM 80 GB: NVLink 4 (900 GB/s both directions), ConnectX-7 400 Gb/s per GPU.
    "h100": GPU("H100 SXM", 78.0, 989.4e12, 3.35e12, 450e9, 50e9),
    # H200 SXM 141 GB (nvidia-smi: 143,771 MiB): as H100, more and faster memory.
    "h200": GPU("H200 SXM", 139.0, 989.4e12, 4.8e12, 450e9, 50e9),
    # B200 180 GB: NVLink 5 (1.8 TB/s both directions), ConnectX-7 400 Gb/s per GPU.
    "b200": GPU("B200", 177.0, 2250e12, 8.0e12, 900e9, 50e9),
    # B300 288 GB (275 GiB usable, as Olmo-core reports it): ConnectX-8 800 Gb/s per GPU.
    "b300": GPU("B300", 275.0, 2250e12, 8.0e12, 900e9, 100e9),
}
