"""NoSyncDispatcher against the exact AllToAllDispatcher on gloo ranks (ep = world): in its padded
mode (capacity_factor=None) it gives the same outputs and gradients whatever the routing; with a
capacity and no spill rows it drops exactly the expected assignments and nothing else; in every
mode it never synchronizes with the host. The grouped experts' padding rows are poisoned with NaN
(forward and backward), the worst garbage a grouped GEMM may leave there. The default (capacity
with spill rows) at ep 2, 4 and 8: tests/parallel/test_nosync_capacity.py.

Legend: N tokens per rank, K top-k, D model dim, E experts, L experts per rank, R ranks."""

import math
from unittest import mock

import pytest
import torch
from support.distributed import NaNGradOnPadding, run_distributed
from support.host_sync import HostSyncError, forbid_host_sync
from torch import nn

D, E, K, F = 32, 8, 2, 16
B, T = 2, 16
TOL = 1e-6


# --- the host-sync detector (tests/support/host_sync.py) -----------------------------------


class _ItemInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad.sum().item()
        return grad


@pytest.mark.parametrize(
    "sync",
    [
        lambda t: t.item(),
        lambda t: t.tolist(),
        lambda t: t.cpu(),
        lambda t: bool(t.sum()),
        lambda t: int(t.sum()),
        lambda t: t.to("cpu"),
        lambda t: t[t > 0],
        lambda t: torch.nonzero(t),
        lambda t: t.long().abs().repeat_interleave(2 * torch.ones(4, dtype=torch.long)),
        lambda t: torch.unique(t),
        lambda t: torch.bincount(t.long().abs()),
        lambda t: range(10)[t.long()[0]],
        lambda t: _ItemInBackward.apply(t.requires_grad_()).sum().backward(),
    ],
    ids=[
        "item",
        "tolist",
        "cpu",
        "bool",
        "int",
        "to_cpu",
        "bool_index",
        "nonzero",
        "repeat_interleave",
        "unique",
        "bincount",
        "index",
        "item_in_backward",
    ],
)
def test_the_detector_catches_host_syncs(sync):
    t = torch.tensor([1.0, -2.0, 3.0, 0.5])
    with pytest.raises(HostSyncError), forbid_host_sync():
        sync(t)


def test_the_detector_lets_sync_free_code_run():
    t = torch.tensor([1.0, -2.0, 3.0, 0.5], requires_grad=True)
    with forbid_host_sync():
        r = torch.tensor([1, 0, 2, 1]).repeat_interleave(torch.tensor([1, 0, 2, 1]), output_size=4)
        y = (t.index_select(0, r.argsort(stable=True)) * 2).to(torch.float64).sum()
        y.backward()
    assert t.grad is not None


# --- the distributed checks ---------------------------------------------------------------------


