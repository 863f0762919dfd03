"""`ParallelDims`: the parallel layout and the device mesh that implements it; `ParallelState`:
the process groups one rank takes part in. `ParallelConfig.build` (src/moetrain/parallel/config.py)
makes the dims from the config, after checking them.

Ranks are laid out as (pp, dp, cp), cp fastest, and within a pipeline stage also as (edp, ep),
ep fastest:

    rank = pp_index · dp·cp + dp_index · cp + cp_index
         = pp_index · dp·cp + edp_index · ep + ep_index

- pp groups of dp·cp ranks each hold a different part of the layers (pipeline parallel); with
  `pp_stages_per_rank` = v > 1 a rank holds v non-adjacent stages (stage s on pp rank s mod pp);
- the dp·cp ranks of one stage ("replicas") hold the same dense parameters, whose gradients are
  averaged over them; they split the batch over dp (data parallel) and each sequence over cp
  consecutive ranks (context parallel: src/moetrain/parallel/context_parallel.py), so the key/value
  all-gathers stay within a node;
- within a stage, groups of ep consecutive ranks split the experts (expert parallel): tokens
  travel between them with all-to-all; the tokens of a sequence's cp shards route like any other
  tokens;
- ranks with the same ep_index across those groups hold the same experts: the expert-replica
  group "edp" (size dp·cp / ep) over which expert gradients are reduced.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:
    from moetrain.parallel.config import ParallelConfig


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """The run's layout, resolved for its world size (`ParallelConfig.build`): the degrees and how
    the ranks work together. The planner's `Layout` (src/moetrain/plan/layout.py) adds recompute and
    micro-batching to it; the console, the planner and the flag printer read it through `describe`
    and `to_flags`."""

    world_size: int
    dp: int
    ep: int
    pp: int = 1
    stages_per_rank: int = 1
    cp: int = 1
    stack: str = "ddp"
    schedule: str = "none"
    """The pipeline schedule (parallel.pp_schedule); "none" at pp 1."""
    shard_optimizer: bool = False
    dispatcher: str = "nosync"
    capacity_factor: float | None = 1.25
    """nosync: rows through each rank's experts ÷ the balanced load; None = padded (ep×)."""
    spill_factor: float = 0.125
    """nosync: spill rows per pair on the wire beyond the capacity, ÷ the balanced share."""
    overlap_chunks: int = 0
    """nosync: parallel.overlap_chunks (0: the all-to-alls are exposed)."""

    def describe(self) -> str:
        """`dp2·ep2 ddp nosync(cf 1.25 + spill 0.125) overlap×1 sharded-optimizer`: the words
        `LAYOUT_WORDS` (src/moetrain/parallel/config.py) explain."""
        parts = [f"dp{self.dp}"] + ([f"cp{self.cp}"] if self.cp > 1 else []) + ([f"ep{self.ep}"] if self.ep > 1 else [])
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f"×v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""))
        text = "·".join(parts) + f" {self.stack}"
        if self.ep > 1:
            text += f" {self.dispatcher}"
            if self.dispatcher == "nosync":
                cf, sf = self.capacity_factor, self.spill_factor
                text += f"(cf {cf:g}" + (f" + spill {sf:g})" if sf else ")") if cf else "(padded)"
                text += f" overlap×{self.overlap_chunks}" if self.overlap_chunks else ""
        return text + (" sharded-optimizer" if self.shard_optimizer else "")

    def to_flags(self, base: ParallelConfig) -> list[str]:
        """The command-line flags that turn the layout `base` builds into this one."""
        flags = []
        if self.shard_optimizer != base.shard_optimizer:
            flags.append(f"--parallel.shard_optimizer={str(self.shard_optimizer).lower()}")
        flags += [
            f"--parallel.{k}={getattr(self, k)}" for k in ("cp", "ep", "pp") if getattr(self, k) != getattr(base, k)
        ]
        if self.stack != base.stack:
            flags.append(f"--parallel.stack={self.stack}")
        if self.ep > 1 and self.dispatcher != base.dispatcher:
            flags.append(f"--parallel.dispatcher={self.dispatcher}")
        if self.ep > 1 and self.dispatcher == "nosync" and self.overlap_chunks != base.overlap_chunks:
            flags.append(f"--parallel.overlap_chunks={self.overlap_chunks}")
        return flags

    @property
    def replicas(self) -> int:
        """Ranks of one pipeline stage (dp · cp): they hold the same dense parameters."""
        return self.dp * self.cp

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def edp(self) -> int:
        """Size of an expert-replica group: ranks holding the same experts."""
        return self.replicas // self.ep

    def replica_ranks(self, rank: int) -> tuple[int, ...]:
        """The global ranks of `rank`'s pipeline stage, which hold the same dense parameters."""
        first = rank // self.replicas * self.replicas
        return tuple(range(first, first + self.replicas))

    def edp_ranks(self, rank: int) -> tuple[int, ...]:
        """The global ranks of `rank`'s expert-replica group: those holding the same experts."""
        first = rank // self.replicas * self.replicas
        ep_index = (rank - first) % self.ep
        return tuple(first + e * self.ep + ep_index for e in range(self.edp))

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The 3-D mesh (pp, edp, ep) and its flattened (edp, ep) sub-mesh "dp": a stage's
        dp·cp replicas. Needs an initialized process group of `world_size` ranks."""
        mesh = init_device_mesh(device_type, (self.pp, self.edp, self.ep), mesh_dim_names=("pp", "edp", "ep"))
        return mesh, mesh["edp", "ep"]._flatten("dp")

    def cp_ranks(self, rank: int) -> tuple[int, ...]:
        """The global ranks that split `rank`'s sequences: cp consecutive ranks."""
        first = rank // self.cp * self.cp
        return tuple(range(first, first + self.cp))

    def build_cp_group(self, rank: int) -> dist.ProcessGroup | None:
        """This rank's context-parallel group (None at cp 1). Collective: every rank makes every
        group, in the same order."""
        if self.cp == 1:
            return None
        mine, _ = dist.new_subgroups_by_enumeration(
            [list(self.cp_ranks(first)) for first in range(0, self.world_size, self.cp)]
        )
        return mine


