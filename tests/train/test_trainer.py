"""The trainer on real text: learning, the metrics contract, exact resume, recompute, masking."""

import json

import pytest
import torch

from moetrain.errors import CheckpointError, ConfigError
from moetrain.train.callbacks import Callback
from moetrain.train.engine import document_ids
from moetrain.train.metrics import read_metrics
from moetrain.train.run_dir import COMPLETE, list_checkpoints, resolve_checkpoint
from moetrain.train.trainer import Trainer

CONTRACT = {
    "step",
    "loss",
    "lm_loss",
    "lb_loss",
    "z_loss",
    "lr",
    "grad_norm",
    "tokens_per_sec",
    "tokens_per_sec_per_device",
    "tflops_per_device",
    "mfu",
    "peak_mem_gib",
    "expert_load_max_over_mean",
    "dropped_token_frac",
    "unused_experts",
}


def test_loss_decreases_on_real_text_and_metrics_follow_the_contract(tiny_cfg, tmp_path):
    cfg = tiny_cfg(
        tmp_path / "run", "train.steps=40", "train.eval_every=20", "logging.plot=true", "logging.tensorboard=true"
    )
    summary = Trainer(cfg, quiet=True).fit()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 41))
    for r in records:
        assert CONTRACT <= r.keys(), CONTRACT - r.keys()
        assert r["mfu"] is None  # CPU
        assert r["peak_mem_gib"] > 0 and r["tokens_per_sec"] > 0
        assert r["tokens_per_sec_per_device"] == r["tokens_per_sec"]
        assert r["dropped_token_frac"] == 0.0
        assert r["expert_load_max_over_mean"] >= 1.0
        assert len(r["expert_load_by_layer"]) == cfg.model.num_moe_layers
        assert max(r["expert_load_by_layer"]) == pytest.approx(r["expert_load_max_over_mean"], abs=1e-4)
        assert r["loss"] > r["lm_loss"]  # the objective includes the weighted aux losses
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40]
    first, last = records[0]["lm_loss"], records[-1]["lm_loss"]
    assert last < 0.85 * first, (first, last)
    assert summary["final_val_loss"] < 0.9 * summary["initial_val_loss"], summary
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and (run / "loss.png").stat().st_size > 1000
    assert any((run / "tb").iterdir())
    assert (run / "checkpoints" / "step-40" / COMPLETE).is_file()