class PoisonPadding(nn.Module):
    """Grouped experts whose rows past the last offset are NaN in the output and in the input's
    gradient."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.padding_rows = 0

    def forward(self, x_SD, offsets_L):
        pad_S1 = (torch.arange(x_SD.shape[0]) >= offsets_L[-1]).unsqueeze(-1)
        self.padding_rows += int(pad_S1.sum())
        y_SD = self.inner(NaNGradOnPadding.apply(x_SD, pad_S1), offsets_L)
        return y_SD.masked_fill(pad_S1, float("nan"))


def build_moe(dispatcher, rank, poison=False, bias_E=None):
    """Every rank builds the same full layer (seed 0), then keeps its slice of experts, as
    apply_expert_parallel does."""
    from moetrain.model.config import MoEConfig
    from moetrain.model.experts import GroupedExperts
    from moetrain.model.moe import MoE

    torch.manual_seed(0)
    moe = MoE(D, MoEConfig(num_experts=E, top_k=K, expert_hidden=F))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        if bias_E is not None:
            moe.router.expert_bias_E.copy_(bias_E)
    L = dispatcher.num_local_experts
    full = moe.experts
    local = GroupedExperts(L, D, F, expert_offset=rank * L)
    with torch.no_grad():
        local.w_gate_up_E2FD.copy_(full.w_gate_up_E2FD[rank * L : (rank + 1) * L])
        local.w_down_EDF.copy_(full.w_down_EDF[rank * L : (rank + 1) * L])
    moe.experts = PoisonPadding(local) if poison else local
    moe.dispatcher = dispatcher
    return moe


def local_experts(moe):
    return moe.experts.inner if isinstance(moe.experts, PoisonPadding) else moe.experts


def max_diff(a, b):
    a = torch.zeros_like(b) if a is None else a
    b = torch.zeros_like(a) if b is None else b
    return (a - b).abs().max().item()


def inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)


def compare_dropless(rank, group, bias_E):
    """Forward and backward of the full layer with the exact dispatcher and NoSyncDispatcher in
    its padded mode, in train mode (aux losses)."""
    from moetrain.parallel.exact_dispatchers import AllToAllDispatcher
    from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher

    x_BTD, grad_BTD = inputs(rank)
    results = []
    for moe in (
        build_moe(AllToAllDispatcher(E, group, group), rank, bias_E=bias_E),
        build_moe(NoSyncDispatcher(E, group, group, capacity_factor=None), rank, poison=True, bias_E=bias_E),
    ):
        x = x_BTD.clone().requires_grad_()
        y = moe(x)
        (y * grad_BTD).sum().backward()
        experts = local_experts(moe)
        results.append(
            (y.detach(), x.grad, moe.router.weight.grad, experts.w_gate_up_E2FD.grad, experts.w_down_EDF.grad, moe)
        )
    ref, new = results
    names = ["y", "x_grad", "router_grad", "w_gate_up_grad", "w_down_grad"]
    out = {name: max_diff(a, b) for name, a, b in zip(names, ref, new)}
    out["finite"] = all(bool(torch.isfinite(t).all()) for t in new[:5] if t is not None)
    out["padding_rows"] = new[5].experts.padding_rows
    out["dropped_is_none"] = new[5].dispatcher.dropped_tokens() is None
    return out


def expected_drops(topk_ids_NK, L, C):
    """Independently: walk the assignments in token order, each destination keeps its first C."""
    taken, keep = {}, []
    for row in topk_ids_NK.tolist():
        keep.append([])
        for e in row:
            d = e // L
            keep[-1].append(taken.get(d, 0) < C)
            taken[d] = taken.get(d, 0) + 1
    return torch.tensor(keep), sum(max(0, n - C) for n in taken.values())


def check_capacity(rank, group, capacity_factor):
    """Skewed routing (expert 0 always chosen) with a capacity and no spill rows: drops match the
    expectation, kept outputs and all gradients match the exact dispatcher's with the dropped
    terms masked out."""
    from moetrain.parallel.exact_dispatchers import AllToAllDispatcher
    from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher

    bias_E = torch.zeros(E)
    bias_E[0] = 1.0
    cap = build_moe(NoSyncDispatcher(E, group, group, capacity_factor, 0.0), rank, poison=True, bias_E=bias_E)
    exact = build_moe(AllToAllDispatcher(E, group, group), rank, bias_E=bias_E)
    x_BTD, _ = inputs(rank)
    x_ND = x_BTD.view(B * T, D).clone().requires_grad_()
    gen = torch.Generator().manual_seed(7 + rank)
    grad_ND = torch.randn(B * T, D, generator=gen)
    w_NK = torch.rand(B * T, K, generator=gen) + 0.5

    route = cap.router(x_ND, cap.dispatcher.reduce_counts)
    C = cap.dispatcher.capacity(B * T, K)
    keep_NK, want_dropped = expected_drops(route.topk_ids_NK, cap.dispatcher.num_local_experts, C)

    ys, grads = [], []
    for moe, mask in ((cap, None), (exact, keep_NK)):
        x_local, offsets, state = moe.dispatcher.dispatch(x_ND, route.topk_ids_NK, route.tokens_per_expert_E)
        if moe is cap:
            rows, dropped = x_local.shape[0], moe.dispatcher.dropped_tokens()
        y_local = moe.experts(x_local, offsets)
        # The exact dispatcher with the dropped copies' weights at 0 is what capacity must give.
        y_ND = moe.dispatcher.combine(y_local, state, w_NK if mask is None else w_NK * mask)
        if moe is cap:
            # Weight 1 on the dropped copies only: they must add nothing.
            dropped_max = moe.dispatcher.combine(y_local, state, (~keep_NK).float()).abs().max().item()
        experts = local_experts(moe)
        grads.append(torch.autograd.grad((y_ND * grad_ND).sum(), [x_ND, experts.w_gate_up_E2FD, experts.w_down_EDF]))
        ys.append(y_ND.detach())
    y_cap, y_exact = ys

    # The layer's statistics carry the same count to the trainer.
    cap.train()
    cap(x_BTD)
    layer_dropped = cap.end_step()["dropped"].item()
    return {
        "C": C,
        "rows": rows,
        "dropped": dropped.item(),
        "dropped_dtype": str(dropped.dtype),
        "dropped_dim": dropped.dim(),
        "layer_dropped": layer_dropped,
        "want_dropped": want_dropped,
        "kept_diff": (y_cap - y_exact).abs().max().item(),
        "dropped_max": dropped_max,
        "grad_diffs": [max_diff(a, b) for a, b in zip(*grads)],
    }


def check_no_host_sync(rank, group):
    """dispatch, combine and their backward run under the detector (the experts, outside the
    dispatcher's scope, are a stand-in); the exact dispatcher, which reads split sizes on the host,
    trips it."""
    from moetrain.parallel.exact_dispatchers import AllToAllDispatcher
    from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher

    x_BTD, _ = inputs(rank)
    x_ND = x_BTD.view(B * T, D).clone().requires_grad_()
    # Random routing (k distinct experts per token); the router is outside the dispatcher's scope.
    ids_NK = torch.rand(B * T, E, generator=torch.Generator().manual_seed(rank)).topk(K).indices
    counts_E = torch.bincount(ids_NK.flatten(), minlength=E)
    out = {}
    for name, disp in (
        ("padded", NoSyncDispatcher(E, group, group, capacity_factor=None)),
        ("default", NoSyncDispatcher(E, group, group)),
        ("capacity", NoSyncDispatcher(E, group, group, capacity_factor=0.5, spill_factor=0.0)),
    ):
        with forbid_host_sync():
            x_local, offsets, state = disp.dispatch(x_ND, ids_NK, counts_E)
            y_ND = disp.combine(x_local * 2.0, state, torch.ones(B * T, K))
            (y_ND * 3.0).sum().backward()
        out[name] = tuple(y_ND.shape)
    try:
        with forbid_host_sync():
            AllToAllDispatcher(E, group, group).dispatch(x_ND, ids_NK, counts_E)
        out["exact_trips"] = False
    except HostSyncError:
        out["exact_trips"] = True
    return out


def check_wire_dtype(rank, group):
    """Under autocast the rows cross the all-to-all in bf16 (the experts' input dtype), both
    dispatchers; the gradient reaching the fp32 input is fp32 and equals the local dispatcher's
    path (cast after the gather) to fp32 rounding."""
    import torch.distributed._functional_collectives as funcol

    from moetrain.parallel.exact_dispatchers import AllToAllDispatcher
    from moetrain.parallel.nosync_dispatcher import NoSyncDispatcher

    x_BTD, _ = inputs(rank)
    x_ND = x_BTD.view(B * T, D).clone().requires_grad_()
    ids_NK = torch.rand(B * T, E, generator=torch.Generator().manual_seed(rank)).topk(K).indices
    counts_E = torch.bincount(ids_NK.flatten(), minlength=E)
    real = funcol.all_to_all_single_autograd
    out = {}
    for name, disp in (
        ("alltoall", AllToAllDispatcher(E, group, group)),
        ("nosync", NoSyncDispatcher(E, group, group, capacity_factor=None)),
    ):
        seen = []

        def spy(t, *args, _seen=seen, **kwargs):
            _seen.append(t.dtype)
            return real(t, *args, **kwargs)

        with mock.patch.object(funcol, "all_to_all_single_autograd", spy), torch.autocast("cpu", dtype=torch.bfloat16):
            x_local, offsets, state = disp.dispatch(x_ND, ids_NK, counts_E)
            y_ND = disp.combine(x_local, state, torch.ones(B * T, K))
        (grad,) = torch.autograd.grad(y_ND.float().sum(), [x_ND])
        out[name] = {
            "wire": sorted({str(d) for d in seen}),
            "x_local": str(x_local.dtype),
            "grad": str(grad.dtype),
            # every kept row comes back as itself (bf16-rounded): each token's grad is K
            "grad_is_k": bool((grad == K).all()),
            # weights 1: each token is the sum of its K copies, K × its bf16 value (exact)
            "y_err": (y_ND.float() - K * x_ND.detach().to(torch.bfloat16).float()).abs().max().item(),
        }
    return out


def rank_checks(world):
    import torch.distributed as dist

    rank, group = dist.get_rank(), dist.group.WORLD
    all_to_rank0_E = torch.zeros(E)
    all_to_rank0_E[:2] = 10.0  # experts 0 and 1 live on rank 0 for any ep ≤ 4
    out = {
        "learned": compare_dropless(rank, group, None),
        "all_to_rank0": compare_dropless(rank, group, all_to_rank0_E),
        "capacity": check_capacity(rank, group, 1.0),
        "sync": check_no_host_sync(rank, group),
        "wire": check_wire_dtype(rank, group),
    }
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world_results(request):
    world = request.param
    return world, run_distributed(rank_checks, world, world)


def test_padded_mode_matches_the_exact_dispatcher(world_results):
    world, results = world_results
    N = B * T
    for rank, r in enumerate(results):
        for case in ("learned", "all_to_rank0"):
            got = r[case]
            for key in ("y", "x_grad", "router_grad", "w_gate_up_grad", "w_down_grad"):
                assert got[key] <= TOL, (rank, case, key, got[key])
            assert got["finite"], (rank, case)
            assert got["dropped_is_none"]
        # Everything goes to rank 0: it receives a full buffer, the others only padding.
        expected_padding = 0 if rank == 0 else world * N * K
        assert results[rank]["all_to_rank0"]["padding_rows"] == expected_padding
    # Balanced routing leaves padding somewhere: the poison was exercised.
    assert sum(r["learned"]["padding_rows"] for r in results) > 0


def test_capacity_without_spill_drops_exactly_the_overflow(world_results):
    world, results = world_results
    N = B * T
    assert sum(r["capacity"]["want_dropped"] for r in results) > 0
    for rank, r in enumerate(results):
        got = r["capacity"]
        assert got["C"] == math.ceil(N * K / world)
        assert got["rows"] == world * got["C"]
        assert (got["dropped_dtype"], got["dropped_dim"]) == ("torch.int64", 0)
        assert got["dropped"] == got["layer_dropped"] == got["want_dropped"], (rank, got)
        assert got["kept_diff"] <= TOL, (rank, got)
        assert got["dropped_max"] == 0.0, (rank, got)
        assert max(got["grad_diffs"]) <= TOL, (rank, got)


def test_no_host_sync_in_dispatch_combine_or_backward(world_results):
    world, results = world_results
    for r in results:
        assert r["sync"]["padded"] == r["sync"]["default"] == r["sync"]["capacity"] == (B * T, D)
        assert r["sync"]["exact_trips"]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["parallel.ep=3"], ["parallel.ep=3", "model.moe.num_experts=8"]),
        (["parallel.capacity_factor=0.0"], ["parallel.capacity_factor=0.0", "positive"]),
        (
            ["parallel.capacity_factor=1.5", "parallel.dispatcher=alltoall"],
            ["capacity_factor=1.5", "nosync only", "dropless"],
        ),
        (["parallel.spill_factor=-0.5"], ["parallel.spill_factor=-0.5", "≥ 0"]),
        (["parallel.spill_factor=0.5", "parallel.dispatcher=alltoall"], ["parallel.spill_factor=0.5", "nosync only"]),
    ],
)
def test_bad_dispatcher_settings_are_refused_by_the_config(overrides, words):
    from moetrain.errors import ConfigError
    from moetrain.presets import resolve_config

    with pytest.raises(ConfigError) as e:
        resolve_config("tiny", overrides)
    for word in words:
        assert word in str(e.value), str(e.value)


def test_rows_cross_the_all_to_all_in_the_autocast_dtype(world_results):
    _, results = world_results
    for r in results:
        for name, w in r["wire"].items():
            assert w["wire"] == ["torch.bfloat16"], (name, w)
            assert w["x_local"] == "torch.bfloat16" and w["grad"] == "torch.float32", (name, w)
            assert w["grad_is_k"] and w["y_err"] == 0.0, (name, w)