@dataclasses.dataclass
class ParallelState:
    """The process groups one rank takes part in (None where the degree is 1)."""

    dims: ParallelDims
    mesh: DeviceMesh | None = None
    dp_mesh: DeviceMesh | None = None
    rank: int = 0
    rehearsed: bool = False
    cp_group: dist.ProcessGroup | None = None
    """This process is the one real rank of a rehearsal (src/moetrain/parallel/rehearsal.py): its
    peers are stand-ins inside the process groups, so it also does rank 0's host-side work (the
    run directory, completing checkpoints) and writes, for every peer, the checkpoint entries it
    holds that the peer would write (`ShardRole`, src/moetrain/train/checkpoint_io.py)."""

    @classmethod
    def create(cls, dims: ParallelDims, device_type: str, rank: int, rehearsed: bool = False) -> ParallelState:
        if dims.world_size == 1:
            return cls(dims, rank=rank)
        mesh, dp_mesh = dims.build_mesh(device_type)
        return cls(dims, mesh, dp_mesh, rank, rehearsed, dims.build_cp_group(rank))

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The stage's dp·cp replicas: gradients of dense parameters are averaged over them."""
        return self.dp_mesh.get_group() if self.dp_mesh is not None and self.dims.replicas > 1 else None

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return self.mesh["ep"].get_group() if self.mesh is not None and self.dims.ep > 1 else None

    @property
    def edp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["edp"].get_group() if self.mesh is not None and self.dims.edp > 1 else None

    @property
    def dp_rank(self) -> int:
        """Which of the dp slices of the batch this rank reads."""
        return self.replica_rank // self.dims.cp

    @property
    def cp_rank(self) -> int:
        """Which of the cp shards of its sequences this rank holds."""
        return self.replica_rank % self.dims.cp

    @property
    def replica_rank(self) -> int:
        """This rank's index among its stage's dp·cp replicas."""
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
        """The process that does the run's host-side bookkeeping: rank 0, or a rehearsal's rank."""
        return self.rank == 0 or self.rehearsed