def _losses(path):
    return {r["step"]: (r["loss"], r["lm_loss"], r["grad_norm"], r["lb_loss"], r["z_loss"]) for r in read_metrics(path)}


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("model.moe.routing=random", "model.moe.bias_update_rate=0.01"),
        ("precision.dtype=bf16", "optim.bf16_weights=true"),  # fp32 masters through DCP and back
        ("optim.name=lion",),
        ("optim.name=lion", "precision.dtype=bf16", "optim.bf16_weights=true", "optim.moments_dtype=bf16"),
    ],
)
def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tiny_cfg, tmp_path, extra):
    full = Trainer(tiny_cfg(tmp_path / "full", *extra), quiet=True)
    full.fit()

    part = Trainer(tiny_cfg(tmp_path / "part", *extra), quiet=True)
    for _ in range(5):
        part.train_step()
    part.save()
    del part
    resumed = Trainer(tiny_cfg(tmp_path / "part", *extra), resume=True, quiet=True)
    assert resumed.step == 5
    resumed.fit()

    a, b = _losses(tmp_path / "full" / "metrics.jsonl"), _losses(tmp_path / "part" / "metrics.jsonl")
    assert all(a[s] == b[s] for s in range(6, 13)), [(a[s], b[s]) for s in range(6, 13) if a[s] != b[s]]
    for (name, p), q in zip(full.engine.model.state_dict().items(), resumed.engine.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_resume_without_checkpoint_starts_fresh_and_keep_last(tiny_cfg, tmp_path):
    t = Trainer(
        tiny_cfg(tmp_path / "run", "checkpoint.save_every=2", "checkpoint.keep_last=2"), resume=True, quiet=True
    )
    assert t.step == 0
    t.fit()
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [10, 12]


def test_incomplete_checkpoints_are_ignored(tiny_cfg, tmp_path):
    t = Trainer(tiny_cfg(tmp_path / "run"), quiet=True)
    t.train_step()
    t.save()
    broken = tmp_path / "run" / "checkpoints" / "step-9"
    broken.mkdir()
    (broken / "trainer_state.json").write_text("{}")
    assert resolve_checkpoint(tmp_path / "run").name == "step-1"
    with pytest.raises(CheckpointError, match="incomplete"):
        resolve_checkpoint(broken)


def test_checkpoint_from_another_shape_is_a_clear_error(tiny_cfg, tmp_path):
    t = Trainer(tiny_cfg(tmp_path / "run"), quiet=True)
    t.save()
    with pytest.raises(CheckpointError, match="different model shape") as e:
        Trainer(tiny_cfg(tmp_path / "run", "model.moe.expert_hidden=48"), resume=True, quiet=True)
    assert "Traceback" not in str(e.value) and "mismatch" in str(e.value)


@pytest.mark.parametrize(
    "mode",
    [
        ["compute.recompute=full"],
        ["compute.recompute=selective"],
        ["compute.recompute=full", "compute.recompute_every=2"],
        ["compute.recompute=selective", "model.moe.routing=random"],
        ["compute.recompute=full", "model.moe.routing=random"],
    ],
)
def test_recompute_matches_plain_training_exactly(tiny_cfg, tmp_path, mode):
    """Full, selective and every-other-block recompute give the same losses, routing and
    gradients as keeping every activation (random routing too: the RNG state is restored)."""
    extra = [m for m in mode if m.startswith("model.")]
    plain = Trainer(tiny_cfg(tmp_path / "a", "train.steps=3", *extra), quiet=True)
    recomputed = Trainer(tiny_cfg(tmp_path / "b", "train.steps=3", *mode), quiet=True)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrapped = [isinstance(b, CheckpointWrapper) for b in recomputed.engine.model.blocks.values()]
    assert wrapped == ([True, False, True] if "compute.recompute_every=2" in mode else [True] * 3)
    # One run after the other from the same RNG state (random routing draws from the global RNG).
    torch.manual_seed(1)
    want = [plain.train_step() for _ in range(3)]
    torch.manual_seed(1)
    got = [recomputed.train_step() for _ in range(3)]
    for x, y in zip(want, got):
        assert torch.equal(x.lm_loss, y.lm_loss)
        assert torch.equal(x.grad_norm, y.grad_norm)
        assert torch.equal(x.routing[0]["tokens_per_expert"], y.routing[0]["tokens_per_expert"])


def test_gradient_accumulation_matches_one_big_micro_batch(tiny_cfg, tmp_path):
    one = Trainer(
        tiny_cfg(tmp_path / "a", "train.micro_batch_size=8", "model.moe.lb_loss_weight=0", "model.moe.z_loss_weight=0"),
        quiet=True,
    )
    two = Trainer(
        tiny_cfg(tmp_path / "b", "train.micro_batch_size=4", "model.moe.lb_loss_weight=0", "model.moe.z_loss_weight=0"),
        quiet=True,
    )
    a, b = one.train_step(), two.train_step()
    torch.testing.assert_close(a.lm_loss, b.lm_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.grad_norm, b.grad_norm, rtol=1e-4, atol=1e-6)


def test_document_masking_trains_and_ids_follow_eos(tiny_cfg, tmp_path):
    ids = document_ids(torch.tensor([[5, 0, 7, 8, 0, 9]]), eos_id=0)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2]]
    t = Trainer(tiny_cfg(tmp_path / "run", "data.document_masking=true", "train.steps=2"), quiet=True)
    out = t.train_step()
    assert torch.isfinite(out.lm_loss)


def test_unwritable_run_dir_is_a_config_error(tiny_cfg, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="not writable"):
        Trainer(tiny_cfg(blocker / "run"), quiet=True)


def test_summary_records_initial_and_final_val_loss(tiny_cfg, tmp_path):
    summary = Trainer(tiny_cfg(tmp_path / "run", "train.steps=2"), quiet=True).fit()
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["initial_val_loss"] == summary["initial_val_loss"] > 0
    assert saved["final_val_loss"] is not None


def test_a_config_changed_after_the_trainer_is_built_leaves_its_run_alone(tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path / "a", "train.steps=2", "train.eval_every=0")
    lr, trainer = cfg.optim.lr, Trainer(cfg, quiet=True)
    cfg.optim.lr = 1e-9  # the next run of a sweep
    trainer.fit()
    assert trainer.cfg.optim.lr == lr  # the rate config.yaml records, and the one that trains
    assert all(r["lr"] > 1e-9 for r in read_metrics(tmp_path / "a" / "metrics.jsonl"))


def test_fit_again_after_an_error_keeps_the_summary(tiny_cfg, tmp_path):
    class FailOnce(Callback):
        def on_step_end(self, trainer, out):
            if trainer.step == 1 and not hasattr(self, "failed"):
                self.failed = True
                raise RuntimeError("a user callback fails")

    trainer = Trainer(tiny_cfg(tmp_path / "run", "train.steps=2"), quiet=True)
    trainer.callbacks.append(FailOnce())
    with pytest.raises(RuntimeError, match="a user callback fails"):
        trainer.fit()
    initial = json.loads((tmp_path / "run" / "summary.json").read_text())["initial_val_loss"]
    summary = trainer.fit()  # goes on from step 1: step 0's loss cannot be measured again
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["initial_val_loss"] == summary["initial_val_loss"] == initial
    assert saved["steps"] == 2 and saved["final_val_loss"] is not None
    assert trainer.fit() == saved  # nothing left to train: the summary stays as it is
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == saved


