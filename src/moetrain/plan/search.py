"""Layouts that fit, fastest first (`suggest`)."""

from __future__ import annotations

import dataclasses
import itertools

from moetrain.errors import ConfigError
from moetrain.parallel.config import DispatcherKind, PipelineSchedule, Recompute, Stack
from moetrain.plan.estimate import Plan, plan
from moetrain.plan.hardware import GPUS
from moetrain.train.config import RunConfig

LONG_SEQUENCE = 16_384
"""Sequences at least this long are where `suggest` also tries context parallelism."""
MAX_GPUS = 4096
"""The most GPUs `fewest_gpus` tries: beyond, a run is planned by hand (and the search would
keep `moetrain plan` from answering in seconds)."""


def with_layout(
    cfg: RunConfig,
    gpus: int,
    *,
    pp: int,
    ep: int,
    recompute: str,
    rows: int,
    dispatcher: str | None = None,
    overlap: int | None = None,
    cp: int = 1,
    round_batch: bool = False,
) -> RunConfig | None:
    """A copy of `cfg` with another layout of the ddp stack, its optimizer sharded over dp·cp > 1 ranks
    (rows = sequences per data-parallel rank per micro-batch, each split over `cp` GPUs; `overlap`:
    parallel.overlap_chunks, the configured one if None (auto where unset), auto for other dispatchers
    than nosync), or None when the batch or the sequence cannot be split that way or the chunks cannot
    split the experts. With `round_batch`, a global batch that is not a multiple of the micro-batch
    (rows · dp sequences) but holds one becomes the next multiple above it (less than one micro-batch more)."""
    if gpus % (pp * cp) or cfg.data.seq_len % (2 * cp):
        return None
    dp = gpus // (pp * cp)
    micro, batch = rows * dp, cfg.train.global_batch_size
    if round_batch and micro <= batch:
        batch = -(-batch // micro) * micro
    if batch % micro or batch // micro < pp:
        return None
    kind = DispatcherKind(dispatcher) if dispatcher else cfg.parallel.dispatcher
    overlap = cfg.parallel.overlap_chunks if overlap is None else overlap  # None: auto, for the candidate's ep
    out = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            cfg.parallel,
            pp=pp,
            ep=ep,
            cp=cp,
            dp=None,
            shard_optimizer=dp * cp > 1,
            dispatcher=kind,
            overlap_chunks=overlap if kind == DispatcherKind.nosync and ep > 1 else None,
            pp_schedule=PipelineSchedule.onef1b,
            pp_stages_per_rank=None,
            stack=Stack.ddp,
        ),
        train=dataclasses.replace(cfg.train, micro_batch_size=micro, global_batch_size=batch),
        compute=dataclasses.replace(cfg.compute, recompute=Recompute(recompute), recompute_every=1),
    )
    if out.parallel.overlap_problem(cfg.model.moe.num_experts, cfg.compute.defer_expert_weight_grad):
        return None
    return out


def _context_degrees(cfg: RunConfig, gpus: int, gpu: str) -> list[int]:
    """cp degrees `suggest` tries: 1, and for sequences of at least `LONG_SEQUENCE` tokens every
    power of two up to one node that splits the sequence into 2·cp chunks (the key/value
    exchange stays on NVLink)."""
    if cfg.data.seq_len < LONG_SEQUENCE:
        return [1]
    node = GPUS[gpu].gpus_per_node if gpu in GPUS else 8
    return [c for c in (1, 2, 4, 8, 16) if c <= min(node, gpus) and gpus % c == 0 and cfg.data.seq_len % (2 * c) == 0]


def suggest(cfg: RunConfig, gpus: int, gpu: str, limit: int = 5, round_batch: bool = False) -> list[Plan]:
    """Layouts of the ddp stack that fit the GPU: those with headroom (not `Plan.tight`) first,
    fastest first within each: pp (dividing the GPUs, at most one block per stage), cp for long
    sequences (`_context_degrees`), ep (dividing dp · cp and the experts), recompute
    none/selective/full, the sharded optimizer, 1 or 2 sequences per GPU per micro-batch; the
    configured dispatcher, and for ep > 2 the exact one where the configured one is nosync's
    padded mode (its buffers grow with ep); with nosync at ep > 1 the configured
    parallel.overlap_chunks and 1. `round_batch`: as `with_layout`'s."""
    out = _candidates(cfg, gpus, gpu, lean=False, round_batch=round_batch)
    out.sort(key=lambda p: (p.tight, -p.tokens_per_sec_per_device))
    return out[:limit]


