"""`ParallelDims`: the parallel layout, its validation, and the device mesh that implements it.

Ranks are laid out as (pp, edp, ep), ep fastest:

    rank = pp_index · dp + edp_index · ep + ep_index

- dp = world / pp ranks share one pipeline stage and split the batch (data parallel);
- within them, groups of ep consecutive ranks split the experts (expert parallel): tokens travel
  between them with all-to-all, so consecutive ranks (one node) carry that traffic;
- ranks with the same ep_index across those groups hold the same experts: the expert-replica
  group "edp" (size dp / ep) over which expert gradients are reduced.
"""

from __future__ import annotations

import dataclasses
import enum

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moetrain.config import Config
from moetrain.errors import ConfigError


class Stack(enum.StrEnum):
    ddp = "ddp"
    """Resident experts: dense parameters replicated, experts split over ep ranks (all-to-all),
    gradients all-reduced by `GradReducer` (or reduce-scattered by the sharded optimizer)."""
    fsdp = "fsdp"
    """The FSDP2 baseline: `fully_shard` per block and on the root over dp; experts are sharded
    like any weight and all-gathered with their block, so every rank computes all experts for its
    tokens (no expert parallelism, no all-to-all). Parameters, gradients and AdamW state ÷ dp."""


class DispatcherKind(enum.StrEnum):
    nosync = "nosync"
    """Fixed-size buffers per destination rank: no device-to-host sync; dropless unless
    parallel.capacity_factor is set (moetrain/parallel/nosync_dispatcher.py)."""
    alltoall = "alltoall"
    """Exact split sizes, read on the host once per layer: dropless, least memory."""


@dataclasses.dataclass(kw_only=True)
class ParallelConfig(Config):
    stack: Stack = Stack.ddp
    """Which parallel stack trains the model: `ddp` (resident experts, expert parallelism) or
    `fsdp` (the FSDP2 baseline, for comparing the stacks on the same model, data and batch)."""
    dp: int | None = None
    """Data-parallel degree; None = every rank (world size / pp)."""
    ep: int = 1
    """Expert-parallel degree: experts are split over groups of ep ranks. Divides dp and the
    number of experts."""

    dispatcher: DispatcherKind = DispatcherKind.nosync
    """How tokens reach experts on other ranks (with ep > 1)."""
    shard_optimizer: bool = False
    """Distributed optimizer: fp32 master weights and AdamW moments sharded over the data-parallel
    ranks (gradients reduce-scattered, parameters all-gathered): optimizer memory ÷ dp."""
    capacity_factor: float | None = None
    """nosync only: rows per destination rank = ceil(f · assignments / ep); assignments beyond
    are dropped (and counted in dropped_token_frac). None = dropless (buffers of ep × the
    assignments: see docs/architecture.md for the memory cost)."""

    def validate(self) -> None:
        if self.capacity_factor is not None:
            if self.capacity_factor <= 0:
                raise ConfigError(f"parallel.capacity_factor={self.capacity_factor} must be positive (or null for dropless).")
            if self.dispatcher != DispatcherKind.nosync:
                raise ConfigError(
                    "parallel.capacity_factor applies to parallel.dispatcher=nosync only; the "
                    f"{self.dispatcher} dispatcher is always dropless."
                )
        if self.dp is not None and self.dp <= 0:
            raise ConfigError(f"parallel.dp={self.dp} must be a positive integer (or null for all ranks).")
        if self.ep <= 0:
            raise ConfigError(f"parallel.ep={self.ep} must be a positive integer.")
        if self.stack == Stack.fsdp:
            if self.ep != 1:
                raise ConfigError(
                    f"parallel.stack=fsdp shards experts like any weight and has no expert parallelism: "
                    f"set parallel.ep=1 (got parallel.ep={self.ep}), or use parallel.stack=ddp."
                )
            if self.shard_optimizer:
                raise ConfigError(
                    "parallel.shard_optimizer=true is the ddp stack's distributed optimizer; "
                    "parallel.stack=fsdp shards the optimizer state already: drop one of the two."
                )


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp: int
    ep: int
    pp: int = 1

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int, num_experts: int, has_moe: bool = True) -> ParallelDims:
        """Check the layout against the world size and the model before any work is done."""
        pp = 1
        dp = cfg.dp if cfg.dp is not None else world_size // pp
        if pp * dp != world_size:
            raise ConfigError(
                f"The layout pp={pp} × dp={dp} = {pp * dp} ranks does not match the world size "
                f"{world_size}: set parallel.dp={world_size // pp} or launch {pp * dp} processes."
            )
        if dp % cfg.ep:
            raise ConfigError(
                f"parallel.ep={cfg.ep} does not divide parallel.dp={dp}: expert-parallel groups are "
                "made of data-parallel ranks."
            )
        if has_moe and num_experts % cfg.ep:
            raise ConfigError(
                f"parallel.ep={cfg.ep} does not divide model.moe.num_experts={num_experts}: every "
                "rank of an expert-parallel group must hold the same number of experts."
            )
        return cls(world_size=world_size, dp=dp, ep=cfg.ep, pp=pp)

    @property
    def edp(self) -> int:
        """Size of an expert-replica group: ranks holding the same experts."""
        return self.dp // self.ep

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The 3-D mesh (pp, edp, ep) and its flattened (edp, ep) sub-mesh "dp". Needs an
        initialized process group of `world_size` ranks."""
        mesh = init_device_mesh(device_type, (self.pp, self.edp, self.ep), mesh_dim_names=("pp", "edp", "ep"))
        return mesh, mesh["edp", "ep"]._flatten("dp")


@dataclasses.dataclass
class ParallelState:
    """The process groups one rank takes part in (None where the degree is 1)."""

    dims: ParallelDims
    mesh: DeviceMesh | None = None
    dp_mesh: DeviceMesh | None = None
    rank: int = 0

    @classmethod
    def create(cls, dims: ParallelDims, device_type: str, rank: int) -> ParallelState:
        if dims.world_size == 1:
            return cls(dims, rank=rank)
        mesh, dp_mesh = dims.build_mesh(device_type)
        return cls(dims, mesh, dp_mesh, rank)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.dp_mesh.get_group() if self.dp_mesh is not None and self.dims.dp > 1 else None

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self.mesh["ep"].get_group() if self.mesh is not None and self.dims.ep > 1 else None

    @property
    def edp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["edp"].get_group() if self.mesh is not None and self.dims.edp > 1 else None

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    @property
    def ep_rank(self) -> int:
        return self.mesh["ep"].get_local_rank() if self.mesh is not None else 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0
