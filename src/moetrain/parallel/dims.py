"""`ParallelDims`: the parallel layout and its named axes; `ParallelState`: the process groups one
rank takes part in, by axes. `ParallelConfig.build` (src/moetrain/parallel/config.py) makes the
dims from the config, after checking them.

Each axis (`ParallelDims.axes`) has a size and a stride: a rank's index along it is
rank // stride mod size. Ranks are laid out as (pp, dp, cp), cp fastest, and within a pipeline
stage also as (edp, ep), ep fastest:

    rank = pp_index · dp·cp + dp_index · cp + cp_index
         = pp_index · dp·cp + edp_index · ep + ep_index

- pp groups of dp·cp ranks each hold a different part of the layers (pipeline parallel);
- the dp·cp ranks of one stage ("replicas") hold the same dense parameters, whose gradients are
  averaged over them; they split the batch over dp and each sequence over cp consecutive ranks
  (so the key/value all-gathers stay within a node);
- within a stage, groups of ep consecutive ranks split the experts (expert parallel);
- ranks with the same ep_index across those groups hold the same experts: the expert-replica
  axis "edp" (size dp·cp / ep), over which expert gradients are reduced.

A set of axes names a group: the ranks that differ from a rank only along those axes
(`ParallelDims.ranks`). `ParallelState.group(*axes)` is its process group and
`ParallelState.index(*axes)` the rank's place in it. A new dimension is an axis here, its groups
in `GROUPS`, and its apply function in `parallelize` (src/moetrain/parallel/parallelize.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

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

    @property
    def axes(self) -> dict[str, tuple[int, int]]:
        """Each named axis's (size, stride): a rank's index along it is rank // stride mod size."""
        return {
            "pp": (self.pp, self.replicas),
            "dp": (self.dp, self.cp),
            "cp": (self.cp, 1),
            "edp": (self.edp, self.ep),
            "ep": (self.ep, 1),
        }

    def index(self, rank: int, *axes: str) -> int:
        """`rank`'s place in its group over `axes` (`ranks`): its rank in that process group."""
        place = 0
        for size, stride in sorted((self.axes[a] for a in axes), key=lambda axis: -axis[1]):
            place = place * size + rank // stride % size
        return place

    def ranks(self, rank: int, *axes: str) -> tuple[int, ...]:
        """The global ranks that differ from `rank` only along `axes` (axes of one factorization),
        ascending: ("dp", "cp") the ranks holding its dense parameters, ("edp",) its experts."""
        group = [rank - sum(rank // stride % size * stride for size, stride in (self.axes[a] for a in axes))]
        for size, stride in (self.axes[a] for a in axes):
            group = [r + i * stride for r in group for i in range(size)]
        assert len(set(group)) == len(group), f"axes {axes} overlap"
        return tuple(sorted(group))


GROUPS = (("pp",), ("dp", "cp"), ("cp",), ("edp",), ("ep",))
"""The axis sets whose process groups every rank makes, in this order (the world's is the default
group, `("pp", "dp", "cp")`)."""


@dataclasses.dataclass
class ParallelState:
    """The process groups one rank takes part in, by axes (`group`), and its place in them (`index`)."""

    dims: ParallelDims
    rank: int = 0
    rehearsed: bool = False
    """This process is the one real rank of a rehearsal (src/moetrain/parallel/rehearsal.py): its
    peers are stand-ins inside the process groups, so it also does rank 0's host-side work (the
    run directory, completing checkpoints) and writes, for every peer, the checkpoint entries it
    holds that the peer would write (`ShardRole`, src/moetrain/train/checkpoint_io.py)."""
    groups: dict[frozenset[str], dist.ProcessGroup] = dataclasses.field(default_factory=dict)
    """This rank's process group for each axis set of `GROUPS` with more than one rank, and the world."""
    mesh: DeviceMesh | None = None
    """The stage's dp·cp replicas as a 1-D device mesh (FSDP's `fully_shard` takes one); None at dp·cp 1."""

    @classmethod
    def create(cls, dims: ParallelDims, device_type: str, rank: int, rehearsed: bool = False) -> ParallelState:
        """Collective: every rank makes every group, in the same order."""
        state = cls(dims, rank, rehearsed)
        if dims.world_size == 1:
            return state
        state.groups[frozenset(("pp", "dp", "cp"))] = dist.group.WORLD
        for axes in GROUPS:
            if math.prod(dims.axes[a][0] for a in axes) > 1:
                firsts = [r for r in range(dims.world_size) if dims.index(r, *axes) == 0]
                mine, _ = dist.new_subgroups_by_enumeration([list(dims.ranks(r, *axes)) for r in firsts])
                state.groups[frozenset(axes)] = mine
        if dims.replicas > 1:
            state.mesh = DeviceMesh.from_group(state.group("dp", "cp"), device_type, mesh_dim_names=("dp",))
        return state

    def group(self, *axes: str) -> dist.ProcessGroup | None:
        """The process group of this rank and those differing from it only along `axes`
        (`ParallelDims.ranks`; None when that is this rank alone): ("dp", "cp") the stage's
        replicas, over which dense gradients are averaged; ("edp",) the expert replicas;
        ("pp", "dp", "cp") the world."""
        if math.prod(self.dims.axes[a][0] for a in axes) == 1:
            return None
        return self.groups[frozenset(axes)]

    def index(self, *axes: str) -> int:
        """This rank's place among `dims.ranks(rank, *axes)` (its rank in `group(*axes)`): ("dp",)
        the batch slice it reads, ("cp",) the shard of its sequences it holds, ("pp",) its pipeline rank."""
        return self.dims.index(self.rank, *axes)

    @property
    def is_main(self) -> bool:
        """The process that does the run's host-side bookkeeping: rank 0, or a rehearsal's rank."""
        return self.rank == 0 or self.rehearsed
