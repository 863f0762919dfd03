"""Guarded steps: non-finite or spiking updates are skipped without changing any state, counted,
and too many in a row stop the run; a checkpoint never holds NaN or inf."""

import json
import math

import pytest
import torch

from moetrain.errors import CheckpointError
from moetrain.train.guard import StepGuard, TooManySkippedSteps
from moetrain.train.metrics import read_metrics
from moetrain.train.trainer import Trainer


def test_guard_skips_non_finite_and_spikes_and_keeps_its_window_clean():
    guard = StepGuard(window=8, sigma=3.0, max_consecutive=3, device=torch.device("cpu"))
    t = lambda v: torch.tensor(float(v))  # noqa: E731
    losses, norms = [2.0, 2.2, 2.1, 1.9], [1.0, 1.2, 0.9, 1.1]
    decisions = [bool(guard.check(t(a), t(b))) for a, b in zip(losses, norms)]
    assert decisions == [False] * 4  # history still too short for spike detection (< window / 2)
    assert not guard.check(t(2.05), t(1.0))
    history = guard.history_W2.clone()
    assert guard.check(t(50.0), t(1.0))  # loss spike
    assert guard.check(t(2.0), t(80.0))  # gradient-norm spike
    assert guard.check(t(math.nan), t(1.0))
    assert guard.check(t(2.0), t(math.inf))
    assert torch.equal(guard.history_W2, history)  # skipped values never enter the window
    assert int(guard.skipped_total) == 4 and int(guard.consecutive) == 4 and int(guard.count) == 5
    with pytest.raises(TooManySkippedSteps, match="4 optimizer steps in a row"):
        guard.raise_if_stuck(int(guard.consecutive), 10)
    assert not guard.check(t(2.02), t(1.01))
    assert int(guard.consecutive) == 0 and int(guard.count) == 6
    # Its state survives a checkpoint round trip exactly.
    other = StepGuard(window=8, sigma=3.0, max_consecutive=3, device=torch.device("cpu"))
    other.load_state_dict(guard.state_dict())
    assert torch.equal(other.history_W2, guard.history_W2) and int(other.count) == 6


@pytest.mark.parametrize("window", [4, 16])
def test_a_resume_with_another_skip_window_keeps_the_newest_values(window):
    """--resume --guard.skip_window=W: the saved window's newest accepted values, oldest first."""
    saved = StepGuard(window=8, sigma=3.0, max_consecutive=3, device=torch.device("cpu"))
    values = [(2.0 + 0.01 * i, 1.0 + 0.01 * (i % 3)) for i in range(11)]  # wraps the ring of 8
    for loss, norm in values:
        assert not saved.check(torch.tensor(loss), torch.tensor(norm))
    resumed = StepGuard(window=window, sigma=3.0, max_consecutive=3, device=torch.device("cpu"))
    resumed.load_state_dict(saved.state_dict())
    kept = values[-min(8, window) :]
    assert int(resumed.count) == len(kept) and int(resumed.skipped_total) == 0
    assert torch.equal(resumed.history_W2[: len(kept)], torch.tensor(kept, dtype=torch.float32))
    assert resumed.check(torch.tensor(50.0), torch.tensor(1.0))  # a spike over the kept values
    assert not resumed.check(torch.tensor(2.05), torch.tensor(1.01))
    assert int(resumed.count) == len(kept) + 1


def poison(trainer, calls):
    """Make the LM loss NaN on the given micro-batch calls (0-based)."""
    real, seen = trainer.engine.lm_loss, [0]

    def lm_loss(*args):
        loss = real(*args)
        seen[0] += 1
        return loss * math.nan if seen[0] - 1 in calls else loss

    trainer.engine.lm_loss = lm_loss


def snapshot(trainer):
    params = {n: p.detach().clone() for n, p in trainer.engine.model.named_parameters()}
    moments = {
        n: {k: v.clone() for k, v in s.items()} for n, s in trainer.engine.optimizer.checkpoint_tensors().items()
    }
    biases = [m.router.expert_bias_E.clone() for m in trainer.engine.model.moe_layers()]
    return params, moments, biases


