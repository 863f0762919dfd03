"""optim.grad_dtype=bf16: the gradients kept between micro-batches and reduced over data-parallel
ranks in bf16, for the replicated, the sharded and the FSDP optimizer (src/moetrain/optim/grad_store.py);
each accumulation computed in fp32 and rounded to nearest once; the update and the clipping norm
in fp32."""

import pytest
import torch
from conftest import tiny_overrides
from support.distributed import call_each, run_distributed
from support.steps import synthetic_batches
from torch import nn

from moetrain.optim.grad_store import GradStore


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _wide_range(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Values over twelve decades of magnitude, both signs, some exact zeros and ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-8, 4, n)[torch.randperm(n, generator=g)]
    x[::97] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16])
def test_in_place_bf16_add_is_the_fp32_sum_rounded_once(g_dtype):
    """What GradStore relies on: `acc_bf16.add_(g)` on CPU computes fp32(acc) + g in fp32 and
    rounds to nearest bf16 once, for an fp32 `g` (fp32 compute) and a bf16 one (bf16 weights)."""
    acc = _wide_range(100_000, seed=1, dtype=torch.bfloat16)
    g = _wide_range(100_000, seed=2, dtype=g_dtype)
    expected = (acc.float() + g.float()).bfloat16()
    assert torch.equal(_bits(acc.clone().add_(g)), _bits(expected))
    # ... and not a bf16 sum of the rounded operands (fp32 g: those differ)
    if g_dtype == torch.float32:
        assert not torch.equal(_bits(acc.clone().add_(g.bfloat16())), _bits(expected))


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kept", [False, True])
def test_accumulation_is_fp32_add_then_round_bit_for_bit(param_dtype, kept):
    """Four micro-batches into a GradStore (allocated per step, or a kept view as in a bucket)
    against the explicit reference: round(g₁), then round(fp32(acc) + gₖ)."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 48).to(param_dtype)
    inputs = [torch.randn(16, 64, dtype=param_dtype) * 10.0**k for k in (-3, 0, 2, -1)]
    per_micro = [
        torch.autograd.grad(layer(x).square().sum(), list(layer.parameters())) for x in inputs
    ]  # each micro-batch's gradients alone, as autograd hands them to the hook
    store = GradStore(torch.bfloat16)
    buckets = {}
    for p in layer.parameters():
        buckets[p] = torch.full(p.shape, 7.0, dtype=torch.bfloat16)  # an earlier step's leftovers
        store.add(p, buckets[p] if kept else None)
    for step in range(2):  # the second step starts from zero_grad
        for x in inputs:
            layer(x).square().sum().backward()
        store.finish()
        for i, p in enumerate(layer.parameters()):
            assert p.grad is None
            ref = per_micro[0][i].to(torch.bfloat16)
            for grads in per_micro[1:]:
                ref = (ref.float() + grads[i].float()).bfloat16()
            got = store.grad(p)
            assert got.dtype == torch.bfloat16 and (got is buckets[p]) == kept
            assert torch.equal(_bits(got), _bits(ref)), (step, i)
        store.zero_grad()
    assert store.nbytes() == (sum(p.numel() for p in layer.parameters()) * 2 if kept else 0)


def test_a_kept_view_no_backward_reached_is_zeroed():
    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    store = GradStore(torch.bfloat16)
    views = {p: torch.full((3,), 5.0, dtype=torch.bfloat16) for p in (used, unused)}
    for p in (used, unused):
        store.add(p, views[p])
    (used * 2).sum().backward()
    store.finish()
    assert views[used].tolist() == [2.0] * 3 and views[unused].tolist() == [0.0] * 3


# ---- the three optimizers, through the engine (two gloo ranks where they reduce) ----------------


def _engine(data_dir, run_dir, extra):
    from moetrain.presets import resolve_config
    from moetrain.train.engine import TrainEngine
    from moetrain.train.runtime import setup_runtime

    cfg = resolve_config("tiny", tiny_overrides(data_dir, run_dir, "train.device=cpu", *extra))
    runtime = setup_runtime(cfg)
    torch.manual_seed(0)
    return cfg, TrainEngine(cfg, runtime.par, runtime.device)


def _fsdp_accumulated(model) -> set[str]:
    """The dtypes of FSDP's unsharded gradients kept between micro-batches (torch internals:
    `FSDPParam.unsharded_accumulated_grad`, else the unsharded parameter's `.grad`)."""
    out = set()
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            grad = fsdp_param.unsharded_accumulated_grad
            if grad is None and hasattr(fsdp_param, "_unsharded_param"):
                grad = fsdp_param._unsharded_param.grad
            if grad is not None:
                out.add(str(grad.dtype))
    return out


