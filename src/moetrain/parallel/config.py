"""Configuration of the parallel layout (`parallel.*`) and of activation recompute, and the
builder of the layout: `ParallelConfig.build(world_size)` -> `ParallelDims`.

Rules that involve only this section (and the world size) live here; rules that relate it to
the model, the batch or the device live in `RunConfig.validate` (src/moetrain/train/config.py).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import TYPE_CHECKING

from moetrain.config import Config, non_negative, positive
from moetrain.errors import ConfigError

if TYPE_CHECKING:
    from moetrain.parallel.dims import ParallelDims

DEFAULT_CAPACITY_FACTOR: float | None = 1.25
"""parallel.capacity_factor's default: each rank's experts get 1.25 × the balanced load (a slack
of 0.25, the capacity factor of Olmo-core's reference MoE runs), whatever ep, with counted drops
beyond it; None is the padded mode (dropless whatever the routing, ep × the exact exchange)."""
DEFAULT_CAPACITY_MIN_ROWS = 1024
"""parallel.capacity_min_rows where every row does not fit (auto): each rank's experts get at
least 1024 rows per MoE layer (R·C ≥ 1024), room for the uneven routing of few tokens
(docs/architecture.md, "Dispatcher memory")."""
EVERY_ROW = 2**40
"""parallel.capacity_min_rows as "every row": C = M, the padded mode's layout and numerics
(dropless whatever the routing) with capacity_factor kept for what a chunked exchange needs."""
DEFAULT_SPILL_FACTOR = 0.125
"""parallel.spill_factor's default: a small spill, 1/8 of a pair's balanced share, on the wire."""
MAX_ROW_FACTOR = 1024
"""The largest parallel.capacity_factor / spill_factor: past ep (the padded mode's rows) more
rows buy nothing, and no expert-parallel group is this large."""
AUTO_OVERLAP_CHUNKS = 2
"""parallel.overlap_chunks auto on GPUs: docs/measurements.md, "The projected 8-GPU sweep"."""
MAX_DEGREE = 2**20
"""The largest parallel degree (dp, ep, pp, stages per rank) a config may ask for."""


class Recompute(enum.StrEnum):
    none = "none"
    full = "full"
    """Per-layer activation recompute: keep only each block's input, recompute the block
    during backward."""
    selective = "selective"
    """Keep what is expensive to recompute — the outputs of matrix products (linear layers,
    grouped expert GEMMs, attention) and of communication — and recompute the cheap element-wise
    work (norms, RoPE, the SwiGLU activation, routing scores, permutations) during backward."""


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
    """Fixed-size buffers, no device-to-host sync; what finds no room is dropped and counted
    (parallel.capacity_factor; src/moetrain/parallel/nosync_dispatcher.py)."""
    alltoall = "alltoall"
    """Exact split sizes, read on the host once per layer: dropless, least memory."""


@dataclasses.dataclass(kw_only=True)
class ParallelConfig(Config):
    stack: Stack = Stack.ddp
    """Which parallel stack trains the model: `ddp` (resident experts, expert parallelism) or
    `fsdp` (the FSDP2 baseline, for comparing the stacks on the same model, data and batch)."""
    dp: int | None = positive(None, at_most=MAX_DEGREE)
    """Data-parallel degree (how many slices the batch is split into); None = every rank left
    (world size / (pp · cp))."""
    cp: int = positive(1, at_most=MAX_DEGREE)
    """Context-parallel degree: each sequence is split over cp consecutive ranks (2 · cp chunks,
    rank i holding chunks i and 2·cp − 1 − i so that causal attention costs every rank the same),
    which all-gather the keys and values of each attention layer
    (src/moetrain/parallel/context_parallel.py). Activations per rank ÷ cp, for long sequences.
    Divides nothing else: world size = pp · dp · cp; data.seq_len must be a multiple of 2 · cp."""
    ep: int = positive(1, at_most=MAX_DEGREE)
    """Expert-parallel degree: experts are split over groups of ep ranks. Divides dp · cp (the
    ranks of one pipeline stage) and the number of experts."""
    pp: int = positive(1, at_most=MAX_DEGREE)
    """Pipeline-parallel degree: the layers are split into pp × pp_stages_per_rank stages. The
    micro-batches of a step (train.global_batch_size / train.micro_batch_size, at least pp) are
    the pipeline's micro-batches."""
    pp_schedule: PipelineSchedule = PipelineSchedule.onef1b
    """Pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b or interleaved-1f1b."""
    pp_stages_per_rank: int | None = positive(None, at_most=MAX_DEGREE)
    """Stages per pipeline rank; None = 1 (gpipe, 1f1b) or 2 (interleaved-1f1b)."""

    dispatcher: DispatcherKind = DispatcherKind.nosync
    """How tokens reach experts on other ranks (with ep > 1): nosync or alltoall."""
    compile_overlap: bool = False
    """Experimental. With compute.compile: let Inductor move the collectives inside each compiled
    block (the expert all-to-alls) ahead of independent compute, so they overlap it. Off by
    default: measured on one layout only (docs/measurements.md, "At the preset's batch")."""
    shard_optimizer: bool = False
    """Distributed optimizer: fp32 master weights and AdamW moments sharded over the data-parallel
    ranks (gradients reduce-scattered, parameters all-gathered): optimizer memory ÷ dp."""
    timeout_s: float = positive(600.0, at_most=10**9, unit="seconds")
    """Collective timeout: a collective that has not completed after this long fails."""
    peer_timeout_s: float = positive(120.0, at_most=10**9, unit="seconds")
    """A rank whose heartbeat (one tick a second from a background thread) stands still this long
    is declared dead or hung: the rank watching it (ranks watch their successor in a ring) stops
    the run with an error naming it, instead of waiting out a collective timeout."""
    capacity_factor: float | None = positive(DEFAULT_CAPACITY_FACTOR, at_most=MAX_ROW_FACTOR)
    """nosync only: the rows each rank's experts get, as a multiple of the balanced load (its
    share of the assignments of the EP group): f · assignments, C = ceil(f · assignments / ep)
    guaranteed to each source (R·C at least parallel.capacity_min_rows) and the rest shared by the
    sources' spill rows. Assignments that find no room are dropped (zero output) and counted in
    dropped_token_frac. null = the padded mode: dropless whatever the routing, at ep × the
    memory and bytes of the exact exchange (docs/architecture.md, "Dispatcher memory")."""
    capacity_min_rows: int | None = non_negative(None, at_most=EVERY_ROW)
    """nosync only: the fewest rows a rank's experts get per MoE layer (C ≥ min_rows / ep per
    source, never more than all of a source's assignments), whatever capacity_factor gives; 0 =
    no floor. null (auto, the default): on CPUs every row (nothing dropped) where the planner's
    peak with those buffers fits the machine's memory and parallel.overlap_chunks ≤ 1; else, and
    on GPUs, 1024 (`moetrain.plan.capacity_floor`; the run says which at start)."""
    spill_factor: float = non_negative(DEFAULT_SPILL_FACTOR, at_most=MAX_ROW_FACTOR)
    """nosync only: spill rows per (source, destination) pair beyond C, as a multiple of the
    balanced share (ceil(s · assignments / ep)); they carry a pair's overflow into the rows other
    sources leave unused at that destination. Bytes on the wire: (capacity_factor + s) × the
    exact exchange's. 0 = no spill: each pair's block holds C rows."""

    overlap_chunks: int | None = non_negative(None, at_most=64)
    """nosync only: 0 = each MoE layer's all-to-alls are waited for (the step pays them in full);
    n ≥ 1 = they run asynchronously beside compute, the layer's exchange split into n
    (src/moetrain/parallel/overlapped_dispatcher.py): chunk i + 1 travels while chunk i's experts
    compute. The chunks split each rank's experts where n divides them, else its tokens; n > 1
    needs a bounded capacity and 1/n of it goes to each chunk, so under skew a chunk may drop what
    the whole would keep. null (auto, the default): `AUTO_OVERLAP_CHUNKS` on GPUs where the
    exchange is bounded (`RunConfig.overlap_chunks`), 0 elsewhere."""

    def overlap_problem(self, num_experts: int, defer_expert_weight_grad: bool = False) -> str | None:
        """Why overlap_chunks cannot split the exchange of `num_experts` experts over ep ranks
        (None: it can, or there is no exchange)."""
        n = self.overlap_chunks or 0
        if n <= 1 or self.ep <= 1 or self.dispatcher != DispatcherKind.nosync:
            return None
        if self.capacity_factor is None:
            return (
                f"parallel.overlap_chunks={n} needs a bounded capacity: the padded mode "
                "(parallel.capacity_factor=null) would need n × its buffers. Set parallel.capacity_factor "
                f"(default {DEFAULT_CAPACITY_FACTOR}), or parallel.overlap_chunks=1."
            )
        local = num_experts // self.ep
        if local % n and defer_expert_weight_grad:
            fits = [d for d in range(2, local + 1) if local % d == 0]
            return (
                f"parallel.overlap_chunks={n} does not divide the {local} experts each rank holds, so it "
                "splits the tokens, and each expert runs once per chunk; compute.defer_expert_weight_grad "
                "keeps one product per expert and micro-batch: set compute.defer_expert_weight_grad=false, "
                "or parallel.overlap_chunks=1" + (f" or one of {', '.join(map(str, fits))}." if fits else ".")
            )
        return None

    def validate(self) -> None:
        if self.dispatcher != DispatcherKind.nosync:
            for name, default in (
                ("capacity_factor", DEFAULT_CAPACITY_FACTOR),
                ("spill_factor", DEFAULT_SPILL_FACTOR),
                ("capacity_min_rows", None),
            ):
                value = getattr(self, name)
                # null capacity (the old default, in configs saved before 1.25 was) means exact too
                if value != default and not (name == "capacity_factor" and value is None):
                    shown = "null" if value is None else f"{value:g}"  # as written on the command line
                    raise ConfigError(
                        f"parallel.{name}={shown} applies to parallel.dispatcher=nosync only; the "
                        f"{self.dispatcher} dispatcher is always dropless: drop the setting or use "
                        "parallel.dispatcher=nosync."
                    )
            if self.overlap_chunks is not None:
                raise ConfigError(
                    f"parallel.overlap_chunks={self.overlap_chunks} pipelines the nosync dispatcher's "
                    f"all-to-alls; the {self.dispatcher} dispatcher does not overlap them: drop the "
                    "setting or use parallel.dispatcher=nosync."
                )
        v = self.stages_per_rank  # the degrees are positive: their domains, checked first (`validate_tree`)
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

    def build(self, world_size: int) -> ParallelDims:
        """The layout on `world_size` ranks: pp · cp divides the world, dp fills the rest (or is
        given and must fit), ep divides dp · cp. Rules that also involve the model or the batch
        are `RunConfig.validate`'s."""
        from moetrain.parallel.dims import ParallelDims

        pp, cp = self.pp, self.cp
        if world_size % pp:
            raise ConfigError(
                f"parallel.pp={pp} does not divide the world size {world_size}: launch a multiple "
                f"of {pp} processes or change parallel.pp."
            )
        if world_size % (pp * cp):
            raise ConfigError(
                f"parallel.pp={pp} × parallel.cp={cp} = {pp * cp} does not divide the world size {world_size}: "
                f"launch a multiple of {pp * cp} processes or change parallel.cp."
            )
        dp = self.dp if self.dp is not None else world_size // (pp * cp)
        if pp * dp * cp != world_size:
            shape = f"pp={pp} × dp={dp}" + (f" × cp={cp}" if cp > 1 else "")
            raise ConfigError(
                f"The layout {shape} = {pp * dp * cp} ranks does not match the world size "
                f"{world_size}: set parallel.dp={world_size // (pp * cp)} or launch {pp * dp * cp} processes."
            )
        if (dp * cp) % self.ep:
            where = f"parallel.dp={dp}" if cp == 1 else f"parallel.dp={dp} × parallel.cp={cp} = {dp * cp}"
            raise ConfigError(
                f"parallel.ep={self.ep} does not divide {where}: expert-parallel groups are "
                f"made of the ranks of one pipeline stage. Launch {pp * cp * self.ep}·k ranks "
                f"(torchrun --nproc-per-node={pp * cp * self.ep} -m moetrain …, or --rehearse "
                f"{pp * cp * self.ep} to measure one of them) or lower parallel.ep."
            )
        return ParallelDims(
            world_size=world_size,
            dp=dp,
            ep=self.ep,
            pp=pp,
            stages_per_rank=self.stages_per_rank,
            cp=cp,
            stack=self.stack.value,
            schedule=self.pp_schedule.value if pp > 1 else "none",
            shard_optimizer=self.shard_optimizer,
            dispatcher=self.dispatcher.value,
            capacity_factor=self.capacity_factor,
            spill_factor=self.spill_factor,
            overlap_chunks=self.overlap_chunks or 0,
        )

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 2 if self.pp_schedule == PipelineSchedule.interleaved_1f1b else 1


LAYOUT_WORDS = (
    (r"\bdp\d", "dpN: N data-parallel ranks (parallel.dp; with cp and pp they multiply to the GPUs)"),
    (r"\bcp\d", "cpN: each sequence split over N GPUs (context parallelism, parallel.cp)"),
    (r"\bep\d", "epN: the experts split over N GPUs, tokens sent to them (expert parallelism, parallel.ep)"),
    (r"\bpp\d", "ppN: the layers split into N pipeline stages (parallel.pp); ×vV: V stages per rank, interleaved"),
    (r"\b(ddp|fsdp)\b", "ddp / fsdp: the stack (parallel.stack): replicated dense weights, or FSDP2's shards"),
    (
        r"\b(nosync|alltoall)\b",
        "nosync / alltoall: the expert dispatcher (parallel.dispatcher): fixed-size buffers "
        "without a host sync / exact sizes read on the host",
    ),
    (r"\bcf ", "cf F: capacity factor, each rank's experts take F × the balanced load (parallel.capacity_factor)"),
    (
        r"\bspill ",
        "spill S: extra rows per pair of ranks for a pair's overflow, S × its balanced share (parallel.spill_factor)",
    ),
    (r"\(padded\)", "padded: nosync without a capacity factor, ep × the exact exchange's rows (dropless)"),
    (
        r"overlap×",
        "overlap×N: the all-to-all runs beside compute in N chunks (parallel.overlap_chunks; ×1: one "
        "exchange, under the shared expert)",
    ),
    (r"sharded-optimizer", "sharded-optimizer: optimizer state sharded over the data-parallel ranks"),
    (r"recompute=", "recompute=full|selective: activations recomputed in backward (/every N: every Nth block)"),
)
"""(pattern, meaning) of each abbreviation `ParallelDims.describe` (src/moetrain/parallel/dims.py)
and the planner's `Layout.describe` write, for the legend under `moetrain plan`'s output and in
its --help (here, so that --help loads no torch)."""


def layout_legend(texts: list[str] | None = None) -> list[str]:
    """The meanings of `LAYOUT_WORDS` that occur in `texts` (layouts as `ParallelDims.describe` writes
    them); all of them when `texts` is None."""
    return [meaning for pattern, meaning in LAYOUT_WORDS if texts is None or any(re.search(pattern, t) for t in texts)]