def _candidates(cfg: RunConfig, gpus: int, gpu: str, lean: bool, round_batch: bool) -> list[Plan]:
    """The plans of `suggest`'s candidates that fit, unsorted; with `lean` only those that need
    least memory at each pp, cp and ep (full recompute, one sequence per micro-batch)."""
    out = []
    for pp in (1, 2, 4, 8, 16, 32):
        if pp > cfg.model.n_layers or gpus % pp:
            continue
        for cp in _context_degrees(cfg, gpus // pp, gpu):
            out += _fitting(cfg, gpus, gpu, pp, cp, lean, round_batch)
    return out


@dataclasses.dataclass(frozen=True)
class MoreGpus:
    """What `fewest_gpus` found above a GPU count where nothing fits."""

    gpus: int | None
    """The fewest GPUs with a layout that fits with headroom; None: none up to `MAX_GPUS`."""
    plan: Plan | None
    """`suggest`'s first layout there."""
    tight_gpus: int | None
    """Fewer GPUs than `gpus` (or any, when that is None) where layouts fit, but only `Plan.tight` ones."""


def larger_counts(gpus: int) -> list[int]:
    """The GPU counts `fewest_gpus` tries, ascending: powers of two, three times a power of two
    from one node of eight on (24, 48, …, 3072) and `gpus` doubled, above `gpus` and at most
    `MAX_GPUS`. The presets' batches are powers of two, which a count with a factor of three
    divides only with the batch rounded to its micro-batch (`fewest_gpus`' `round_batch`)."""
    shifts = range(MAX_GPUS.bit_length())
    counts = {2**k for k in shifts} | {24 << k for k in shifts} | {gpus << k for k in shifts}
    return sorted(n for n in counts if gpus < n <= MAX_GPUS)


def fewest_gpus(cfg: RunConfig, gpus: int, gpu: str, round_batch: bool = False) -> MoreGpus:
    """The fewest GPUs of kind `gpu`, more than `gpus`, on which `suggest` finds a layout with
    headroom (and fewer where layouts fit only tight). Each count plans the leanest candidates
    first: every other candidate needs more memory, so where none of them fits nothing does, and
    where each is tight the rest are too. `round_batch`: the candidates may round the global batch
    up to a multiple of their micro-batch (`with_layout`; then counts such as 24 or 96 GPUs take
    a power-of-two batch)."""
    tight = None
    for n in larger_counts(gpus):
        lean = _candidates(cfg, n, gpu, lean=True, round_batch=round_batch)
        if lean and all(p.tight for p in lean):
            tight = tight or n
        elif lean:
            return MoreGpus(n, suggest(cfg, n, gpu, limit=1, round_batch=round_batch)[0], tight)
    return MoreGpus(None, None, tight)


def _fitting(cfg: RunConfig, gpus: int, gpu: str, pp: int, cp: int, lean: bool, round_batch: bool) -> list[Plan]:
    """The plans of `suggest`'s candidates at pipeline degree `pp` and context degree `cp` that
    fit (with `lean`, only full recompute and one sequence per micro-batch; `round_batch`:
    `with_layout`'s)."""
    replicas = gpus // pp
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if replicas % e == 0 and cfg.model.moe.num_experts % e == 0]
    out, fixed = [], dict(pp=pp, cp=cp, round_batch=round_batch)
    recomputes = ("full",) if lean else ("none", "selective", "full")
    for ep, recompute in itertools.product(eps, recomputes):
        dispatchers = {cfg.parallel.dispatcher.value}
        if ep > 2 and cfg.parallel.capacity_factor is None:
            dispatchers.add(DispatcherKind.alltoall.value)
        overlaps = list(dict.fromkeys([cfg.parallel.overlap_chunks, 1])) if ep > 1 else [None]
        rows_options = (1, 2) if cp == 1 and not lean else (1,)
        for rows, dispatcher, overlap in itertools.product(rows_options, sorted(dispatchers), overlaps):
            if overlap and dispatcher != DispatcherKind.nosync.value:
                continue
            candidate = with_layout(
                cfg, gpus, ep=ep, recompute=recompute, rows=rows, dispatcher=dispatcher, overlap=overlap, **fixed
            )
            if candidate is None:
                continue
            try:
                p = plan(candidate, gpus, gpu)
            except ConfigError:
                continue
            if p.fits:
                out.append(p)
    return out
