"""The experts' weight gradients computed once per step (`compute.defer_expert_weight_grad`,
src/moetrain/model/expert_grads.py): the rows laid out expert by expert, the same gradients as
one GEMM per micro-batch, nothing given before the step's last backward, a lost backward named."""

import re

import pytest
import torch
from support.steps import run_in_triton_interpreter, synthetic_batches

from moetrain.errors import ConfigError
from moetrain.model.expert_grads import DeferredExpertGrads, expert_major
from moetrain.model.experts import GroupedExperts
from moetrain.parallel.dims import ParallelDims, ParallelState
from moetrain.train.engine import TrainEngine

E, D, F = 4, 16, 8


def _part(seed: int, counts: list[int], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    M = sum(counts) + pad
    return torch.randn(M, 3, generator=g), torch.randn(M, 5, generator=g), offsets


def test_expert_major_puts_each_experts_rows_of_every_micro_batch_together_and_padding_last():
    parts = [_part(0, [2, 0, 3, 1], 2), _part(1, [0, 4, 1, 1], 0), _part(2, [3, 1, 0, 2], 1)]
    want_dy, want_x, pads = [], [], ([], [])
    for e in range(E):  # a plain loop over experts, then micro-batches
        for dy, x, off in parts:
            lo, hi = (0 if e == 0 else int(off[e - 1])), int(off[e])
            want_dy.append(dy[lo:hi])
            want_x.append(x[lo:hi])
    for dy, x, off in parts:
        pads[0].append(dy[int(off[-1]) :])
        pads[1].append(x[int(off[-1]) :])
    counts = [sum(int(p[2][e]) - (0 if e == 0 else int(p[2][e - 1])) for p in parts) for e in range(E)]
    dy, x, offsets = expert_major(list(parts))
    assert torch.equal(dy, torch.cat(want_dy + pads[0])) and torch.equal(x, torch.cat(want_x + pads[1]))
    assert offsets.dtype == torch.int32 and offsets.tolist() == torch.tensor(counts).cumsum(0).tolist()


KERNEL_CHECK = """
import torch
from moetrain.model import expert_grads
from moetrain.model.expert_major_kernel import copy_rows_expert_major

g = torch.Generator().manual_seed(0)
for N, K in ((24, 40), (512, 256), (300, 7)):  # widths below, at and across the column block
    parts = []
    for p in range(3):
        counts = torch.randint(0, 40, (5,), generator=g)
        counts[p] = 0  # an expert with no rows in this micro-batch
        M = int(counts.sum()) + 2 * p  # and 0, 2, 4 padding rows past the last offset
        parts.append((torch.randn(M, N, generator=g).bfloat16(), torch.randn(M, K, generator=g).bfloat16(),
                      counts.cumsum(0).to(torch.int32)))
    want = expert_grads.expert_major(list(parts))  # index_copy_
    plain, expert_grads._copy_rows = expert_grads._copy_rows, copy_rows_expert_major
    got = expert_grads.expert_major(list(parts))  # the kernel, run by the interpreter
    expert_grads._copy_rows = plain
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (N, K)
print("ok")
"""


def test_the_row_copy_kernel_lays_the_rows_out_as_index_copy_does_in_the_interpreter():
    """src/moetrain/model/expert_major_kernel.py in Triton's interpreter: `expert_major` through
    it gives the torch formulation's layout exactly (empty experts, padding rows, widths that
    are and are not multiples of its column block)."""
    pytest.importorskip("triton")
    result = run_in_triton_interpreter(KERNEL_CHECK)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_the_row_copy_kernel_stores_whole_vectors_on_hopper():
    """Compiled for sm_90 at bench-sweep's widths, the row copy's stores are 16-byte vectors (a
    destination the compiler cannot see is aligned would store element by element)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from moetrain.model import expert_major_kernel as k

    signature = {"dy_ptr": "*bf16", "dy_out_ptr": "*bf16", "x_ptr": "*bf16", "x_out_ptr": "*bf16",
                 "ends_ptr": "*i32", "shift_ptr": "*i64", "M": "i32", "E": "constexpr", "N": "constexpr",
                 "K": "constexpr", "BLOCK_R": "constexpr", "BLOCK_C": "constexpr"}  # fmt: skip
    names = list(signature)
    values = {"E": 64, "N": 2048, "K": 1024, "BLOCK_R": k.BLOCK_R, "BLOCK_C": k.BLOCK_C}
    source = triton.compiler.ASTSource(
        fn=k._expert_major_rows_kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in values.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in range(6)},  # what the launcher assumes of tensors
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    stores = set(re.findall(r"st\.global[.\w]*", ptx))
    assert stores == {"st.global.v4.b32"}, stores


def _experts(deferred: DeferredExpertGrads | None) -> GroupedExperts:
    m = GroupedExperts(E, D, F)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        m.w_gate_up_E2FD.copy_(torch.randn(m.w_gate_up_E2FD.shape, generator=g))
        m.w_down_EDF.copy_(torch.randn(m.w_down_EDF.shape, generator=g))
    m.runtime.expert_grads = deferred
    return m


def _micro_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows sorted by expert (one expert empty), 3 padding rows past the last offset, and dy."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 8, (E,), generator=g)
    counts[seed % E] = 0
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(offsets[-1]) + 3, D, generator=g)
    return x, offsets, torch.randn(x.shape[0], D, generator=g)


def test_one_backward_gives_the_plain_layers_gradients_bit_for_bit():
    """With one backward per step nothing waits: the deferred products' gradients are the plain
    layer's (autograd's grouped GEMM and SwiGLU formulas), bit for bit."""
    plain, deferred = _experts(None), _experts(DeferredExpertGrads())
    x, offsets, dy = _micro_batch(0)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for m, xi in zip((plain, deferred), xs):
        m(xi, offsets).backward(dy)
    valid = int(offsets[-1])
    assert torch.equal(xs[0].grad[:valid], xs[1].grad[:valid])
    for a, b in zip(plain.parameters(), deferred.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_the_last_of_n_backwards_gives_the_sum_of_the_per_micro_batch_gradients():
    """Before the step's last backward the weights get no gradient (None: nothing downstream of
    them runs) while the input gradients are the plain ones; the last gives the sum over the
    micro-batches, up to fp32 summation order; nothing stays held."""
    plain, held = _experts(None), _experts(DeferredExpertGrads())
    held.runtime.expert_grads.begin(3)
    for i in range(3):
        x, offsets, dy = _micro_batch(10 + i)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        plain(xs[0], offsets).backward(dy)
        held(xs[1], offsets).backward(dy)
        valid = int(offsets[-1])
        assert torch.equal(xs[0].grad[:valid], xs[1].grad[:valid])
        if i < 2:
            assert held.w_gate_up_E2FD.grad is None and held.w_down_EDF.grad is None
            assert held.runtime.expert_grads.held_bytes() > 0
    held.runtime.expert_grads.finish()
    assert held.runtime.expert_grads.held_bytes() == 0
    for a, b in zip(plain.parameters(), held.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-4)


def test_a_step_whose_backwards_miss_a_layer_stops_naming_the_setting():
    m = _experts(DeferredExpertGrads())
    m.runtime.expert_grads.begin(3)
    x, offsets, dy = _micro_batch(0)
    m(x, offsets).backward(dy)
    with pytest.raises(
        RuntimeError, match="compute.defer_expert_weight_grad: 2 expert products saw fewer than the step's 3"
    ):
        m.runtime.expert_grads.finish()
    m.runtime.expert_grads.begin(1)  # the next step starts clean
    m(x, offsets).backward(dy)
    m.runtime.expert_grads.finish()


def _engine(tiny_cfg, run_dir, *extra):
    cfg = tiny_cfg(run_dir, "train.device=cpu", "train.global_batch_size=12", "train.micro_batch_size=4", *extra)
    torch.manual_seed(0)
    return cfg, TrainEngine(cfg, ParallelState(ParallelDims(world_size=1, dp=1, ep=1)), torch.device("cpu"))


BF16_WEIGHTS = ["precision.dtype=bf16", "optim.bf16_weights=true"]  # split masters keep the gradients
BF16_GRADS = ["precision.dtype=bf16", "optim.grad_dtype=bf16"]  # GradStore keeps them, in bf16


@pytest.mark.parametrize(
    "extra, loss_rel, norm_rel, fp32_grads",
    [
        ([], 1e-5, 1e-5, True),
        (["precision.fp8=rowwise", "precision.fp8_select=all"], 1e-5, 1e-4, False),  # bf16 experts
        (["model.moe.top_k=1"], 1e-5, 1e-4, True),
        (BF16_WEIGHTS, 1e-5, 1e-3, False),
        (BF16_GRADS, 1e-5, 1e-3, False),
        (["optim.name=muon"], 1e-5, 1e-4, True),
    ],
)
def test_training_steps_match_the_per_micro_batch_gradients(tiny_cfg, tmp_path, extra, loss_rel, norm_rel, fp32_grads):
    """Three micro-batches per step, three steps: the same losses and gradient norms as the
    plain engine up to fp32 summation order (bf16 rounding in FP8's emulated products, and where
    the gradients are bf16: the deferred one is rounded once, the plain sum per micro-batch),
    with bf16 experts under row-wise FP8 too, and with the gradients kept by the split masters
    and by a bf16 gradient store, whose hooks see the earlier backwards give the experts none, and
    under Muon."""
    cfg, plain = _engine(tiny_cfg, tmp_path / "a", *extra)
    _, held = _engine(tiny_cfg, tmp_path / "b", "compute.defer_expert_weight_grad=true", *extra)
    assert held.model.runtime.expert_grads is not None and plain.model.runtime.expert_grads is None
    for step in range(3):
        a = plain.train_step(synthetic_batches(cfg, step), step)
        b = held.train_step(synthetic_batches(cfg, step), step)
        assert b.lm_loss.item() == pytest.approx(a.lm_loss.item(), rel=loss_rel)
        assert b.grad_norm.item() == pytest.approx(a.grad_norm.item(), rel=norm_rel)
    # Parameters only where the expert gradients are fp32: a bf16 one is rounded once deferred and
    # once per micro-batch plain, which AdamW's normalized step turns into differences of lr scale.
    if fp32_grads:
        for (name, p), q in zip(plain.model.named_parameters(), held.model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)


def test_mxfp8_is_refused_and_one_micro_batch_defers_nothing(tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match="precision.fp8=mxfp8"):
        tiny_cfg(tmp_path / "a", "precision.fp8=mxfp8", "compute.defer_expert_weight_grad=true")
    _, engine = _engine(tiny_cfg, tmp_path / "b", "train.global_batch_size=4", "compute.defer_expert_weight_grad=true")
    assert engine.model.runtime.expert_grads is None
    assert all(m.runtime.expert_grads is None for m in engine.model.modules() if isinstance(m, GroupedExperts))


def test_fsdp_is_refused_where_its_kept_gradients_and_the_deferred_ones_differ_in_dtype():
    """FSDP keeps the earlier micro-batches' gradients in optim.grad_dtype; a deferred expert
    gradient comes in the compute dtype; its reduce-scatter cannot mix them (an AssertionError
    from torch on every rank after the first step's backward)."""
    from moetrain.presets import resolve_config

    fsdp = ["parallel.stack=fsdp", "compute.defer_expert_weight_grad=true"]
    fsdp += ["train.global_batch_size=8", "train.micro_batch_size=4"]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for extra, device, want in (
        (["precision.dtype=bf16"], cpu, "optim.grad_dtype=bf16"),
        (["optim.grad_dtype=bf16"], cpu, "optim.grad_dtype=fp32"),
        ([], cuda, "optim.grad_dtype=bf16"),  # auto: bf16 on CUDA
    ):
        cfg = resolve_config("tiny", fsdp + extra)
        with pytest.raises(ConfigError, match=re.escape(f"needs {want}")):
            cfg.validate(2, device)
    for extra in ([], ["precision.dtype=bf16", "optim.grad_dtype=bf16"]):
        resolve_config("tiny", fsdp + extra).validate(2, cpu)
    resolve_config("tiny", [*fsdp, "precision.dtype=bf16"]).validate(1, cpu)  # one rank: nothing is sharded


def test_compiled_blocks_run_the_deferred_products_eagerly_with_the_same_steps(tiny_cfg, tmp_path):
    """The deferred products are eager islands in compiled blocks (their backward keeps tensors
    across micro-batches): compiled and eager engines give the same steps up to fp32 rounding."""
    defer = "compute.defer_expert_weight_grad=true"
    cfg, eager = _engine(tiny_cfg, tmp_path / "a", defer)
    _, compiled = _engine(tiny_cfg, tmp_path / "b", defer, "compute.compile=true")
    for step in range(2):
        a = eager.train_step(synthetic_batches(cfg, step), step)
        b = compiled.train_step(synthetic_batches(cfg, step), step)
        assert b.lm_loss.item() == pytest.approx(a.lm_loss.item(), rel=1e-5)
        assert b.grad_norm.item() == pytest.approx(a.grad_norm.item(), rel=1e-5)


def test_a_step_that_fails_midway_frees_the_kept_operands(tiny_cfg, tmp_path, monkeypatch):
    """A micro-batch that raises (out of memory, say) after an earlier one's backward kept its
    operands: the engine drops them before the error leaves `forward_backward`, and the next step
    trains as usual."""
    cfg, engine = _engine(tiny_cfg, tmp_path / "a", "compute.defer_expert_weight_grad=true")
    real, calls = engine.lm_loss, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            assert engine.model.runtime.expert_grads.held_bytes() > 0  # the first micro-batch's operands
            raise torch.OutOfMemoryError("injected")
        return real(*args)

    monkeypatch.setattr(engine, "lm_loss", failing)
    with pytest.raises(torch.OutOfMemoryError):
        engine.forward_backward(synthetic_batches(cfg, 0))
    assert (
        engine.model.runtime.expert_grads.held_bytes() == 0 and engine.model.runtime.expert_grads.backward_passes == 1
    )
    engine.optimizer.zero_grad()
    out = engine.train_step(synthetic_batches(cfg, 1), 0)
    assert torch.isfinite(out.lm_loss) and torch.isfinite(out.grad_norm)


def test_frozen_experts_keep_nothing():
    """Experts whose weights take no gradient (frozen) keep no operands for one."""
    m = _experts(DeferredExpertGrads())
    m.requires_grad_(False)
    m.runtime.expert_grads.begin(2)
    x, offsets, dy = _micro_batch(0)
    x.requires_grad_()
    m(x, offsets).backward(dy)
    assert x.grad is not None and m.runtime.expert_grads.held_bytes() == 0
    m.runtime.expert_grads.finish()
