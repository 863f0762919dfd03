"""The pipelined exchange (parallel.overlap_chunks, NoSyncDispatcher.pipelined) against the plain
dispatch → experts → combine (+ shared expert) on gloo ranks at ep 2, 4 and 8 (ep = world).

- n = 1 chunk: outputs and every gradient are the plain path's bit for bit;
- n = 2, 3 (3 splits 64 tokens unevenly): within fp32 reassociation of the plain path (the
  expert weight gradients sum over chunks), under balanced, skewed and all-to-one routing in the
  padded mode (dropless); in the bounded mode, under all-to-one routing, each chunk drops
  exactly its own M − C;
- the schedule: the order in which exchanges start and finish, forward and backward, around the
  experts and the shared expert, is the overlapping one the docstring promises;
- no host synchronization, and the dispatch's peak allocation stays that of the plain path.

Legend as tests/parallel/test_nosync_capacity.py, whose routing and experts these reuse."""

import pytest
import torch
from test_nosync_capacity import (
    BOUNDED,
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

from moetrain.testing.distributed import run_distributed

TOL = 1e-6
CHUNKS = (2, 3)


def make_shared():
    from moetrain.model.mlp import SwiGLU

    torch.manual_seed(1)
    shared = SwiGLU(D, 16)
    with torch.no_grad():
        for p in shared.parameters():
            p.normal_(0, 0.3)
    return shared


def run(disp, chunks, x0_ND, ids_NK, w0_NK, grad_ND, rank, R, poison=True):
    """One forward and backward of the layer's exchange: plain (`chunks` 0) or pipelined."""
    local, forward = local_experts(rank, R, poison)
    shared = make_shared()
    x, w = x0_ND.clone().requires_grad_(), w0_NK.clone().requires_grad_()
    disp.overlap_chunks = chunks
    if chunks:
        y = disp.pipelined(x, ids_NK, w, forward, shared)
    else:
        x_local, offsets, state = disp.dispatch(x, ids_NK, torch.bincount(ids_NK.flatten(), minlength=E))
        y = disp.combine(forward(x_local, offsets), state, w) + shared(x)
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
    from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher, chunks_by_experts

    out = {}
    probe = NoSyncDispatcher(E, group, group, BOUNDED)
    C, W = probe.capacity(N, K), probe.block_rows(N, K)
    for case, factor in (("balanced", BOUNDED), ("skewed", BOUNDED), ("all_to_one", None)):
        ids_NK, x0, w0, g = inputs(case, rank, R, C, W)
        ref, _ = run(NoSyncDispatcher(E, group, group, factor), 0, x0, ids_NK, w0, g, rank, R)
        one, _ = run(NoSyncDispatcher(E, group, group, factor), 1, x0, ids_NK, w0, g, rank, R)
        out[case] = {"bits_n1": [torch.equal(a, b) for a, b in zip(one, ref)]}
        # Chunks route unevenly where the whole does not, so a bounded capacity may drop in a
        # chunk what it keeps whole: compare with room for every row. The padded mode chunks by
        # tokens; bounded with room by experts where n divides the local experts.
        padded, _ = run(NoSyncDispatcher(E, group, group, None), 0, x0, ids_NK, w0, g, rank, R)
        for n in CHUNKS:
            for mode, disp in (
                ("tokens", NoSyncDispatcher(E, group, group, None)),
                ("experts", NoSyncDispatcher(E, group, group, BOUNDED, min_rows=ROOMY)),
            ):
                got, dropped = run(disp, n, x0, ids_NK, w0, g, rank, R)
                out[case][(mode, n)] = {
                    "diff": max(relative_diff(a, b) for a, b in zip(got, padded)),
                    "finite": all(bool(torch.isfinite(t).all()) for t in got),
                    "dropped": dropped,
                    "by_experts": chunks_by_experts(n, E // R, disp.capacity_factor),
                }
    # The bounded mode under all-to-one routing drops each chunk's overflow, by the rule.
    ids_NK, x0, w0, g = inputs("all_to_one", rank, R, C, W)
    ids_by_rank = [None] * R
    import torch.distributed as dist

    dist.all_gather_object(ids_by_rank, ids_NK)
    for n in CHUNKS:
        disp = NoSyncDispatcher(E, group, group, BOUNDED)
        got, dropped = run(disp, n, x0, ids_NK, w0, g, rank, R)
        out[f"bounded_all_to_one_{n}"] = {
            "dropped": dropped,
            "want": expected_drops(ids_by_rank, rank, R, n),
            "finite": all(bool(torch.isfinite(t).all()) for t in got),
        }
    return out


def expected_drops(ids_by_rank, rank, R, n):
    """What `rank` drops with n chunks: test_nosync_capacity.reference_keep's rule per chunk. By
    experts when n divides L (chunk i: every token's copies for local experts
    [i·L/n, (i+1)·L/n), 1/n of the capacity and spill rows), else by tokens (chunk i: the i-th
    n-th of the tokens, its own capacity). A chunk's assignments go to the rule one per row, in
    token order."""
    from moetrain.parallel.nosync_dispatcher import block_rows, capacity_rows

    L, M = E // R, N * K
    chunks = []  # per chunk: (per source rank, the chunk's expert ids), C, W
    if L % n == 0:
        G = L // n
        C, W = capacity_rows(M, R, BOUNDED / n), block_rows(M, R, BOUNDED / n, 0.125 / n)
        for i in range(n):
            chunks.append(([ids.flatten()[(ids.flatten() % L) // G == i] for ids in ids_by_rank], C, W))
    else:
        for part in torch.arange(N).tensor_split(n):
            M_i = len(part) * K
            C, W = capacity_rows(M_i, R, BOUNDED), block_rows(M_i, R, BOUNDED, 0.125)
            chunks.append(([ids[part].flatten() for ids in ids_by_rank], C, W))
    return sum(
        int((~reference_keep([e.view(-1, 1) for e in by_rank], R, C, W)[rank]).sum()) for by_rank, C, W in chunks
    )


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


def schedule(rank, R, group, factor):
    """The pipelined layer with 2 chunks, every exchange's start and wait logged (by start order:
    there 0, there 1, back 0, back 1 in forward; their gradients' in backward) beside the experts'
    and the shared expert's forward and backward. `factor`: the bounded capacity (chunks by
    experts) or None (the padded mode: chunks by tokens)."""
    from unittest import mock

    import moetrain.parallel.async_exchange as ax
    from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher

    log, issued = [], []
    real = ax._exchange

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

    def experts(x_SD, offsets, group):
        i = len(calls)
        calls.append(i)
        # logged on entry in forward; in backward, "grad" marks the experts' backward finished
        return Mark.apply(forward(Mark.apply(x_SD, log, f"experts {i}"), offsets, group), log, f"experts {i} out")

    shared = make_shared()

    def shared_fn(x):
        return Mark.apply(shared(Mark.apply(x, log, "shared")), log, "shared out")

    disp = NoSyncDispatcher(E, group, group, factor, min_rows=ROOMY, overlap_chunks=2)
    ids_NK, x0, w0, g = inputs("balanced", rank, R, disp.capacity(N, K), disp.block_rows(N, K))
    x = x0.requires_grad_()
    with mock.patch.object(ax, "_exchange", exchange):
        y = disp.pipelined(x, ids_NK, w0, experts, shared_fn)
        log.append("backward")
        (y * g).sum().backward()
    return log


def no_sync_and_memory(rank, R, group):
    from moetrain.model.experts import GroupedExperts
    from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher
    from moetrain.testing.host_sync import forbid_host_sync

    disp = NoSyncDispatcher(E, group, group, BOUNDED)
    ids_NK, x0, w0, g = inputs("skewed", rank, R, disp.capacity(N, K), disp.block_rows(N, K))
    _, forward = local_experts(rank, R, poison=False)
    x = x0.clone().requires_grad_()
    disp.overlap_chunks = 2
    with forbid_host_sync():
        (disp.pipelined(x, ids_NK, w0, forward, None) * g).sum().backward()
        disp.dropped_tokens() + 0

    # Peak bytes allocated by a whole exchange, forward and backward (experts frozen: their
    # weight gradients are no dispatch memory), plain against pipelined.
    L = E // R
    torch.manual_seed(0)
    experts = GroupedExperts(L, 256, 16).requires_grad_(False)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
    ids_NK = routing_ids([N * K // R] * R, rank)
    peaks = {}
    for chunks in (0, 2, 4):
        disp.overlap_chunks = chunks
        x = torch.randn(N, 256, requires_grad=True)
        w = torch.rand(N, K, requires_grad=True)

        def step(chunks=chunks, x=x, w=w):
            if chunks:
                return disp.pipelined(x, ids_NK, w, experts, None)
            x_local, offsets, state = disp.dispatch(x, ids_NK, torch.bincount(ids_NK.flatten(), minlength=E))
            return disp.combine(experts(x_local, offsets), state, w)

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
        "schedule": {mode: schedule(rank, world, group, f) for mode, f in (("experts", BOUNDED), ("tokens", None))},
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


def test_chunks_match_the_plain_exchange(world_results):
    """Outputs, input, weight and expert gradients within fp32 reassociation of the plain
    exchange, chunked by tokens (the padded mode) and by experts (bounded, with room for every
    row), where nothing may be dropped."""
    world, results = world_results
    for rank, r in enumerate(results):
        for case in ("balanced", "skewed", "all_to_one"):
            for n in CHUNKS:
                for mode in ("tokens", "experts"):
                    got = r["compare"][case][(mode, n)]
                    assert got["finite"] and got["diff"] <= TOL, (rank, case, mode, n, got)
                    assert got["dropped"] in (None, 0), (rank, case, mode, n, got)
    # chunks by experts were exercised (2 chunks divide the 8, 4 or 2 local experts)
    assert results[0]["compare"]["balanced"][("experts", 2)]["by_experts"]


def test_all_to_one_drops_each_chunks_overflow(world_results):
    world, results = world_results
    for rank, r in enumerate(results):
        for n in CHUNKS:
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
        for mode, log in r["schedule"].items():
            check_schedule(log, (rank, mode))


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
        for chunks in (2, 4):
            assert peaks[f"saved {chunks}"] <= 1.05 * peaks["saved 0"], (rank, chunks, peaks)
            assert peaks[chunks] <= peaks[0] + 2 * buffer, (rank, chunks, peaks)


# --- a training run with the pipelined exchange inside compiled blocks ------------------------------


def compiled_and_eager(data_dir, tmp):
    """dp2·ep2, 2 chunks by experts, 2 steps: eager blocks; compiled blocks (the pipelined
    exchange runs eagerly between their graphs, its experts compiled on their own); FP8 row-wise
    (each chunk's experts quantize their group's slices of the weights)."""
    import torch.distributed as dist
    from test_layouts import layout_cfg

    from moetrain.train.metrics import read_metrics
    from moetrain.train.trainer import Trainer

    out = {}
    for name, extra in (("eager", []), ("compiled", ["train.compile=true"]), ("fp8", ["train.fp8=rowwise"])):
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
