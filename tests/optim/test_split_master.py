"""optim.bf16_weights: bf16 parameters whose fp32 masters are split into the bf16 value and a 16-bit
remainder (src/moetrain/optim/split_master.py). The split is exact, the update is torch AdamW's, the
Triton kernel is the reference's, and a run computes what the fp32-weights bf16 run computes, in
one process, on dp2·ep2 ranks and across a checkpoint."""

import pytest
import torch
from conftest import tiny_overrides
from support.distributed import call_each, run_distributed
from support.steps import (
    ADAMW_HYPER,
    adamw_inputs,
    carry_checkpoint,
    run_in_triton_interpreter,
    saved_state,
    synthetic_batches,
)

from moetrain.errors import ConfigError
from moetrain.optim.adamw import adamw_reference
from moetrain.optim.split_master import join, split_fp32
from moetrain.parallel.dims import ParallelDims, ParallelState
from moetrain.train.engine import TrainEngine

batches = synthetic_batches


SPECIAL = [0.0, -0.0, 1.0, -1.0, 3.3e38, -3.3e38, 1e-45, -1e-40, float("inf"), -float("inf")]


def values(n=200_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-30, 30, n)
    return torch.cat([x, torch.tensor(SPECIAL)])


def test_split_then_join_gives_the_fp32_bits_back():
    x = values()
    hi, lo = split_fp32(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert torch.equal(join(hi, lo).view(torch.int32), x.view(torch.int32))


def test_the_bf16_half_is_the_nearest_bf16_ties_away_from_zero():
    x = values()
    x[:4] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 2.0 - 2**-9])  # exact ties
    hi, _ = split_fp32(x)
    cast = x.to(torch.bfloat16)
    tie = (x.view(torch.int32) & 0xFFFF) == 0x8000
    same = hi.view(torch.int16) == cast.view(torch.int16)
    assert bool(same[~tie].all()), "off ties the bf16 half is torch's round-to-nearest cast"
    # On ties: away from zero (torch: to even), so the magnitude is the larger neighbour.
    assert bool((hi[tie].float().abs() >= x[tie].abs()).all()) and int(tie.sum()) >= 4
    assert hi[0].item() == 1.0 + 2**-7 and hi[2].item() == -(1.0 + 2**-7)


HYPER = ADAMW_HYPER


