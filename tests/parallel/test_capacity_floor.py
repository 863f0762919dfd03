"""The default sync-free dispatcher's capacity: each source's C = 1.25 × a pair's balanced share,
with the rank's experts' R·C at least parallel.capacity_min_rows (1024), and C at most all of a
source's M assignments. At GPU scale the floor is inactive (1.25 × the exact dispatcher's rows,
whatever ep); a small micro-batch gets every row, the padded mode's layout, which never drops.
The planner and the dispatcher use one formula."""

import math

import pytest

from moetrain.parallel.config import DEFAULT_CAPACITY_FACTOR, DEFAULT_CAPACITY_MIN_ROWS, ParallelConfig
from moetrain.parallel.nosync_dispatcher import block_rows, capacity_rows
from moetrain.testing.distributed import run_distributed


def test_the_default_is_bounded_with_a_floor():
    cfg = ParallelConfig()
    assert (cfg.dispatcher.value, cfg.capacity_factor, cfg.capacity_min_rows) == ("nosync", 1.25, 1024)
    assert (DEFAULT_CAPACITY_FACTOR, DEFAULT_CAPACITY_MIN_ROWS) == (1.25, 1024)


@pytest.mark.parametrize("ep", [2, 4, 8, 64])
def test_capacity_rows_at_scale_and_small(ep):
    f, floor = DEFAULT_CAPACITY_FACTOR, DEFAULT_CAPACITY_MIN_ROWS
    big = 8192 * 4  # one 8192-token sequence, top-4: a pair's share is in the thousands
    C = capacity_rows(big, ep, f, floor)
    assert C == math.ceil(1.25 * big / ep) and ep * C <= 1.25 * big + ep  # the bound, rounding aside
    assert block_rows(big, ep, f, 0.125, floor) == C + math.ceil(0.125 * big / ep)
    # M = 820 assignments a rank: 1.25 × 820 is just above the floor; below, the floor takes over
    assert ep * capacity_rows(820, ep, f, floor) >= 1025 and ep * capacity_rows(820, ep, f, floor) < 1025 + ep
    assert capacity_rows(819 * 2, 2, f, floor) == math.ceil(1.25 * 819)
    assert capacity_rows(800, ep, f, floor) == min(math.ceil(1024 / ep), 800)
    # a small micro-batch: every row (the padded mode's C = M), also with a spill
    for small in (8, 1024 // ep):
        assert capacity_rows(small, ep, f, floor) == small == block_rows(small, ep, f, 0.125, floor)
        assert capacity_rows(small, ep, None) == small  # the padded mode
    assert capacity_rows(256, ep, f, 0) == min(math.ceil(1.25 * 256 / ep), 256)  # no floor


def _dispatcher_rows(world):
    """The dispatcher `apply_expert_parallel` builds from the default config: its C for a small
    micro-batch and for a large one."""
    import torch.distributed as dist

    from moetrain.model.config import MoEConfig, TransformerConfig
    from moetrain.parallel.dims import ParallelState
    from moetrain.parallel.expert_parallel import apply_expert_parallel
    from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher

    state = ParallelState.create(ParallelConfig(ep=world).build(world), "cpu", dist.get_rank())
    model = TransformerConfig(
        vocab_size=64,
        d_model=32,
        n_layers=1,
        num_dense_layers=0,
        n_heads=2,
        n_kv_heads=1,
        moe=MoEConfig(num_experts=4, top_k=2),
    ).build(device="meta")
    apply_expert_parallel(model, state, ParallelConfig(ep=world))
    (moe,) = model.moe_layers()
    assert isinstance(moe.dispatcher, NoSyncDispatcher)
    return moe.dispatcher.capacity(64, 2), moe.dispatcher.capacity(8192, 2), moe.dispatcher.min_rows


def test_the_trainers_dispatcher_takes_the_configs_floor():
    for small, big, floor in run_distributed(_dispatcher_rows, 2, 2):  # world 2, ep 2
        assert (small, big, floor) == (128, math.ceil(1.25 * 8192 * 2 / 2), 1024)


def test_the_planner_counts_the_floor():
    """At scale the experts get 1.25 × K rows per token and the wire carries 1.375 × K; a tiny
    micro-batch gets the padded mode's ep × K."""
    from moetrain.plan import layout_of, rows_per_token
    from moetrain.presets import resolve_config

    small = ["train.micro_batch_size=2", "train.global_batch_size=2", "data.seq_len=32"]  # 32 tokens a rank
    for spec, ep, extra, want in (("sweep-8l-128", 8, [], (1.25, 1.375)), ("tiny", 2, small, (2.0, 2.0))):
        cfg = resolve_config(spec, [f"parallel.ep={ep}", *extra], validate=False)
        layout = layout_of(cfg, 8 if ep == 8 else 2)
        k = cfg.model.moe.top_k
        expert_rows, wire_rows = rows_per_token(cfg, layout)
        assert expert_rows == pytest.approx(want[0] * k, rel=1e-3) and wire_rows == pytest.approx(want[1] * k, rel=1e-3)
