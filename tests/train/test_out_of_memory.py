"""A training step that runs out of device memory ends the run with one paragraph — the step, the
peak, the device's capacity, what `moetrain plan` suggests — and the last complete checkpoint
intact, no partial one left. The OOM is injected here (CPU); tests/gpu/test_cuda.py makes a real
one on a GPU."""

import pytest
import torch
from conftest import tiny_overrides

from moetrain.cli import main
from moetrain.memory_advice import advice
from moetrain.plan import plan_gpu
from moetrain.train import oom
from moetrain.train.checkpoint_index import diagnose
from moetrain.train.engine import TrainEngine
from moetrain.train.run_dir import list_checkpoints
from moetrain.train.trainer import Trainer

TORCH_SAYS = (
    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 139.81 GiB of which 3.12 GiB "
    "is free. Including non-PyTorch memory, this process has 136.68 GiB memory in use."
)


def files(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


def out_of_memory_at(monkeypatch, n, trainer=None):
    """The `n`-th training step (of `trainer`, or of every engine) raises torch's OutOfMemoryError."""
    calls = []
    real = TrainEngine.train_step

    def step(self, batches, step):
        calls.append(step)
        if len(calls) == n:
            raise torch.OutOfMemoryError(TORCH_SAYS)
        return real(self, batches, step)

    if trainer is None:
        monkeypatch.setattr(TrainEngine, "train_step", step)
    else:
        monkeypatch.setattr(trainer.engine, "train_step", step.__get__(trainer.engine))


def on_an_h200(monkeypatch):
    monkeypatch.setattr(oom, "device_memory", lambda device: (int(101.5 * 2**30), int(139.8 * 2**30), "NVIDIA H200"))


@pytest.mark.parametrize("async_checkpoint", [False, True])
def test_out_of_memory_stops_with_the_last_checkpoint_intact(tiny_cfg, tmp_path, monkeypatch, async_checkpoint):
    run = tmp_path / "run"
    cfg = tiny_cfg(
        run, "train.steps=6", "checkpoint.save_every=2", f"checkpoint.async_save={str(async_checkpoint).lower()}"
    )
    trainer = Trainer(cfg, quiet=True)
    out_of_memory_at(monkeypatch, 3, trainer)
    on_an_h200(monkeypatch)
    with pytest.raises(oom.OutOfMemory) as e:
        trainer.fit()
    message = str(e.value)
    step2 = run / "checkpoints" / "step-2"
    for words in (
        "Out of memory on NVIDIA H200 in step 3 (after earlier steps succeeded, when it tried to allocate 20.00 GiB)",
        "the peak of allocated memory was 101.5 GiB of the device's 139.8 GiB",
        "`moetrain plan CONFIG --gpus N`",
        f"the last good checkpoint, {step2}, is intact",
    ):
        assert words in message, (words, message)
    # The background write of step 2 was completed; nothing partial is left.
    assert [s for s, _ in list_checkpoints(run)] == [2] and diagnose(step2) is None
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    before = files(step2)
    resumed = Trainer(tiny_cfg(run, "train.steps=6", "checkpoint.save_every=2"), resume=True, quiet=True)
    assert resumed.step == 2 and files(step2) == before


def train_args(data_dir, run):
    return ["train", "tiny", *[f"--{o}" for o in tiny_overrides(data_dir, run, "checkpoint.save_every=2")], "--quiet"]


def test_the_command_line_adds_the_plans_layout(real_text_dir, tmp_path, monkeypatch, capsys):
    out_of_memory_at(monkeypatch, 3)
    on_an_h200(monkeypatch)
    run = tmp_path / "run"
    assert main(train_args(real_text_dir, run)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Out of memory on NVIDIA H200 in step 3") and err.count("\n") == 1, err
    for words in (
        "`moetrain plan CONFIG --gpus 1 --gpu h200` predicts a peak of",
        "GiB per GPU for this config (dp1 ddp, 4 seq × 2 micro-batches per rank; 139 GiB usable)",
        "the fastest layout it finds that fits is dp1",
        "--train.micro_batch_size=",
        f"the last good checkpoint, {run / 'checkpoints' / 'step-2'}, is intact",
    ):
        assert words in err, (words, err)
    assert "Traceback" not in err


def test_out_of_memory_in_the_first_step(real_text_dir, tmp_path, monkeypatch, capsys):
    out_of_memory_at(monkeypatch, 1)
    run = tmp_path / "run"
    assert main(train_args(real_text_dir, run)) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: Out of memory on cpu in step 1 (the first step of this run") and "Traceback" not in err
    )
    assert "measured on CUDA devices only" in err and "no checkpoint was written yet" in err, err
    assert not (run / "checkpoints").exists()


def test_the_suggested_flags_set_the_suggested_layout(tiny_cfg, tmp_path):
    from moetrain.plan import layout_of, suggest

    extra = ("train.micro_batch_size=8", "compute.recompute=selective")
    cfg = tiny_cfg(tmp_path / "run", *extra)
    best = suggest(cfg, 1, "h200", limit=1)[0]
    flags = best.layout.to_flags(cfg)
    assert flags and all(f.startswith("--") for f in flags)
    got, want = layout_of(tiny_cfg(tmp_path / "run", *extra, *[f[2:] for f in flags]), 1), best.layout
    for key in ("recompute", "shard_optimizer", "rows_per_micro_batch", "micro_batches", "ep", "pp", "stack"):
        assert getattr(got, key) == getattr(want, key), key


def test_the_planners_gpu_is_found_by_name_or_memory():
    assert plan_gpu("NVIDIA H200", 150_000_000_000) == "h200"
    assert plan_gpu("NVIDIA A100-SXM4-80GB", 80 * 2**30) == "a100"
    assert plan_gpu("NVIDIA L40S", 46 * 2**30) == "h100"  # not one the planner knows: nearest in memory
    assert plan_gpu("cpu", None) == "h200"


def test_the_advice_names_the_peak_without_deferred_expert_weight_gradients():
    """With compute.defer_expert_weight_grad the expert operands kept until the step's last backward
    are part of the peak: the advice says what turning it off would leave (bench-sweep-64 keeps
    21.4 GiB of them on one H200)."""
    from moetrain.presets import resolve_config

    on = advice(resolve_config("bench-sweep-64", ["compute.defer_expert_weight_grad=true"]), 1, "h200")
    off = advice(resolve_config("bench-sweep-64"), 1, "h200")
    assert "--compute.defer_expert_weight_grad=false" in on and "defer_expert_weight_grad" not in off
    peak_on, peak_off = (float(t.split("predicts a peak of ")[1].split(" GiB")[0]) for t in (on, off))
    assert peak_on - peak_off == pytest.approx(21.4, abs=0.1)
    assert f"; {peak_off:.1f} GiB with --compute.defer_expert_weight_grad=false" in on
