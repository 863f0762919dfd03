"""Where a run executes: the device, the process group and this rank's share of the layout.

`setup_runtime(cfg)` is the first thing a run does (before any data or model exists):

    device (train.device) → the default process group (torchrun's environment; none for one
    process) → the layout on that many ranks (`RunConfig.build_dims`, which validates the run
    for this world size and device) → this rank's process groups
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetrain.errors import ConfigError
from moetrain.parallel.dims import ParallelState
from moetrain.parallel.distributed import init_distributed
from moetrain.parallel.rehearsal import Rehearsal
from moetrain.train.config import RunConfig


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    par: ParallelState


def resolve_device(name: str) -> torch.device:
    """train.device as a torch.device: "auto" is cuda when a GPU is visible, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available here: use --device cpu.")
    return torch.device(name)


def setup_runtime(cfg: RunConfig, rehearsal: Rehearsal | None = None) -> Runtime:
    """Validate `cfg` for this device and world size and join the process group (see the
    module docstring). Each rank calls it; under torchrun each takes GPU LOCAL_RANK. With
    `rehearsal` this process is that one rank of that world (src/moetrain/parallel/rehearsal.py)."""
    device = resolve_device(cfg.train.device)
    rank, world = init_distributed(device.type, cfg.parallel.timeout_s, cfg.parallel.peer_timeout_s, rehearsal)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", torch.cuda.current_device())
    dims = cfg.build_dims(world, device)
    return Runtime(device, ParallelState.create(dims, device.type, rank, rehearsed=rehearsal is not None))