def test_compiled_blocks_train_like_eager(tiny_cfg, tmp_path):
    eager = Trainer(tiny_cfg(tmp_path / "a", "train.steps=2"), quiet=True)
    compiled = Trainer(tiny_cfg(tmp_path / "b", "train.steps=2", "compute.compile=true"), quiet=True)
    for _ in range(2):
        x, y = eager.train_step(), compiled.train_step()
        torch.testing.assert_close(x.lm_loss, y.lm_loss, rtol=1e-4, atol=1e-4)
    # Compilation leaves parameter names alone: checkpoints interchange with eager models.
    assert list(eager.engine.model.state_dict()) == list(compiled.engine.model.state_dict())


def test_fresh_run_in_a_used_run_dir(tiny_cfg, tmp_path):
    first = Trainer(tiny_cfg(tmp_path / "run", "train.steps=2", "checkpoint.save_final=false"), quiet=True)
    first.fit()
    # No checkpoint: a new run starts a new metrics.jsonl instead of appending to the old one.
    Trainer(tiny_cfg(tmp_path / "run", "train.steps=3", "checkpoint.save_final=false"), quiet=True).fit()
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    # With checkpoints: refuse, and say how to continue.
    t = Trainer(tiny_cfg(tmp_path / "run2", "train.steps=1"), quiet=True)
    t.fit()
    with pytest.raises(ConfigError, match="--resume"):
        Trainer(tiny_cfg(tmp_path / "run2", "train.steps=1"), quiet=True)