def test_a_nan_step_changes_nothing_and_training_goes_on(tiny_cfg, tmp_path):
    trainer = Trainer(
        tiny_cfg(tmp_path / "run", "train.steps=5", "model.moe.bias_update_rate=0.01", "train.eval_every=0"), quiet=True
    )
    trainer.train_step()
    before = snapshot(trainer)
    poison(trainer, calls={0})  # the first micro-batch of the next step
    out = trainer.train_step()
    assert not math.isfinite(out.lm_loss.item())
    after = snapshot(trainer)
    for a, b in zip(before[0].values(), after[0].values()):
        assert torch.equal(a, b)
    for name in before[1]:
        for key in before[1][name]:
            assert torch.equal(before[1][name][key], after[1][name][key]), (name, key)
    for a, b in zip(before[2], after[2]):
        assert torch.equal(a, b)  # the aux-free bias did not move either
    assert int(trainer.engine.guard.skipped_total) == 1
    trainer.fit()  # the remaining steps are normal
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["skipped_steps"] for r in records] == [1, 1, 1]
    assert all(math.isfinite(r["lm_loss"]) for r in records)


def test_too_many_skips_in_a_row_stop_with_the_last_good_checkpoint(tiny_cfg, tmp_path):
    trainer = Trainer(
        tiny_cfg(
            tmp_path / "run",
            "train.steps=8",
            "checkpoint.save_every=2",
            "train.eval_every=0",
            "guard.max_consecutive_skips=3",
        ),
        quiet=True,
    )
    poison(trainer, calls=set(range(6, 100)))  # two micro-batches per step: steps 4, 5, 6, … are NaN
    with pytest.raises(TooManySkippedSteps) as e:
        trainer.fit()
    message = str(e.value)
    assert "3 optimizer steps in a row were skipped" in message and "up to step 6" in message
    # No checkpoint inside the streak (step 4's save waits for an accepted update), and the one
    # named is from before the update that preceded it (step 3's, which made the parameters whose
    # loss spiked at step 4 when a too-large learning rate is the cause): step 2's, which resumes
    # with no skips counted.
    assert "the last good checkpoint is" in message and message.split("checkpoint is ")[1].startswith(
        str(tmp_path / "run" / "checkpoints" / "step-2")
    ), message
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-2"]
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["guard"]["consecutive"] == 0


def test_no_checkpoint_with_nan_parameters(tiny_cfg, tmp_path):
    trainer = Trainer(tiny_cfg(tmp_path / "run", "train.steps=4"), quiet=True)
    trainer.train_step()
    good = trainer.save()
    with torch.no_grad():
        next(trainer.engine.model.parameters())[0] = math.nan
    with pytest.raises(CheckpointError, match="NaN or inf"):
        trainer.save()
    from moetrain.train.run_dir import list_checkpoints

    assert list_checkpoints(tmp_path / "run")[-1][1] == good


def _fsdp_fused(data_dir, run_dir):
    """Rank function: the FSDP stack with torch's fused AdamW (CUDA's default; its CPU kernel
    here) against the foreach path, then a NaN step skipped without a host read."""
    from unittest import mock

    from conftest import tiny_overrides

    from moetrain.presets import resolve_config

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    out = {}
    for fused in (False, True):
        cfg = resolve_config(
            "tiny",
            tiny_overrides(
                data_dir,
                f"{run_dir}-{fused}",
                "parallel.stack=fsdp",
                "train.device=cpu",
                "optim.grad_clip=0.05",
                f"optim.fused={fused}",
            ),
        )
        trainer = Trainer(cfg, quiet=True)
        assert trainer.engine.optimizer.fused == fused
        norms = [float(trainer.train_step().grad_norm) for _ in range(3)]
        out[f"params_{fused}"] = [local(p.detach()).numpy().copy() for p in trainer.engine.model.parameters()]
        out[f"norms_{fused}"] = norms
    before = snapshot(trainer)
    poison(trainer, calls={0})
    real_step = trainer.engine.optimizer.step

    def step_without_host_reads(skip=None):
        with mock.patch.object(torch.Tensor, "__bool__", side_effect=AssertionError("host read")):
            real_step(skip)

    trainer.engine.optimizer.step = step_without_host_reads
    trainer.train_step()
    after = snapshot(trainer)
    out["unchanged"] = all(
        torch.equal(local(a), local(b)) for a, b in zip(before[0].values(), after[0].values())
    ) and all(torch.equal(local(before[1][n][k]), local(after[1][n][k])) for n in before[1] for k in before[1][n])
    out["skipped"] = int(trainer.engine.guard.skipped_total)
    return out


def test_fsdp_with_fused_adamw_clips_in_the_kernel_and_skips_on_the_device(real_text_dir, tmp_path):
    from support.distributed import run_distributed

    for r in run_distributed(_fsdp_fused, 2, str(real_text_dir), str(tmp_path / "run")):
        assert min(r["norms_False"]) > 0.05  # clipping was active
        assert r["norms_True"] == pytest.approx(r["norms_False"], rel=1e-5)
        for a, b in zip(r["params_True"], r["params_False"]):
            torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), rtol=1e-5, atol=1e-6)
        assert r["unchanged"] and r["skipped"] == 1
