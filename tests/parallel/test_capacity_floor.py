"""The sync-free dispatcher's capacity: each source's C = 1.25 × a pair's balanced share, with the
rank's experts' R·C at least parallel.capacity_min_rows, and C at most all of a source's M
assignments. The floor's default (auto) is every row, which never drops, on CPUs where the
planner finds those buffers fit the machine's memory; else, and on GPUs, 1024 rows. At GPU
scale 1024 is inactive (1.25 × the exact dispatcher's rows, whatever ep); a small micro-batch
gets every row either way. The planner and the dispatcher use one formula."""

import math

import pytest
from support.distributed import run_distributed

from moetrain.parallel.config import DEFAULT_CAPACITY_FACTOR, DEFAULT_CAPACITY_MIN_ROWS, EVERY_ROW, ParallelConfig
from moetrain.parallel.nosync_dispatcher import block_rows, capacity_rows


def test_the_default_is_bounded_with_an_automatic_floor():
    cfg = ParallelConfig()
    assert (cfg.dispatcher.value, cfg.capacity_factor, cfg.capacity_min_rows) == ("nosync", 1.25, None)
    assert (DEFAULT_CAPACITY_FACTOR, DEFAULT_CAPACITY_MIN_ROWS) == (1.25, 1024)


def test_auto_takes_every_row_on_a_cpu_where_it_fits():
    """`capacity_floor`: the README's CPU example (tiny, dp4·ep2) gets every row; on a GPU the
    floor is 1024 (the planner models every row at +23% of this run's step on an H100, +136% of
    sweep-8l-8's at ep8); so it is where every row does not fit, with a chunked exchange (n × the
    buffers), and without a bound to lift; a value set is kept."""
    from moetrain.plan import GIB, capacity_floor
    from moetrain.presets import resolve_config

    tiny = resolve_config("tiny", ["parallel.ep=2"])
    rows, why = capacity_floor(tiny, 4, 64 * GIB, None)
    assert rows == EVERY_ROW and "fits" in why
    rows, why = capacity_floor(tiny, 4, 64 * GIB, "h100")
    assert rows == 1024 and "on a GPU" in why
    assert capacity_floor(tiny, 4, 0.5 * GIB, None)[0] == 1024  # needs a modelled 1.1 GiB
    sweep = resolve_config("sweep-8l-8", ["parallel.ep=8", "model.n_layers=4"])
    assert capacity_floor(sweep, 8, 78 * GIB, "h100")[0] == 1024
    for flags, rows in (
        (["parallel.overlap_chunks=2"], 1024),
        (["parallel.capacity_factor=null"], 1024),
        (["parallel.capacity_min_rows=0"], 0),
        (["parallel.dispatcher=alltoall"], None),
    ):
        cfg = resolve_config("tiny", ["parallel.ep=2", *flags])
        assert capacity_floor(cfg, 4, 64 * GIB, None) == (rows, None)


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


def test_an_unresolved_floor_builds_the_bounded_dispatcher():
    for small, big, floor in run_distributed(_dispatcher_rows, 2, 2):  # world 2, ep 2
        assert (small, big, floor) == (128, math.ceil(1.25 * 8192 * 2 / 2), 1024)


def test_the_planner_counts_the_floor():
    """At scale the experts get 1.25 × K rows per token and the wire carries 1.375 × K; a tiny
    micro-batch gets the padded mode's ep × K."""
    from moetrain.plan import layout_of, rows_per_token
    from moetrain.presets import resolve_config

    small = ["train.micro_batch_size=2", "train.global_batch_size=2", "data.seq_len=32"]  # 32 tokens a rank
    for spec, ep, extra, want in (("sweep-8l-128", 8, [], (1.25, 1.375)), ("tiny", 2, small, (2.0, 2.0))):
        flags = [f"parallel.ep={ep}", "parallel.capacity_min_rows=1024", *extra]
        cfg = resolve_config(spec, flags, validate=False)
        layout = layout_of(cfg, 8 if ep == 8 else 2)
        k = cfg.model.moe.top_k
        expert_rows, wire_rows = rows_per_token(cfg, layout)
        assert expert_rows == pytest.approx(want[0] * k, rel=1e-3) and wire_rows == pytest.approx(want[1] * k, rel=1e-3)


def _train(data_dir, run_dir, *extra):
    """tiny at dp2·ep2 for 2 steps under torchrun (as the README's CPU example runs): its records
    and what it printed."""
    import os
    import subprocess
    import sys

    from conftest import tiny_overrides

    from moetrain.train.metrics import read_metrics

    flags = [f"--{o}" for o in tiny_overrides(data_dir, run_dir, "train.eval_every=0", "train.steps=2", *extra)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "moetrain", "train", "tiny", *flags, "--parallel.ep=2", "--parallel.capacity_factor=0.5"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return read_metrics(run_dir / "metrics.jsonl"), done.stdout + done.stderr


def test_a_cpu_run_takes_every_row_by_default_and_drops_nothing(real_text_dir, tmp_path):
    """Under a capacity that binds (capacity_factor 0.5: half the balanced load), the floor's
    default lifts it on the CPU, where every row fits: nothing is dropped, and the run says why;
    with no floor the same run drops and counts it."""
    bound, _ = _train(real_text_dir, tmp_path / "bound", "parallel.capacity_min_rows=0")
    assert all(r["dropped_token_frac"] > 0.2 for r in bound), [r["dropped_token_frac"] for r in bound]
    auto, said = _train(real_text_dir, tmp_path / "auto")
    assert [r["dropped_token_frac"] for r in auto] == [0.0, 0.0]
    assert "parallel.capacity_min_rows=auto: every row, no expert assignment dropped" in said, said[-2000:]
