"""The overlapped exchange (parallel.overlap_chunks, src/moetrain/parallel/overlapped_dispatcher.py)
against the plain dispatch → experts → combine (+ shared expert) on gloo ranks at ep 2, 4 and 8
(ep = world; 8, 4 and 2 local experts).

- n = 1 chunk, and n = 2 and n = L chunks by experts with room for every row: outputs and every
  gradient are the plain path's bit for bit, under balanced, skewed and all-to-one routing;
- n = 3 chunks, which split no rank's experts, so they split the tokens: outputs and every
  gradient within rounding (each expert's products over fewer rows, its weight gradient a sum of
  n);
- in the bounded mode, under all-to-one routing, each chunk drops exactly its own overflow;
- the schedule: the order in which exchanges start and finish, forward and backward, around the
  experts and the shared expert, is the overlapping one the docstring promises;
- no host synchronization, and the dispatch's peak allocation stays that of the plain path;
- the padded mode's chunks, and token chunks with deferred expert weight gradients, are refused
  by the config.

Legend as tests/parallel/test_nosync_capacity.py, whose routing and experts these reuse."""

from types import SimpleNamespace

import pytest
import torch
from support.distributed import run_distributed
from test_nosync_capacity import (
    BOUNDED,
    TOL,
    Allocations,
    D,
    E,
    K,
    N,
    case_counts,
    local_experts,
    reference_keep,
    relative_diff,
    routing_ids,
)

DEFER = "compute.defer_expert_weight_grad=true"


