"""Layouts that fit, fastest first (`suggest`)."""

from __future__ import annotations

import dataclasses

from moetrain.errors import ConfigError
from moetrain.parallel.config import DispatcherKind, PipelineSchedule, Recompute, Stack
from moetrain.plan.estimate import Plan, plan
from moetrain.train.config import RunConfig


def with_layout(
    cfg: RunConfig,
    gpus: int,
    *,
    pp: int,
    ep: int,
    recompute: str,
    shard_optimizer: bool,
    rows: int,
    dispatcher: str | None = None,
    overlap: int | None = None,
) -> RunConfig | None:
    """A copy of `cfg` with another layout (rows = sequences per GPU per micro-batch; `overlap`:
    parallel.overlap_chunks, the configured one if None, 0 for other dispatchers than nosync),
    or None when the batch cannot be split that way or the chunks cannot split the experts."""
    if gpus % pp:
        return None
    dp = gpus // pp
    micro = rows * dp
    if cfg.train.global_batch_size % micro or cfg.train.global_batch_size // micro < pp:
        return None
    kind = DispatcherKind(dispatcher) if dispatcher else cfg.parallel.dispatcher
    overlap = cfg.parallel.overlap_chunks if overlap is None else overlap
    out = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            cfg.parallel,
            pp=pp,
            ep=ep,
            dp=None,
            shard_optimizer=shard_optimizer and dp > 1,
            dispatcher=kind,
            overlap_chunks=overlap if kind == DispatcherKind.nosync and ep > 1 else 0,
            pp_schedule=PipelineSchedule.onef1b,
            pp_stages_per_rank=None,
            stack=Stack.ddp,
        ),
        train=dataclasses.replace(cfg.train, micro_batch_size=micro, recompute=Recompute(recompute), recompute_every=1),
    )
    if out.parallel.overlap_problem(cfg.model.moe.num_experts):
        return None
    return out


def suggest(cfg: RunConfig, gpus: int, gpu: str, limit: int = 5) -> list[Plan]:
    """Layouts of the ddp stack that fit the GPU, fastest first: pp (dividing the GPUs, at most
    one block per stage), ep (dividing dp and the experts, at most one node's worth unless the
    experts need more), recompute none/selective/full, the sharded optimizer, and 1 or 2
    sequences per GPU per micro-batch; the configured dispatcher and, for ep > 2, the exact
    all-to-all one when the configured one is nosync's padded mode (its buffers grow with ep);
    with nosync at ep > 1 the configured parallel.overlap_chunks and 1 (the shared expert under
    the dispatch: no chunks, no cost of theirs)."""
    m = cfg.model
    out = []
    for pp in (1, 2, 4, 8, 16, 32):
        if pp > m.n_layers or gpus % pp:
            continue
        dp = gpus // pp
        eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if dp % e == 0 and m.moe.num_experts % e == 0]
        for ep in eps:
            for recompute in ("none", "selective", "full"):
                dispatchers = {cfg.parallel.dispatcher.value}
                if ep > 2 and cfg.parallel.capacity_factor is None:
                    dispatchers.add(DispatcherKind.alltoall.value)
                overlaps = sorted({cfg.parallel.overlap_chunks, 1}) if ep > 1 else [0]
                for rows, dispatcher, overlap in [
                    (r, d, o) for r in (1, 2) for d in sorted(dispatchers) for o in overlaps
                ]:
                    if overlap and dispatcher != DispatcherKind.nosync.value:
                        continue
                    candidate = with_layout(
                        cfg,
                        gpus,
                        pp=pp,
                        ep=ep,
                        recompute=recompute,
                        shard_optimizer=True,
                        rows=rows,
                        dispatcher=dispatcher,
                        overlap=overlap,
                    )
                    if candidate is None:
                        continue
                    try:
                        p = plan(candidate, gpus, gpu)
                    except ConfigError:
                        continue
                    if p.fits:
                        out.append(p)
    out.sort(key=lambda p: -p.tokens_per_sec_per_device)
    return out[:limit]
