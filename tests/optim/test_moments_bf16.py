"""optim.moments_dtype=bf16: AdamW's moments in bf16 (src/moetrain/optim/adamw.py), for the replicated,
the sharded and the FSDP optimizer; fp32 arithmetic in each step, moments rounded to nearest."""

import pytest
import torch
from conftest import tiny_overrides
from support.distributed import call_each, run_distributed
from support.steps import ADAMW_HYPER, adamw_inputs, run_in_triton_interpreter, synthetic_batches

from moetrain.optim.adamw import adamw_reference

HYPER = ADAMW_HYPER


def test_bf16_moments_are_the_fp32_update_rounded_to_nearest():
    p, grad, m, v = adamw_inputs(3000, seed=0, moments_dtype=torch.bfloat16)
    ref_p, ref_m, ref_v = p.clone(), m.float(), v.float()
    adamw_reference([ref_p], [grad], [ref_m], [ref_v], step=4.0, grad_coef=None, **HYPER)  # fp32 moments
    adamw_reference([p], [grad], [m], [v], step=4.0, grad_coef=None, **HYPER)
    assert torch.equal(p, ref_p), "the parameter update uses the fp32 moments before rounding"
    assert torch.equal(m, ref_m.bfloat16()) and torch.equal(v, ref_v.bfloat16())


KERNEL_CHECK = r"""
import torch
from moetrain.optim.adamw import adamw_reference
from moetrain.optim.triton_kernels import adamw_triton, bias_corrections
from support.steps import ADAMW_HYPER as hyper, KERNEL_HYPER, adamw_inputs
p, grad, m, v = adamw_inputs(5000, seed=0, moments_dtype=torch.bfloat16)
ref = [p.clone(), grad, m.clone(), v.clone()]
adamw_reference(*([t] for t in ref), step=4.0, grad_coef=torch.tensor(0.5), **hyper)
out = [p.clone(), grad, m.clone(), v.clone()]
adamw_triton(out[0], None, out[1], out[2], out[3], bias_corrections(torch.tensor(4.0), 1e-3, 0.9, 0.95),
             grad_coef=torch.tensor(0.5), skip=None, **KERNEL_HYPER)
torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-8)
# bf16 moments: equal, or one bf16 step apart where the fp32 values straddle a rounding boundary
for a, b in ((out[2], ref[2]), (out[3], ref[3])):
    steps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 0.01, float((steps > 0).float().mean())
print("ok")
"""


def test_kernel_with_bf16_moments_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    result = run_in_triton_interpreter(KERNEL_CHECK)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_bf16_moments_halve_the_state_and_train_like_fp32(tiny_cfg, tmp_path):
    """tiny on real text, 60 steps: within 1% of the fp32-moment run's loss, at half the state."""
    from moetrain.train.metrics import read_metrics
    from moetrain.train.trainer import Trainer

    out = {}
    for dtype in ("fp32", "bf16"):
        trainer = Trainer(
            tiny_cfg(tmp_path / dtype, "train.steps=60", "train.eval_every=0", f"optim.moments_dtype={dtype}"),
            quiet=True,
        )
        trainer.fit()
        out[dtype] = (read_metrics(tmp_path / dtype / "metrics.jsonl")[-1]["lm_loss"], trainer.engine.optimizer)
    (fp32_loss, fp32_opt), (bf16_loss, bf16_opt) = out["fp32"], out["bf16"]
    assert abs(bf16_loss - fp32_loss) <= 0.01 * fp32_loss, (bf16_loss, fp32_loss)
    moments = [t for s in bf16_opt.adamw.state.values() for k, t in s.items() if k != "step"]
    assert {t.dtype for t in moments} == {torch.bfloat16}
    assert bf16_opt.memory_bytes() < 0.55 * fp32_opt.memory_bytes()


def test_resume_with_bf16_moments_is_bit_for_bit(tiny_cfg, tmp_path):
    from moetrain.train.metrics import read_metrics
    from moetrain.train.trainer import Trainer

    extra = ("optim.moments_dtype=bf16", "train.eval_every=0")
    Trainer(tiny_cfg(tmp_path / "full", *extra), quiet=True).fit()
    part = Trainer(tiny_cfg(tmp_path / "part", *extra), quiet=True)
    for _ in range(5):
        part.train_step()
    part.save()
    del part
    Trainer(tiny_cfg(tmp_path / "part", *extra), resume=True, quiet=True).fit()
    a, b = (
        {r["step"]: (r["lm_loss"], r["grad_norm"]) for r in read_metrics(tmp_path / run / "metrics.jsonl")}
        for run in ("full", "part")
    )
    assert all(a[s] == b[s] for s in range(6, 13))


def _layout_losses(args):
    import torch.distributed as dist

    from moetrain.presets import resolve_config
    from moetrain.train.engine import TrainEngine
    from moetrain.train.runtime import setup_runtime

    data_dir, run_dir, extra = args
    cfg = resolve_config(
        "tiny",
        tiny_overrides(data_dir, run_dir, "train.device=cpu", "optim.moments_dtype=bf16", "optim.grad_clip=0", *extra),
    )
    runtime = setup_runtime(cfg)
    torch.manual_seed(0)
    engine = TrainEngine(cfg, runtime.par, runtime.device)
    rank, losses = dist.get_rank(), []
    for step in range(4):
        losses.append(engine.train_step(synthetic_batches(cfg, step, rank), step).lm_loss.item())
    return losses


@pytest.mark.parametrize(
    "extra, exact",
    [
        (["parallel.ep=2", "parallel.shard_optimizer=true"], True),
        (["parallel.ep=2", "parallel.shard_optimizer=true", "train.precision=bf16", "optim.bf16_weights=true"], None),
        (["parallel.stack=fsdp"], False),
    ],
)
def test_every_optimizer_takes_bf16_moments(real_text_dir, tmp_path, extra, exact):
    """Two gloo ranks: the sharded optimizer (fp32 and bf16 weights) and FSDP's against the
    replicated one with bf16 moments on the same rows. fp32 sharded: the same per-element
    arithmetic, bit for bit; FSDP (its own reduction order): within 1e-5."""
    ep = ["parallel.ep=2"] if "parallel.ep=2" in extra else []
    weights = [x for x in extra if "bf16" in x]
    runs = [((real_text_dir, tmp_path / "ref", ep + weights),), ((real_text_dir, tmp_path / "got", extra),)]
    ref, got = run_distributed(call_each, 2, _layout_losses, runs)[0]  # one group, both runs
    if exact is not False:
        assert got == ref, (got, ref)
    else:
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got, ref)), (got, ref)


def test_a_bf16_moment_checkpoint_resumes_with_fp32_moments(tiny_cfg, tmp_path):
    """DCP converts the saved moments into the resuming run's dtype (both ways)."""
    from moetrain.train.trainer import Trainer

    run = tmp_path / "run"
    first = Trainer(tiny_cfg(run, "optim.moments_dtype=bf16", "train.eval_every=0"), quiet=True)
    for _ in range(3):
        first.train_step()
    first.save()
    saved = {n: s["exp_avg_sq"].clone() for n, s in first.engine.optimizer.checkpoint_tensors().items()}
    resumed = Trainer(tiny_cfg(run, "optim.moments_dtype=fp32", "train.eval_every=0"), resume=True, quiet=True)
    loaded = resumed.engine.optimizer.checkpoint_tensors()
    assert resumed.step == 3
    for name, value in saved.items():
        assert loaded[name]["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(loaded[name]["exp_avg_sq"], value.float()), name
    resumed.fit()