def chunk_counts(R):
    """The chunk counts by experts that split the L = E / R local experts: 2 and L."""
    return sorted({2, E // R})


TOKEN_CHUNKS = 3
"""A chunk count that splits no rank's experts (L = 8, 4 or 2): chunks by tokens."""


def make_shared():
    from moetrain.model.mlp import SwiGLU

    torch.manual_seed(1)
    shared = SwiGLU(D, 16)
    with torch.no_grad():
        for p in shared.parameters():
            p.normal_(0, 0.3)
    return shared


def route_of(ids_NK, w_NK):
    """What `expert_step` reads of the router's output."""
    return SimpleNamespace(
        topk_ids_NK=ids_NK, topk_weights_NK=w_NK, tokens_per_expert_E=torch.bincount(ids_NK.flatten(), minlength=E)
    )


def dispatcher(group, chunks, factor, **kw):
    """The plain sync-free dispatcher (`chunks` 0) or the overlapped one."""
    from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher
    from moetrain.parallel.overlapped_dispatcher import OverlappedDispatcher

    if chunks:
        return OverlappedDispatcher(E, group, group, factor, chunks=chunks, **kw)
    return NoSyncDispatcher(E, group, group, factor, **kw)


def run(disp, x0_ND, ids_NK, w0_NK, grad_ND, rank, R, poison=True):
    """One forward and backward of the layer's expert step."""
    local, forward = local_experts(rank, R, poison)
    shared = make_shared()
    x, w = x0_ND.clone().requires_grad_(), w0_NK.clone().requires_grad_()
    y = disp.expert_step(x, route_of(ids_NK, w), forward, shared)
    (y * grad_ND).sum().backward()
    grads = [y.detach(), x.grad, w.grad, local.w_gate_up_E2FD.grad, local.w_down_EDF.grad]
    grads += [p.grad for p in shared.parameters()]
    dropped = disp.dropped_tokens()
    return grads, None if dropped is None else int(dropped)


def inputs(case, rank, R, C, W):
    ids_NK = routing_ids(case_counts(case, rank, R, C, W), rank)
    g = torch.Generator().manual_seed(70 + rank)
    return ids_NK, torch.randn(N, D, generator=g), torch.rand(N, K, generator=g) + 0.5, torch.randn(N, D, generator=g)


ROOMY = 10**6
"""capacity_min_rows that gives every chunk every row (C = M): nothing is dropped, whatever the
routing, in either way of chunking."""


def compare(rank, R, group):
    out = {}
    probe = dispatcher(group, 0, BOUNDED)
    C, W = probe.capacity(N, K), probe.block_rows(N, K)
    for case, factor in (("balanced", BOUNDED), ("skewed", BOUNDED), ("all_to_one", None)):
        ids_NK, x0, w0, g = inputs(case, rank, R, C, W)
        ref, _ = run(dispatcher(group, 0, factor), x0, ids_NK, w0, g, rank, R)
        one, _ = run(dispatcher(group, 1, factor), x0, ids_NK, w0, g, rank, R)
        out[case] = {"bits_n1": [torch.equal(a, b) for a, b in zip(one, ref)]}
        # Chunks route unevenly where the whole does not, so a bounded capacity may drop in a
        # chunk what it keeps whole: compare with room for every row.
        roomy, _ = run(dispatcher(group, 0, BOUNDED, min_rows=ROOMY), x0, ids_NK, w0, g, rank, R)
        for n in chunk_counts(R):
            got, dropped = run(dispatcher(group, n, BOUNDED, min_rows=ROOMY), x0, ids_NK, w0, g, rank, R)
            out[case][n] = {"bits": [torch.equal(a, b) for a, b in zip(got, roomy)], "dropped": dropped}
        got, dropped = run(dispatcher(group, TOKEN_CHUNKS, BOUNDED, min_rows=ROOMY), x0, ids_NK, w0, g, rank, R)
        out[case]["tokens"] = {"diffs": [relative_diff(a, b) for a, b in zip(got, roomy)], "dropped": dropped}
    # The bounded mode under all-to-one routing drops each chunk's overflow, by the rule.
    ids_NK, x0, w0, g = inputs("all_to_one", rank, R, C, W)
    ids_by_rank = [None] * R
    import torch.distributed as dist

    dist.all_gather_object(ids_by_rank, ids_NK)
    for n in (*chunk_counts(R), TOKEN_CHUNKS):
        got, dropped = run(dispatcher(group, n, BOUNDED), x0, ids_NK, w0, g, rank, R)
        out[f"bounded_all_to_one_{n}"] = {
            "dropped": dropped,
            "want": expected_drops(ids_by_rank, rank, R, n),
            "finite": all(bool(torch.isfinite(t).all()) for t in got),
        }
    return out


def expected_drops(ids_by_rank, rank, R, n):
    """What `rank` drops with n chunks: test_nosync_capacity.reference_keep's rule per chunk
    (chunk i: every token's copies for local experts [i·L/n, (i+1)·L/n) where n divides L, else
    those of tokens [i·N/n, (i+1)·N/n); 1/n of the capacity and spill rows). A chunk's assignments
    go to the rule one per row, in token order."""
    from moetrain.parallel.nosync_dispatcher import block_rows, capacity_rows

    L, M = E // R, N * K
    C, W = capacity_rows(M, R, BOUNDED / n), block_rows(M, R, BOUNDED / n, 0.125 / n)
    if L % n == 0:
        chunk_of = [(ids.flatten() % L) // (L // n) for ids in ids_by_rank]
    else:
        chunk_of = [torch.arange(M) // K * n // N for _ in ids_by_rank]
    chunks = [[ids.flatten()[c == i] for ids, c in zip(ids_by_rank, chunk_of)] for i in range(n)]
    return sum(int((~reference_keep([e.view(-1, 1) for e in by_rank], R, C, W)[rank]).sum()) for by_rank in chunks)


# --- the schedule -----------------------------------------------------------------------------------


class Mark(torch.autograd.Function):
    """Identity; logs `name` when forward runs and `name` + " grad" when backward does."""

    @staticmethod
    def forward(ctx, x, log, name):
        ctx.log, ctx.name = log, name
        log.append(name)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.name + " grad")
        return grad, None, None


def schedule(rank, R, group):
    """The overlapped layer with 2 chunks, every exchange's start and wait logged (by start order:
    there 0, there 1, back 0, back 1 in forward; their gradients' in backward) beside the experts'
    and the shared expert's forward and backward."""
    from unittest import mock

    import moetrain.parallel.overlapped_dispatcher as od

    log, issued = [], []
    real = od._exchange

    class Logged:
        def __init__(self, work, i):
            self.work, self.i = work, i

        def wait(self):
            self.work.wait()
            log.append(f"wait {self.i}")

    def exchange(x, group, out=None):
        out, work = real(x, group, out)
        issued.append(len(issued))
        log.append(f"start {issued[-1]}")
        return out, Logged(work, issued[-1])

    _, forward = local_experts(rank, R, poison=True)
    calls = []

    def experts(x_SD, offsets, weights=None):
        i = len(calls)
        calls.append(i)
        # logged on entry in forward; in backward, "grad" marks the experts' backward finished
        return Mark.apply(forward(Mark.apply(x_SD, log, f"experts {i}"), offsets, weights), log, f"experts {i} out")

    experts.w_gate_up_E2FD, experts.w_down_EDF = forward.w_gate_up_E2FD, forward.w_down_EDF
    shared = make_shared()

    def shared_fn(x):
        return Mark.apply(shared(Mark.apply(x, log, "shared")), log, "shared out")

    disp = dispatcher(group, 2, BOUNDED, min_rows=ROOMY)
    ids_NK, x0, w0, g = inputs("balanced", rank, R, disp.capacity(N, K), disp.block_rows(N, K))
    x = x0.requires_grad_()
    with mock.patch.object(od, "_exchange", exchange):
        y = disp.expert_step(x, route_of(ids_NK, w0), experts, shared_fn)
        log.append("backward")
        (y * g).sum().backward()
    return log


def no_sync_and_memory(rank, R, group):
    from support.host_sync import forbid_host_sync

    from moetrain.model.experts import GroupedExperts

    disp = dispatcher(group, 2, BOUNDED)
    ids_NK, x0, w0, g = inputs("skewed", rank, R, disp.capacity(N, K), disp.block_rows(N, K))
    _, forward = local_experts(rank, R, poison=False)
    x, route = x0.clone().requires_grad_(), route_of(ids_NK, w0)  # the router's counts: not the dispatcher's
    with forbid_host_sync():
        (disp.expert_step(x, route, forward, None) * g).sum().backward()
        disp.dropped_tokens() + 0

    # Peak bytes allocated by a whole exchange, forward and backward (experts frozen: their
    # weight gradients are no dispatch memory), plain against overlapped.
    L = E // R
    torch.manual_seed(0)
    experts = GroupedExperts(L, 256, 16).requires_grad_(False)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
    ids_NK = routing_ids([N * K // R] * R, rank)
    peaks = {}
    for chunks in (0, *chunk_counts(R), TOKEN_CHUNKS):
        disp = dispatcher(group, chunks, BOUNDED)
        x = torch.randn(N, 256, requires_grad=True)
        w = torch.rand(N, K, requires_grad=True)

        def step(disp=disp, x=x, w=w):
            return disp.expert_step(x, route_of(ids_NK, w), experts, None)

        step().sum().backward()  # warm-up
        x.grad = w.grad = None
        mode, saved = Allocations(), {}

        def pack(t, mode=mode, saved=saved):
            s = t.untyped_storage()
            if id(s) in mode.alive:  # allocated in the window (not the input or the weights)
                saved[id(s)] = s.nbytes()
            return t

        with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step().sum().backward()
        peaks[chunks] = mode.peak
        peaks[f"saved {chunks}"] = sum(saved.values())
    peaks["buffer"] = R * disp.block_rows(N, K) * 256 * 4  # one exchange's rows, fp32
    return peaks


def rank_checks(world):
    import torch.distributed as dist

    rank, group = dist.get_rank(), dist.group.WORLD
    return {
        "compare": compare(rank, world, group),
        "schedule": schedule(rank, world, group),
        "memory": no_sync_and_memory(rank, world, group),
    }


@pytest.fixture(scope="module", params=[2, 4, 8], ids=["ep2", "ep4", "ep8"])
def world_results(request):
    world = request.param
    return world, run_distributed(rank_checks, world, world)


def test_one_chunk_is_the_plain_exchange_bit_for_bit(world_results):
    _, results = world_results
    for rank, r in enumerate(results):
        for case in ("balanced", "skewed", "all_to_one"):
            assert all(r["compare"][case]["bits_n1"]), (rank, case, r["compare"][case]["bits_n1"])


def test_chunks_by_experts_are_the_plain_exchange_bit_for_bit(world_results):
    """Outputs, input, weight and expert gradients the plain exchange's bit for bit with room for
    every row (nothing may be dropped), for 2 chunks and one per local expert."""
    world, results = world_results
    for rank, r in enumerate(results):
        for case in ("balanced", "skewed", "all_to_one"):
            for n in chunk_counts(world):
                got = r["compare"][case][n]
                assert all(got["bits"]) and got["dropped"] == 0, (rank, case, n, got)


def test_chunks_by_tokens_are_the_plain_exchange_within_rounding(world_results):
    """3 chunks split the tokens: outputs and every gradient within rounding (each expert's
    products over a third of the rows, its weight gradient a sum of three), nothing dropped with
    room for every row."""
    _, results = world_results
    for rank, r in enumerate(results):
        for case in ("balanced", "skewed", "all_to_one"):
            got = r["compare"][case]["tokens"]
            assert max(got["diffs"]) < TOL and got["dropped"] == 0, (rank, case, got)


def test_all_to_one_drops_each_chunks_overflow(world_results):
    world, results = world_results
    for rank, r in enumerate(results):
        for n in (*chunk_counts(world), TOKEN_CHUNKS):
            got = r["compare"][f"bounded_all_to_one_{n}"]
            assert got["dropped"] == got["want"] > 0 and got["finite"], (world, rank, n, got)


def test_the_exchanges_overlap_compute_forward_and_backward(world_results):
    """Forward: both chunks start before the shared expert computes; chunk 1 travels while chunk
    0's experts compute, chunk 0 returns while chunk 1's do. Backward (latest-created first):
    chunk 1's gradient returns first and is waited for before its experts' backward, which runs
    while chunk 0's return gradient travels; chunk 0's experts' backward runs while chunk 1's
    dispatch gradient travels; the shared expert's backward runs while chunk 0's travels."""
    _, results = world_results
    for rank, r in enumerate(results):
        check_schedule(r["schedule"], rank)


def check_schedule(log, where):
    fwd, bwd = log[: log.index("backward")], log[log.index("backward") :]
    assert fwd.index("start 0") < fwd.index("start 1") < fwd.index("shared") < fwd.index("wait 0"), (where, log)
    assert fwd.index("wait 0") < fwd.index("experts 0") < fwd.index("start 2") < fwd.index("wait 1"), (where, log)
    assert fwd.index("wait 1") < fwd.index("experts 1") < fwd.index("start 3") < fwd.index("wait 2"), (where, log)
    # backward exchanges: 4 = back 1's gradient, 5 = back 0's, 6 = there 1's, 7 = there 0's
    pos = {name: i for i, name in enumerate(bwd)}
    assert pos["start 4"] < pos["start 5"] < pos["wait 4"] < pos["experts 1 out grad"], (where, bwd)
    assert pos["experts 1 grad"] < pos["wait 5"], (where, bwd)  # chunk 1's expert backward under back 0's
    assert pos["start 6"] < pos["experts 0 out grad"] and pos["experts 0 grad"] < pos["wait 6"], (where, bwd)
    assert pos["start 7"] < pos["shared out grad"] and pos["shared grad"] < pos["wait 7"], (where, bwd)


def test_no_host_sync_and_the_plain_exchanges_memory(world_results):
    """What is kept for backward is the plain exchange's (within 5%: the chunks' integer maps),
    whatever n. The peak grows by the buffer an exchange in flight writes while compute runs
    (the return buffer in forward, the dispatch gradient's in backward: R·W rows of D) and by
    up to one more with gloo's timing (its thread lets go of a collective's buffers when the
    collective completes), not with n."""
    world, results = world_results
    for rank, r in enumerate(results):
        peaks, buffer = r["memory"], r["memory"]["buffer"]
        for chunks in (*chunk_counts(world), TOKEN_CHUNKS):
            assert peaks[f"saved {chunks}"] <= 1.05 * peaks["saved 0"], (rank, chunks, peaks)
            assert peaks[chunks] <= peaks[0] + 2 * buffer, (rank, chunks, peaks)


@pytest.mark.parametrize(
    "flags, needs",
    [
        (["parallel.ep=2", "parallel.overlap_chunks=3", DEFER], "one of 2, 4"),
        (["parallel.ep=8", "parallel.overlap_chunks=2", DEFER], "compute.defer_expert_weight_grad=false"),
        (["parallel.ep=2", "parallel.overlap_chunks=2", "parallel.capacity_factor=null"], "bounded capacity"),
    ],
)
def test_unsplittable_chunks_are_refused(flags, needs):
    """tiny's 8 experts: 3 chunks split the tokens of 4 local experts, 2 those of 1, which
    deferred expert weight gradients cannot follow; the padded mode has no capacity to split;
    one chunk always can, and token chunks can without deferral."""
    from moetrain.errors import ConfigError
    from moetrain.presets import resolve_config

    with pytest.raises(ConfigError, match=needs):
        resolve_config("tiny", flags)
    resolve_config("tiny", [f for f in flags if "overlap_chunks" not in f] + ["parallel.overlap_chunks=1"])
    if DEFER in flags:
        resolve_config("tiny", [f for f in flags if f != DEFER])


# --- a training run with the overlapped exchange inside compiled blocks ------------------------------


def compiled_and_eager(data_dir, tmp):
    """dp2·ep2, 2 chunks by experts, 2 steps: eager blocks; compiled blocks (the overlapped
    exchange runs eagerly between their graphs, its experts compiled on their own); FP8 row-wise
    (each chunk's experts quantize their group's slices of the weights)."""
    import torch.distributed as dist
    from test_layouts import layout_cfg

    from moetrain.train.metrics import read_metrics
    from moetrain.train.trainer import Trainer

    out = {}
    for name, extra in (
        ("eager", []),
        ("compiled", ["compute.compile=true"]),
        ("fp8", ["precision.fp8=rowwise", "precision.fp8_select=all"]),
    ):
        run_dir = tmp / name
        cfg = layout_cfg(data_dir, run_dir, "parallel.ep=2", "parallel.overlap_chunks=2", "train.steps=2", *extra)
        trainer = Trainer(cfg, quiet=True)
        trainer.fit()
        out[name] = [r["lm_loss"] for r in read_metrics(run_dir / "metrics.jsonl")] if trainer.par.is_main else None
        dist.barrier()
    return out


def test_compiled_and_fp8_blocks_around_the_pipelined_exchange_train_like_eager(real_text_dir, tmp_path):
    got = run_distributed(compiled_and_eager, 2, real_text_dir, tmp_path, timeout_s=600)[0]
    assert len(got["eager"]) == len(got["compiled"]) == len(got["fp8"]) == 2
    assert got["compiled"] == pytest.approx(got["eager"], rel=1e-4)
    assert got["fp8"] == pytest.approx(got["eager"], rel=0.01)  # FP8's error (tests/train/test_trainer.py)
