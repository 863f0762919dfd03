"""`ParallelDims`: the parallel layout, its validation, and the device mesh that implements it.

Ranks are laid out as (pp, edp, ep), ep fastest:

    rank = pp_index · dp + edp_index · ep + ep_index

- pp groups of dp ranks each hold a different part of the layers (pipeline parallel); with
  `pp_stages_per_rank` = v > 1 a rank holds v non-adjacent stages (stage s on pp rank s mod pp);
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


class PipelineSchedule(enum.StrEnum):
    gpipe = "gpipe"
    """All forwards, then all backwards: activations of every micro-batch are held at once."""
    onef1b = "1f1b"
    """One forward, one backward in the steady state: at most pp micro-batches in flight."""
    interleaved_1f1b = "interleaved-1f1b"
    """1F1B over several stages per rank (parallel.pp_stages_per_rank ≥ 2): a smaller bubble
    for more point-to-point messages."""


class DispatcherKind(enum.StrEnum):
    nosync = "nosync"
    """Fixed-size buffers per destination rank: no device-to-host sync; dropless unless
    parallel.capacity_factor is set (moetrain/parallel/nosync_dispatcher.py)."""
    alltoall = "alltoall"
    """Exact split sizes, read on the host once per layer: dropless, least memory."""
    symm = "symm"
    """Exact rows, split sizes exchanged on the GPUs (NVSHMEM symmetric memory): dropless, no
    host sync, only routed rows cross NVLink (moetrain/parallel/symm_dispatcher.py)."""


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
    pp: int = 1
    """Pipeline-parallel degree: the layers are split into pp × pp_stages_per_rank stages. The
    micro-batches of a step (train.global_batch_size / train.micro_batch_size, at least pp) are
    the pipeline's micro-batches."""
    pp_schedule: PipelineSchedule = PipelineSchedule.onef1b
    """Pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b or interleaved-1f1b."""
    pp_stages_per_rank: int | None = None
    """Stages per pipeline rank; None = 1 (gpipe, 1f1b) or 2 (interleaved-1f1b)."""

    dispatcher: DispatcherKind = DispatcherKind.nosync
    """How tokens reach experts on other ranks (with ep > 1)."""
    compile_overlap: bool = False
    """With train.compile: let Inductor move the collectives inside each compiled block (the
    expert all-to-alls) ahead of independent compute, so they overlap it. Measured +1.7%
    tokens/s on two H200s (sweep-8l-8, dp2·ep2, nosync; docs/benchmarks.md); off by default
    until measured on more layouts."""
    shard_optimizer: bool = False
    """Distributed optimizer: fp32 master weights and AdamW moments sharded over the data-parallel
    ranks (gradients reduce-scattered, parameters all-gathered): optimizer memory ÷ dp."""
    timeout_s: float = 600.0
    """Collective timeout: a collective that has not completed after this long fails."""
    peer_timeout_s: float = 120.0
    """A rank whose heartbeat (one tick a second from a background thread) stands still this long
    is declared dead or hung: the rank watching it (ranks watch their successor in a ring) stops
    the run with an error naming it, instead of waiting out a collective timeout."""
    capacity_factor: float | None = None
    """nosync only: rows per destination rank = ceil(f · assignments / ep); assignments beyond
    are dropped (and counted in dropped_token_frac). None = dropless (buffers of ep × the
    assignments: see docs/architecture.md for the memory cost)."""

    def validate(self) -> None:
        for name in ("timeout_s", "peer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"parallel.{name}={getattr(self, name)} must be a positive number of seconds.")
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
        if self.pp <= 0:
            raise ConfigError(f"parallel.pp={self.pp} must be a positive integer.")
        v = self.stages_per_rank
        if v <= 0:
            raise ConfigError(f"parallel.pp_stages_per_rank={v} must be a positive integer.")
        if self.pp_schedule == PipelineSchedule.interleaved_1f1b and v < 2:
            raise ConfigError(
                f"parallel.pp_schedule=interleaved-1f1b interleaves several stages per rank: set "
                f"parallel.pp_stages_per_rank ≥ 2 (got {v}), or use parallel.pp_schedule=1f1b."
            )
        if v > 1 and self.pp == 1:
            raise ConfigError(
                f"parallel.pp_stages_per_rank={v} splits the pipeline further, but parallel.pp=1: "
                "set parallel.pp ≥ 2 for pipeline parallelism."
            )
        if self.pp_schedule != PipelineSchedule.interleaved_1f1b and v != 1:
            raise ConfigError(
                f"parallel.pp_stages_per_rank={v} needs parallel.pp_schedule=interleaved-1f1b "
                f"(parallel.pp_schedule={self.pp_schedule} runs one stage per rank)."
            )
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
            if self.pp != 1:
                raise ConfigError(
                    f"parallel.stack=fsdp is the data-parallel-only baseline: set parallel.pp=1 (got "
                    f"parallel.pp={self.pp}), or use parallel.stack=ddp for pipeline parallelism."
                )

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 2 if self.pp_schedule == PipelineSchedule.interleaved_1f1b else 1


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp: int
    ep: int
    pp: int = 1
    stages_per_rank: int = 1

    @classmethod
    def from_config(
        cls,
        cfg: ParallelConfig,
        world_size: int,
        num_experts: int,
        has_moe: bool = True,
        *,
        n_layers: int | None = None,
        micro_batches: int | None = None,
    ) -> ParallelDims:
        """Check the layout against the world size and the model (and, with pipeline
        parallelism, the number of layers and of micro-batches per step) before any work."""
        pp = cfg.pp
        if world_size % pp:
            raise ConfigError(
                f"parallel.pp={pp} does not divide the world size {world_size}: launch a multiple "
                f"of {pp} processes or change parallel.pp."
            )
        dp = cfg.dp if cfg.dp is not None else world_size // pp
        if pp * dp != world_size:
            raise ConfigError(
                f"The layout pp={pp} × dp={dp} = {pp * dp} ranks does not match the world size "
                f"{world_size}: set parallel.dp={world_size // pp} or launch {pp * dp} processes."
            )
        v = cfg.stages_per_rank
        if pp > 1 or v > 1:
            stages = pp * v
            if n_layers is not None and n_layers < stages:
                raise ConfigError(
                    f"model.n_layers={n_layers} cannot fill parallel.pp={pp} × "
                    f"parallel.pp_stages_per_rank={v} = {stages} pipeline stages (each needs a block): "
                    f"choose pp × stages-per-rank ≤ {n_layers}."
                )
            if micro_batches is not None:
                if micro_batches < pp:
                    raise ConfigError(
                        f"Pipeline parallelism needs at least parallel.pp={pp} micro-batches per step, "
                        f"got train.global_batch_size / train.micro_batch_size = {micro_batches}: "
                        f"lower train.micro_batch_size."
                    )
                if cfg.pp_schedule == PipelineSchedule.interleaved_1f1b and micro_batches % pp:
                    raise ConfigError(
                        f"parallel.pp_schedule=interleaved-1f1b needs a multiple of parallel.pp={pp} "
                        f"micro-batches per step, got train.global_batch_size / "
                        f"train.micro_batch_size = {micro_batches}."
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
        return cls(world_size=world_size, dp=dp, ep=cfg.ep, pp=pp, stages_per_rank=v)

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

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
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["pp"].get_group() if self.mesh is not None and self.dims.pp > 1 else None

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank() if self.mesh is not None else 0

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        return dist.group.WORLD if self.dims.world_size > 1 else None

    @property
    def ep_rank(self) -> int:
        return self.mesh["ep"].get_local_rank() if self.mesh is not None else 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0