def test_profile_switch_records_a_window_of_steps(tiny_cfg, tmp_path):
    """logging.profile=true: steps 3-4 (after 2) are traced; the op table names real kernels."""
    cfg = tiny_cfg(
        tmp_path / "run",
        "train.steps=5",
        "logging.profile=true",
        "logging.profile_wait=2",
        "logging.profile_steps=2",
        "train.eval_every=0",
    )
    Trainer(cfg, quiet=True).fit()
    out = tmp_path / "run" / "profile"
    trace = json.loads((out / "trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}, steps  # the profiler counts from 0
    table = (out / "ops.txt").read_text()
    assert "aten::mm" in table and "2 training steps after 2" in table


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_fp8_trains_close_to_full_precision(tiny_cfg, tmp_path, recipe):
    """precision.fp8=rowwise|mxfp8 on CPU (row-wise: native FP8 linears, emulated FP8 grouped GEMMs,
    and the LM head; MXFP8: emulated products): the same parameters
    (names, initial values), losses within FP8's error of the fp32 run, and its checkpoint loads
    into a model without FP8."""
    from moetrain.model.fp8 import Fp8Linear, MxFp8Linear, fp8_expert_mlp, mxfp8_expert_mlp

    dims = ["model.d_model=64", "model.moe.expert_hidden=32"]
    plain = Trainer(tiny_cfg(tmp_path / "a", "train.steps=4", *dims), quiet=True)
    fp8 = Trainer(
        tiny_cfg(
            tmp_path / "b",
            "train.steps=4",
            f"precision.fp8={recipe}",
            "precision.fp8_select=all",
            "checkpoint.save_every=4",
            *dims,
            *(["precision.fp8_lm_head=true"] if recipe == "rowwise" else []),
        ),  # fmt: skip
        quiet=True,
    )
    linears = [m for m in fp8.engine.model.modules() if isinstance(m, MxFp8Linear if recipe == "mxfp8" else Fp8Linear)]
    head = recipe == "rowwise"  # the FP8 head: row-wise only
    assert len(linears) == 3 * 4 + 3 + head  # 3 blocks × (q, k, v, o) + the dense block's MLP (+ the head)
    assert (fp8.engine.model.lm_head.__class__ is Fp8Linear) == head
    experts = [m for m in fp8.engine.model.modules() if hasattr(m, "w_down_EDF")]
    expert_layer = fp8_expert_mlp if recipe == "rowwise" else mxfp8_expert_mlp
    assert experts and all(getattr(m.mlp, "func", m.mlp) is expert_layer for m in experts)
    for (n, p), (m, q) in zip(plain.engine.model.named_parameters(), fp8.engine.model.named_parameters()):
        assert n == m and torch.equal(p, q)
    fp8.fit()
    plain.fit()
    a = read_metrics(tmp_path / "a" / "metrics.jsonl")
    b = read_metrics(tmp_path / "b" / "metrics.jsonl")
    for x, y in zip(a, b):
        assert y["lm_loss"] == pytest.approx(x["lm_loss"], rel=0.01), (x["step"], x["lm_loss"], y["lm_loss"])
    assert b[-1]["lm_loss"] < b[0]["lm_loss"]
    resumed = Trainer(tiny_cfg(tmp_path / "b", "train.steps=5", *dims), resume=True, quiet=True)
    assert resumed.step == 4


@pytest.mark.parametrize("recipe, hidden, align", [("rowwise", 40, 16), ("mxfp8", 48, 32)])
def test_fp8_refuses_dims_the_kernels_cannot_take(tiny_cfg, tmp_path, recipe, hidden, align):
    with pytest.raises(ConfigError) as e:
        Trainer(tiny_cfg(tmp_path / "run", f"precision.fp8={recipe}", f"model.moe.expert_hidden={hidden}"), quiet=True)
    assert (
        f"precision.fp8={recipe}" in str(e.value)
        and f"divisible by {align}" in str(e.value)
        and str(hidden) in str(e.value)
    )


def test_async_checkpoint_holds_its_steps_values_and_appears_only_when_complete(tiny_cfg, tmp_path):
    """checkpoint.async_save: the save stages the tensors and returns; training goes on and
    changes them; the checkpoint becomes visible at finish_checkpoint() with the values of the
    step it was taken at, and resuming from it reproduces the uninterrupted run."""
    full = Trainer(tiny_cfg(tmp_path / "full"), quiet=True)
    full.fit()
    part = Trainer(tiny_cfg(tmp_path / "part", "checkpoint.async_save=true"), quiet=True)
    for _ in range(5):
        part.train_step()
    where = part.save()
    assert where.name == "step-5" and not where.exists()  # not visible before it is complete
    part.train_step()
    part.train_step()
    part.finish_checkpoint()
    assert (where / COMPLETE).is_file()
    del part
    resumed = Trainer(tiny_cfg(tmp_path / "part", "checkpoint.async_save=true"), resume=True, quiet=True)
    assert resumed.step == 5
    resumed.fit()  # saves at 6 and 12 in the background; fit completes them
    a, b = _losses(tmp_path / "full" / "metrics.jsonl"), _losses(tmp_path / "part" / "metrics.jsonl")
    assert all(a[s] == b[s] for s in range(6, 13))
    assert [c.name for _, c in list_checkpoints(tmp_path / "part")][-1] == "step-12"


def test_compile_overlap_switch(tiny_cfg, tmp_path, monkeypatch):
    """parallel.compile_overlap turns on Inductor's reordering passes (names it knows) and needs
    compute.compile."""
    import torch._inductor.comms as comms
    import torch._inductor.config as inductor_config

    from moetrain.parallel.parallelize import OVERLAP_PASSES

    monkeypatch.setattr(inductor_config, "reorder_for_compute_comm_overlap", False)
    monkeypatch.setattr(inductor_config, "reorder_for_compute_comm_overlap_passes", [])
    with pytest.raises(ConfigError, match="compute.compile=true"):
        Trainer(tiny_cfg(tmp_path / "a", "parallel.compile_overlap=true"), quiet=True)
    Trainer(tiny_cfg(tmp_path / "b", "parallel.compile_overlap=true", "compute.compile=true"), quiet=True)
    assert inductor_config.reorder_for_compute_comm_overlap
    assert inductor_config.reorder_for_compute_comm_overlap_passes == OVERLAP_PASSES
    assert all(hasattr(comms, name) for name in OVERLAP_PASSES)


def test_start_up_says_what_a_run_silently_would_not_do(tiny_cfg, real_text_dir, tmp_path, capsys):
    """Evaluation asked of data without a validation split, and checkpoint.init_from on a resume: the
    start-up notes say that nothing is evaluated, and which of the two a resume reads."""
    import shutil

    from moetrain.data.tokens import read_meta, write_meta

    no_val = tmp_path / "no-val"
    shutil.copytree(real_text_dir, no_val)
    meta = read_meta(no_val)
    meta["splits"]["val"] = {**meta["splits"]["val"], "num_tokens": 0, "num_documents": 0}
    write_meta(no_val, meta)
    Trainer(tiny_cfg(tmp_path / "a", f"data.sources=[{no_val}]", "train.steps=2"))
    assert f"train.eval_every=6, but {no_val} has no validation split" in capsys.readouterr().err

    first = tiny_cfg(tmp_path / "b", "train.steps=6")
    Trainer(first, quiet=True).fit()
    Trainer(tiny_cfg(tmp_path / "b", "train.steps=8", f"checkpoint.init_from={tmp_path / 'b'}"), resume=True)
    err = capsys.readouterr().err
    assert f"resumed from {tmp_path / 'b' / 'checkpoints' / 'step-6'} (step 6); checkpoint.init_from=" in err
    assert "is for a fresh start, not read" in err