def test_reference_update_is_torch_adamw_on_the_master_bit_for_bit():
    p, grad, m, v = adamw_inputs()
    hi, lo = split_fp32(p)
    coef = torch.tensor(0.37)
    adamw_reference([hi], [grad], [mm := m.clone()], [vv := v.clone()], [lo], step=3.0, grad_coef=coef, **HYPER)
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    opt.state[ref] = {"step": torch.tensor(2.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    ref.grad = grad * coef
    opt.step()
    assert torch.equal(join(hi, lo), ref.detach())
    assert torch.equal(mm, opt.state[ref]["exp_avg"]) and torch.equal(vv, opt.state[ref]["exp_avg_sq"])


KERNEL_CHECK = r"""
import torch
from moetrain.optim.adamw import adamw_reference
from moetrain.optim.split_master import join, split_fp32
from moetrain.optim.triton_kernels import adamw_triton, bias_corrections
from support.steps import ADAMW_HYPER as HYPER, KERNEL_HYPER, adamw_inputs
p, grad, m, v = adamw_inputs(n=5000)  # not a multiple of the block: the tail is masked
cases = ((torch.tensor(0.5), torch.tensor(False), torch.float32), (None, None, torch.float32),
         (None, torch.tensor(True), torch.float32), (torch.tensor(0.5), None, torch.bfloat16))
for coef, skip, grad_dtype in cases:
    grad = grad.to(grad_dtype)
    hi, lo = split_fp32(p)
    ref = [hi.clone(), lo.clone(), grad, m.clone(), v.clone()]
    if skip is None or not bool(skip):
        adamw_reference([ref[0]], [ref[2]], [ref[3]], [ref[4]], [ref[1]], step=3.0, grad_coef=coef, **HYPER)
    out = [hi.clone(), lo.clone(), grad, m.clone(), v.clone()]
    adamw_triton(*out, bias_corrections(torch.tensor(3.0), 1e-3, 0.9, 0.95), grad_coef=coef, skip=skip, **KERNEL_HYPER)
    a, b = join(ref[0], ref[1]), join(out[0], out[1])
    # fp32 bias corrections on the device against Python's double pow: a few fp32 ulps at most.
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(out[3], ref[3], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(out[4], ref[4], rtol=1e-6, atol=1e-8)
    if skip is not None and bool(skip):
        assert torch.equal(out[0], hi) and torch.equal(out[1], lo) and torch.equal(out[3], m)
print("ok")
"""


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    result = run_in_triton_interpreter(KERNEL_CHECK)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


FLAT_CHECK = r"""
import torch
from moetrain.optim.split_master import split_fp32
from moetrain.optim.triton_kernels import BLOCK, adamw_triton, adamw_triton_flat, bias_corrections
from support.steps import KERNEL_HYPER
g = torch.Generator().manual_seed(0)
corr = bias_corrections(torch.tensor(3.0), 1e-3, 0.9, 0.95)
many = [int(n) for n in torch.randint(0, 3 * BLOCK, (37,), generator=g)] + [0, 1, BLOCK, 0]  # the bisection
for sizes, moments, coef, skip in (
    ([BLOCK * 2 + 5, 1, BLOCK, 3000], torch.float32, torch.tensor(0.5), None),  # tails, one element, a block
    ([BLOCK * 2, 16, BLOCK, 3008], torch.bfloat16, None, torch.tensor(False)),  # 16-aligned: vector loads
    ([BLOCK, 32], torch.float32, None, torch.tensor(True)),
    (many, torch.float32, None, None),  # 21 and 20 tensors a launch, empty ones among them
):
    grad_dtypes = [(torch.bfloat16, torch.float32)[i % 2] for i in range(len(sizes))]  # two launches
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    hi, lo = split_fp32(torch.randn(sum(sizes), generator=g))
    m = (torch.randn(sum(sizes), generator=g) * 1e-3).to(moments)
    v = (torch.rand(sum(sizes), generator=g) * 1e-6).to(moments)
    grads = [(torch.randn(n, generator=g) * 1e-2).to(dt) for n, dt in zip(sizes, grad_dtypes)]
    flat = [t.clone() for t in (hi, lo, m, v)]
    adamw_triton_flat(
        flat[0], flat[1], grads, offsets, flat[2], flat[3], corr, grad_coef=coef, skip=skip, **KERNEL_HYPER
    )
    each = [t.clone() for t in (hi, lo, m, v)]
    for off, n, grad in zip(offsets, sizes, grads):
        part = [t[off : off + n] for t in each]
        adamw_triton(part[0], part[1], grad, part[2], part[3], corr, grad_coef=coef, skip=skip, **KERNEL_HYPER)
    assert all(torch.equal(a, b) for a, b in zip(flat, each))  # the same bits as one launch per tensor
    assert not torch.equal(flat[0], hi) if skip is None or not bool(skip) else torch.equal(flat[0], hi)
print("ok")
"""


def test_one_launch_over_many_tensors_gives_the_bits_of_one_launch_each_in_the_interpreter():
    """`adamw_triton_flat` (a SplitMaster's update: flat parameters and moments, gradients found
    through an address table) against `adamw_triton` tensor by tensor."""
    pytest.importorskip("triton")
    result = run_in_triton_interpreter(FLAT_CHECK)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


ACCUMULATE_CHECK = """
import torch
from moetrain.optim.triton_kernels import ACC_BLOCK, accumulate_grad
g = torch.Generator().manual_seed(0)
for n in (1, ACC_BLOCK - 1, ACC_BLOCK * 3 + 17):
    scale = torch.logspace(-30, 30, n)
    first = (torch.randn(n, generator=g) * scale).to(torch.bfloat16)
    grads = [(torch.randn(n, generator=g) * scale).to(torch.bfloat16) for _ in range(3)]
    want = first.float() + grads[0]
    got = accumulate_grad(first, grads[0])
    assert got.dtype == torch.float32 and torch.equal(got, want) and got.data_ptr() != first.data_ptr()
    for grad in grads[1:]:
        want.add_(grad)
        ptr = got.data_ptr()
        got = accumulate_grad(got, grad)
        assert got.data_ptr() == ptr and torch.equal(got, want)  # in place, same bits as add_
print("ok")
"""


def test_gradient_accumulation_kernel_is_torchs_add_bit_for_bit_in_the_interpreter():
    """The step's second backward sums onto the first one's bf16 gradient into a new fp32
    tensor, later ones add in place: the bits of torch's mixed-dtype add (block edges included)."""
    pytest.importorskip("triton")
    result = run_in_triton_interpreter(ACCUMULATE_CHECK)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.fixture
def bf16_cfg(tiny_cfg, tmp_path):
    def make(bf16_weights: bool, *extra):
        return tiny_cfg(
            tmp_path / "run",
            "train.device=cpu",
            "precision.dtype=bf16",
            f"optim.bf16_weights={str(bf16_weights).lower()}",
            "model.moe.bias_update_rate=0.01",
            *extra,
        )

    return make


def one_process() -> ParallelState:
    return ParallelState(ParallelDims(world_size=1, dp=1, ep=1))


def run_steps(engine, cfg, steps, start=0):
    return [
        (out.lm_loss.item(), out.grad_norm.item())
        for out in (engine.train_step(batches(cfg, s), s) for s in range(start, start + steps))
    ]


@pytest.mark.parametrize("micro_batch", [8, 4])
def test_a_run_with_bf16_weights_computes_what_autocast_computes(bf16_cfg, micro_batch, tmp_path):
    """Same steps, same losses and norms up to bf16 tie rounding and summation order, with one
    backward per step (the bf16 gradients are kept) and two (summed in fp32); the matrices are
    bf16 parameters with no gradient left on them, the rest stays fp32."""
    results, engines = {}, {}
    for flag in (False, True):
        cfg = bf16_cfg(flag, f"train.micro_batch_size={micro_batch}")
        torch.manual_seed(0)
        engines[flag] = TrainEngine(cfg, one_process(), torch.device("cpu"))
        results[flag] = run_steps(engines[flag], cfg, 8)
    for (la, na), (lb, nb) in zip(results[False], results[True]):
        assert abs(la - lb) <= 1e-4 * la and abs(na - nb) <= 1e-2 * na  # bf16 rounding drifts apart
    split = engines[True]
    dtypes = {n: p.dtype for n, p in split.model.named_parameters()}
    assert dtypes["lm_head.weight"] == dtypes["blocks.1.ffn.experts.w_gate_up_E2FD"] == torch.bfloat16
    assert dtypes["embed.weight"] == dtypes["norm.weight"] == dtypes["blocks.1.ffn.router.weight"] == torch.float32
    assert all(p.grad is None for p in split.model.parameters() if p.dtype == torch.bfloat16)
    # The masters moved away from their bf16 values (updates smaller than a bf16 ulp are kept).
    master = saved_state(split, tmp_path / "saved")["model"]["lm_head.weight"]
    assert not torch.equal(master, split.model.lm_head.weight.float())
    # Optimizer state: the remainder (2 B) and two moments (8 B) per split element, as fp32 AdamW's 8 B + 4 B weights.
    numel = sum(p.numel() for p in split.model.parameters() if p.dtype == torch.bfloat16)
    rest = [p.numel() for p in split.model.parameters() if p.dtype == torch.float32]
    assert split.optimizer.memory_bytes() == numel * 10 + sum(rest) * 8 + len(rest) * 4  # + torch's "step"s


def test_checkpoint_state_is_fp32_and_resumes_bit_for_bit(bf16_cfg, tmp_path):
    cfg = bf16_cfg(True)
    torch.manual_seed(0)
    a = TrainEngine(cfg, one_process(), torch.device("cpu"))
    run_steps(a, cfg, 3)
    state = saved_state(a, tmp_path / "whole")
    assert all(v.dtype == torch.float32 for k, v in state["model"].items()), "checkpoints hold fp32 weights"
    assert not torch.equal(state["model"]["lm_head.weight"], a.model.lm_head.weight.float()), "the masters, not bf16"
    b = TrainEngine(cfg, one_process(), torch.device("cpu"))
    # The same checkpoint into a run without bf16 weights: its fp32 weights are the masters.
    c = TrainEngine(bf16_cfg(False), one_process(), torch.device("cpu"))
    carry_checkpoint(a, tmp_path / "saved", b, c)
    assert torch.equal(c.model.lm_head.weight.detach(), state["model"]["lm_head.weight"])
    assert run_steps(a, cfg, 3, start=3) == run_steps(b, cfg, 3, start=3)
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n


def _dp2_ep2_grads(cfg_args):
    import torch.distributed as dist

    from moetrain.presets import resolve_config
    from moetrain.train.runtime import setup_runtime

    data_dir, run_dir, flag = cfg_args
    cfg = resolve_config(
        "tiny",
        tiny_overrides(
            data_dir,
            run_dir,
            "train.device=cpu",
            "precision.dtype=bf16",
            f"optim.bf16_weights={flag}",
            "parallel.ep=2",
            "optim.grad_clip=0",
        ),
    )
    runtime = setup_runtime(cfg)
    torch.manual_seed(0)
    engine = TrainEngine(cfg, runtime.par, runtime.device)
    rank = dist.get_rank()
    engine.forward_backward(synthetic_batches(cfg, 0, rank))
    opt = engine.optimizer
    split = {id(p) for p in opt.split.params} if opt.split is not None else set()
    # numpy: tensors would cross the result queue as shared memory that dies with the worker
    grads = {
        n: (opt.split.grad_of(p) if id(p) in split else p.grad).numpy().copy()
        for n, p in engine.model.named_parameters()
    }
    engine.optim_step(torch.zeros(()), 0)
    losses = [engine.train_step(synthetic_batches(cfg, s, rank), s).lm_loss.item() for s in (1, 2)]
    return grads, losses


def test_dp2_ep2_reduces_the_split_gradients_like_the_fp32_ones(real_text_dir, tmp_path):
    """Two gloo ranks, dp2·ep2: after the first backward every gradient (reduced over dp; the
    experts' over their edp group) equals the fp32-weights run's, then the losses follow it."""
    flags = ("false", "true")
    per_rank = run_distributed(call_each, 2, _dp2_ep2_grads, [((real_text_dir, tmp_path / f, f),) for f in flags])
    out = {flag: [per_rank[rank][i] for rank in range(2)] for i, flag in enumerate(flags)}  # one group, both runs
    for rank in range(2):
        (ga, la), (gb, lb) = out["false"][rank], out["true"][rank]
        for name, a in ga.items():
            a, b = torch.from_numpy(a), torch.from_numpy(gb[name])
            # bf16 products: a tie rounded the other way moves gradients by up to ~1% of their largest
            torch.testing.assert_close(b, a, rtol=0, atol=2e-2 * float(a.abs().max()) + 1e-12, msg=name)
        for x, y in zip(la, lb):
            assert abs(x - y) <= 5e-5 * x


@pytest.mark.parametrize(
    "extra, field",
    [
        (["parallel.stack=fsdp"], "parallel.stack=fsdp"),
        (["precision.dtype=fp32"], "precision.dtype=fp32"),
    ],
)
def test_bf16_weights_refuses_what_it_cannot_do(tiny_cfg, tmp_path, extra, field):
    with pytest.raises(ConfigError, match="optim.bf16_weights") as err:
        tiny_cfg(tmp_path, "optim.bf16_weights=true", *extra)
    assert field in str(err.value)


def test_bf16_weights_with_auto_precision_on_cpu_is_refused(tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path, "optim.bf16_weights=true", "precision.dtype=auto")
    with pytest.raises(ConfigError, match="precision.dtype=auto means fp32 on cpu"):
        cfg.validate(device=torch.device("cpu"))


def _pp2_losses(args):
    import torch.distributed as dist

    from moetrain.presets import resolve_config
    from moetrain.train.runtime import setup_runtime

    data_dir, run_dir, flag = args
    overrides = ["train.device=cpu", "precision.dtype=bf16", f"optim.bf16_weights={flag}", "parallel.pp=2"]
    cfg = resolve_config("tiny", tiny_overrides(data_dir, run_dir, *overrides, "model.n_layers=4"))
    runtime = setup_runtime(cfg)
    torch.manual_seed(0)
    engine = TrainEngine(cfg, runtime.par, runtime.device)
    losses = [engine.train_step(batches(cfg, s), s).lm_loss.item() for s in range(4)]
    return losses if dist.get_rank() == 1 else None  # the last stage's


def test_pp2_with_bf16_weights_follows_the_fp32_weights_run(real_text_dir, tmp_path):
    """Two pipeline stages on gloo (1F1B over two micro-batches): each stage's split parameters
    take their gradients from the schedule's backward passes; the losses follow the fp32-weights run."""
    flags = ("false", "true")
    last_stage = run_distributed(call_each, 2, _pp2_losses, [((real_text_dir, tmp_path / f, f),) for f in flags])[1]
    out = dict(zip(flags, last_stage))  # one group, both runs
    assert all(abs(a - b) <= 1e-4 * a for a, b in zip(out["false"], out["true"])), out
    assert out["true"][-1] < out["true"][0]


def _sharded_beside_replicated(args):
    """dp2·ep2, bf16 weights, no clipping: the sharded optimizer (remainders and moments
    sharded) beside the replicated one on the same rows; then the sharded run's checkpoint state
    loaded into a fresh replicated engine."""
    import torch.distributed as dist

    from moetrain.presets import resolve_config
    from moetrain.train.runtime import setup_runtime

    data_dir, run_dir = args
    common = ["train.device=cpu", "precision.dtype=bf16", "optim.bf16_weights=true", "parallel.ep=2"]
    common += ["optim.grad_clip=0", "model.moe.bias_update_rate=0.01"]

    def engine(shard: bool):
        cfg = resolve_config(
            "tiny", tiny_overrides(data_dir, run_dir, *common, f"parallel.shard_optimizer={str(shard).lower()}")
        )
        torch.manual_seed(0)
        return cfg, TrainEngine(cfg, runtime.par, runtime.device)

    runtime = setup_runtime(resolve_config("tiny", tiny_overrides(data_dir, run_dir, *common)))
    rank = dist.get_rank()
    (cfg, sharded), (_, replicated) = engine(True), engine(False)

    def rows(step):
        return synthetic_batches(cfg, step, rank)

    losses = {"sharded": [], "replicated": []}
    for step in range(4):
        losses["sharded"].append(sharded.train_step(rows(step), step).lm_loss.item())
        losses["replicated"].append(replicated.train_step(rows(step), step).lm_loss.item())
    masters = saved_state(sharded, run_dir / "sharded")["model"]
    ref = saved_state(replicated, run_dir / "replicated")["model"]
    worst = max(((masters[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-12)).item() for k in ref)
    assert all(p.dtype == torch.bfloat16 for n, p in sharded.model.named_parameters() if "attn.wq" in n)
    _, fresh = engine(False)
    carry_checkpoint(sharded, run_dir / "saved", fresh)
    loaded = saved_state(fresh, run_dir / "fresh")["model"]
    exact = all(torch.equal(loaded[k], masters[k]) for k in masters)
    memory = (sharded.optimizer.memory_bytes(), replicated.optimizer.memory_bytes())
    return losses, worst, exact, memory, len(masters)


def test_sharded_optimizer_with_bf16_weights_matches_the_replicated_one(real_text_dir, tmp_path):
    """dp2·ep2 on gloo: the sharded optimizer with bf16 weights (remainders and moments sharded,
    bf16 shards all-gathered) steps exactly as the replicated one, and its checkpoint state's fp32
    masters load into the replicated layout bit for bit."""
    out = run_distributed(_sharded_beside_replicated, 2, (real_text_dir, tmp_path))
    for losses, worst, exact, (sharded_bytes, replicated_bytes), n in out:
        assert n > 0 and exact, "the checkpoint's fp32 masters load into the replicated layout bit for bit"
        # Bit for bit: the same per-element arithmetic, and two ranks' sums do not depend on order.
        assert losses["sharded"] == losses["replicated"] and worst == 0.0, (losses, worst)
        # remainders + moments sharded over dp2 (experts: over edp = 1): less than the replicated state
        assert sharded_bytes < 0.8 * replicated_bytes, (sharded_bytes, replicated_bytes)


SUM_SQUARES_CHECK = """
import torch
from moetrain.optim.triton_kernels import SQ_BLOCK, sum_squares
g = torch.Generator().manual_seed(0)
sizes = [(1, torch.bfloat16), (SQ_BLOCK - 1, torch.float32), (SQ_BLOCK * 3 + 17, torch.bfloat16), (0, torch.float32)]
more = torch.randint(0, 2 * SQ_BLOCK, (29,), generator=g)  # the bisection over many tensors
sizes += [(int(n), (torch.bfloat16, torch.float32)[i % 2]) for i, n in enumerate(more)]
ts = [(torch.randn(n, generator=g) * 10.0 ** float(i % 5 - 2)).to(dt) for i, (n, dt) in enumerate(sizes)]
got = sum_squares(ts)
want = sum(t.double().pow(2).sum() for t in ts)
assert got.dtype == torch.float32 and got.dim() == 0
assert abs(float(got) - float(want)) <= 1e-6 * float(want), (float(got), float(want))
assert torch.equal(sum_squares(ts), got)  # partials summed in a fixed order: the same bits again
print("ok")
"""


def test_sum_of_squares_kernel_matches_float64_in_the_interpreter():
    """The clipping norm's pass on CUDA (`clip._sum_sq`): Σ‖g‖² over bf16 and fp32 tensors of
    any size (block edges, one element, none), within fp32 rounding of the float64 sum."""
    pytest.importorskip("triton")
    result = run_in_triton_interpreter(SUM_SQUARES_CHECK)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