def _storage(args):
    """Per grad_dtype: the optimizer's gradient bytes after the step's backward, the dtypes of
    the gradients it will read, and (FSDP) the dtypes FSDP keeps between the two micro-batches."""
    import torch.distributed as dist

    data_dir, run_dir, extra = args
    rank = dist.get_rank() if dist.is_initialized() else None
    out = {}
    for grad_dtype in ("fp32", "bf16"):
        cfg, engine = _engine(data_dir, run_dir / grad_dtype, [*extra, f"optim.grad_dtype={grad_dtype}"])
        between, calls = set(), []

        def before_second_forward(_module, _inputs, between=between, calls=calls, model=engine.model):
            calls.append(1)
            if len(calls) == 2:
                between.update(_fsdp_accumulated(model))

        engine.model.register_forward_pre_hook(before_second_forward)
        opt = engine.optimizer
        losses = []
        for step in range(2):
            lm_loss = engine.forward_backward(synthetic_batches(cfg, step, rank))
            nbytes = opt.grad_bytes()
            losses.append(engine.optim_step(lm_loss, step).lm_loss.item())
        dtypes = {str(b.flat.dtype) for b in getattr(opt, "buckets", ())}
        if getattr(opt, "reducer", None) is not None:
            dtypes |= {str(b.flat.dtype) for b in opt.reducer.buckets}
        out[grad_dtype] = dict(bytes=nbytes, buckets=dtypes, between=between, losses=losses)
    return out


LAYOUTS = {
    "replicated": [],
    "replicated-dp2": ["parallel.ep=2"],
    "sharded-dp2": ["parallel.ep=2", "parallel.shard_optimizer=true"],
    "fsdp-dp2": ["parallel.stack=fsdp"],
    "fsdp-one-rank": ["parallel.stack=fsdp"],
}


@pytest.fixture(scope="module")
def dp2_storage(real_text_dir, tmp_path_factory):
    """{layout: rank 0's `_storage`} for the two-rank layouts, all in one spawned group of two."""
    tmp = tmp_path_factory.mktemp("grad-storage")
    names = [name for name in LAYOUTS if "dp2" in name]
    runs = [((real_text_dir, tmp / name, LAYOUTS[name]),) for name in names]
    return dict(zip(names, run_distributed(call_each, 2, _storage, runs)[0]))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_optimizer_keeps_half_the_gradient_bytes(request, real_text_dir, tmp_path, layout):
    """Two micro-batches a step. The ddp stack's optimizers: the gradient storage (buckets, or
    the gradients made per step at dp = 1) is bf16 and half the bytes. FSDP: what it keeps
    between micro-batches is bf16; the shards it hands the optimizer stay fp32 (its cast back)."""
    if "dp2" in layout:
        result = request.getfixturevalue("dp2_storage")[layout]
    else:
        result = _storage((real_text_dir, tmp_path, LAYOUTS[layout]))
    fp32, bf16 = result["fp32"], result["bf16"]
    if layout == "fsdp-dp2":
        assert fp32["between"] == {"torch.float32"} and bf16["between"] == {"torch.bfloat16"}
        assert bf16["bytes"] == fp32["bytes"] > 0
    else:
        assert bf16["bytes"] * 2 == fp32["bytes"] > 0, (bf16["bytes"], fp32["bytes"])
    if layout in ("replicated-dp2", "sharded-dp2"):
        assert fp32["buckets"] == {"torch.float32"} and bf16["buckets"] == {"torch.bfloat16"}
    for a, b in zip(bf16["losses"], fp32["losses"]):
        assert abs(a - b) <= 1e-3 * b, (bf16["losses"], fp32["losses"])


def _layout_losses(args):
    import torch.distributed as dist

    data_dir, run_dir, extra = args
    cfg, engine = _engine(data_dir, run_dir, ["optim.grad_dtype=bf16", *extra])
    rank, losses, norms = dist.get_rank(), [], []
    for step in range(4):
        out = engine.train_step(synthetic_batches(cfg, step, rank), step)
        losses.append(out.lm_loss.item())
        norms.append(out.grad_norm.item())
    params = {n: p.detach().float().numpy().copy() for n, p in engine.model.named_parameters()}
    return losses, norms, params


@pytest.mark.parametrize(
    "weights",
    [[], ["train.precision=bf16", "optim.bf16_weights=true"]],
    ids=["fp32-weights", "bf16-weights"],
)
def test_sharded_steps_as_the_replicated_optimizer_with_bf16_gradients(real_text_dir, tmp_path, weights):
    """Two gloo ranks, ep = 2, clipping off: the same bf16 gradients (each bucket's dp = 2 sum is
    round(a + b) whether all-reduced or reduce-scattered), the same fp32 update per element, so
    losses and parameters are bit for bit the replicated optimizer's."""
    extra = ["parallel.ep=2", "optim.grad_clip=0", *weights]
    sharded = [*extra, "parallel.shard_optimizer=true"]
    runs = [((real_text_dir, tmp_path / "ref", extra),), ((real_text_dir, tmp_path / "got", sharded),)]
    ref, got = run_distributed(call_each, 2, _layout_losses, runs)[0]  # one group, both runs
    assert got[0] == ref[0], (got[0], ref[0])
    assert all((got[2][n] == ref[2][n]).all() for n in ref[2])


def test_with_clipping_only_the_norms_summation_order_differs(real_text_dir, tmp_path):
    """Clipping on (active at every step here): the replicated optimizer sums per-parameter
    squared norms, the sharded one per-shard ones and then an all-reduce, so the fp32 norms, and
    with them the clipping factor, differ in their last bits (measured ≤ 1.5e-6 relative: the
    norms of bf16 tensors are summed in another order than fp32 ones'; fp32 gradients ≤ 3e-7).
    The first loss is equal (nothing updated yet); the later ones within 1e-6 (measured 8e-8)."""
    extra = ["parallel.ep=2", "optim.grad_clip=0.05"]
    sharded = [*extra, "parallel.shard_optimizer=true"]
    runs = [((real_text_dir, tmp_path / "ref", extra),), ((real_text_dir, tmp_path / "got", sharded),)]
    ref, got = run_distributed(call_each, 2, _layout_losses, runs)[0]  # one group, both runs
    assert all(n > 0.05 for n in ref[1]), ref[1]  # clipping active
    for a, b in zip(got[1], ref[1]):
        assert abs(a - b) <= 5e-6 * b, (got[1], ref[1])
    assert got[0][0] == ref[0][0]
    for a, b in zip(got[0], ref[0]):
        assert abs(a - b) <= 1e-6 * b, (got[0], ref[0])


def _fsdp_losses(args):
    import torch.distributed as dist

    data_dir, run_dir, extra = args
    cfg, engine = _engine(data_dir, run_dir, ["parallel.stack=fsdp", "train.steps=20", *extra])
    batches = synthetic_batches(cfg, 0, dist.get_rank())  # one batch, learned by heart
    return [engine.train_step(batches, step).lm_loss.item() for step in range(20)]


PRECISIONS = ["fp32", "bf16"]


@pytest.fixture(scope="module")
def fsdp_losses(real_text_dir, tmp_path_factory):
    """{(precision, grad_dtype): rank 0's losses}: the four runs in one spawned group of two."""
    tmp = tmp_path_factory.mktemp("fsdp-grad-dtype")
    keys = [(precision, grad_dtype) for precision in PRECISIONS for grad_dtype in ("fp32", "bf16")]
    extras = {"fp32": [], "bf16": ["optim.grad_dtype=bf16"]}
    runs = [((real_text_dir, tmp / f"{p}-{g}", [f"train.precision={p}", *extras[g]]),) for p, g in keys]
    return dict(zip(keys, run_distributed(call_each, 2, _fsdp_losses, runs)[0]))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fsdp_with_bf16_gradients_trains_like_fp32(fsdp_losses, precision):
    """Two gloo ranks, 20 steps on one batch of random tokens: FSDP with the bf16 reduce dtype
    against its own fp32-gradient run, under fp32 and under bf16 compute."""
    fp32, bf16 = fsdp_losses[precision, "fp32"], fsdp_losses[precision, "bf16"]
    assert bf16[-1] < bf16[0] - 0.1, bf16  # it trains
    for a, b in zip(bf16, fp32):
        assert abs(a - b) <= 5e-4 * b, (bf16, fp32)  # measured ≤ 1.3e-4
