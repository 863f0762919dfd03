"""`moetrain plan`: its memory model against peaks measured on one and two H200s, its parameter
accounting against the real pipeline/expert split, the reference layouts, the CLI contract and the
launch scripts it validates."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.plan import GIB, Assumptions, ParamGroups, layout_of, memory_per_rank, plan
from moetrain.presets import resolve_config

ROOT = Path(__file__).resolve().parents[1]

# Peak allocated GiB measured with `moetrain bench` (rank 0's peak) on H200s, torch 2.11; each row's
# run is in docs/benchmarks.md (section named in the comment). The planner must land within 10%.
# These runs computed the loss the plain way (before train.loss_chunk_tokens): PLAIN_LOSS.
PLAIN_LOSS = "train.loss_chunk_tokens=0"
# ... and all rows but MEASURED_BF16_WEIGHTS with fp32 weights under autocast (before optim.bf16_weights).
FP32_WEIGHTS = "optim.bf16_weights=false"
# ... and the ep2 nosync rows with its padded buffers (ep × the rows), before the capacity default.
PADDED = "parallel.capacity_factor=null"
MEASURED = [
    # "The planner against measured peaks" and "Activation recompute on bench-8e"
    ("bench-8e", 1, [], 84.7),
    ("bench-8e", 1, ["train.recompute=selective"], 71.4),
    ("bench-8e", 1, ["train.recompute=full"], 69.3),
    ("bench-8e", 1, ["train.compile=false"], 91.6),  # "Compiled blocks"
    ("bench-8e", 1, ["train.fp8=rowwise"], 81.2),  # "The planner against measured peaks"
    ("bench-tiny64e-l6", 1, [], 91.7),
    ("bench-small32e", 1, [], 60.2),
    # "Expert count at constant active parameters" (8 micro-batches per step)
    ("bench-sweep-8", 1, [], 30.7),
    ("bench-sweep-16", 1, [], 36.6),
    ("bench-sweep-32", 1, [], 48.4),
    ("bench-sweep-64", 1, [], 72.1),
    # "Scaling and the pipeline" (nosync in its padded mode then: PADDED)
    # (Two rows, bench-tiny64e-l6 at dp2·ep2 with one micro-batch, 80.1 GiB padded nosync and 80.5
    # alltoall, were measured when the experts' gradients at edp = 1 sat in persistent reducer
    # buckets. Since c67d6f0 they are made during backward, as at dp = 1, and the planner predicts
    # 70.7 and 68.8 for them: they are to be measured again when two GPUs are lent.)
    # (The fsdp row, 67.3 GiB on two H200s, was measured before the fsdp stack all-gathered bf16
    # parameters with a MixedPrecisionPolicy: the planner now predicts 57.4 for it, without autocast's
    # weight copies; it is to be measured again when two GPUs are lent.)
    ("sweep-8l-8", 1, ["train.global_batch_size=1", "train.micro_batch_size=1", "train.compile=true"], 71.8),
    (
        "sweep-8l-8",
        2,
        ["train.global_batch_size=2", "train.micro_batch_size=2", "train.compile=true", "parallel.ep=2", PADDED],
        68.8,
    ),
    (
        "sweep-8l-16",
        2,
        ["train.global_batch_size=2", "train.micro_batch_size=2", "train.compile=true", "parallel.ep=2", PADDED],
        92.4,
    ),
    ("bench-small32e", 1, ["train.global_batch_size=8", "train.micro_batch_size=2"], 67.0),
    ("bench-small32e", 2, ["train.global_batch_size=16", "train.micro_batch_size=4"], 67.0),
    ("bench-small32e", 2, ["train.global_batch_size=16", "train.micro_batch_size=2", "parallel.pp=2"], 34.2),
    # "The planner against measured peaks": predicted first, then measured (out of sample)
    ("bench-8e", 1, ["train.recompute=selective", "train.micro_batch_size=2", "train.global_batch_size=2"], 90.8),
    ("bench-tiny64e-l6", 1, ["train.recompute=full"], 71.48),
    ("bench-small32e", 1, ["train.micro_batch_size=1", "train.global_batch_size=4"], 48.68),
    ("bench-sweep-32", 1, ["train.recompute=selective", "train.recompute_every=2"], 45.98),
]


# The same shapes with the chunked loss (train.loss_chunk_tokens: 4096 on CUDA by default),
# docs/benchmarks.md "Memory"; predicted before they were measured.
MEASURED_CHUNKED_LOSS = [
    ("bench-8e", 1, [], 80.30),
    ("bench-tiny64e-l6", 1, [], 77.31),
    ("bench-small32e", 1, [], 45.34),
    ("bench-tiny64e-l6", 1, ["train.loss_chunk_tokens=2048"], 75.77),
    ("bench-8e", 1, ["train.loss_chunk_tokens=2048"], 78.76),
]


@pytest.mark.parametrize("preset, gpus, overrides, measured", MEASURED_CHUNKED_LOSS)
def test_predicted_peak_with_the_chunked_loss_is_within_10_percent(preset, gpus, overrides, measured):
    predicted = plan(resolve_config(preset, [*overrides, FP32_WEIGHTS]), gpus, "h200").peak_mem_gib_per_device
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


# optim.bf16_weights (CUDA's default), chunked loss, one H200, commit 940d069 (docs/benchmarks.md,
# "bf16 weights with split fp32 masters").
MEASURED_BF16_WEIGHTS = [
    ("bench-8e", 1, [], 72.54),
    ("bench-tiny64e-l6", 1, [], 69.08),
    ("bench-small32e", 1, [], 42.14),
]


@pytest.mark.parametrize("preset, gpus, overrides, measured", MEASURED_BF16_WEIGHTS)
def test_predicted_peak_with_bf16_weights_is_within_10_percent(preset, gpus, overrides, measured):
    predicted = plan(resolve_config(preset, overrides), gpus, "h200").peak_mem_gib_per_device
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


@pytest.mark.parametrize("preset, gpus, overrides, measured", MEASURED)
def test_predicted_peak_is_within_10_percent_of_the_measured_one(preset, gpus, overrides, measured):
    p = plan(resolve_config(preset, [*overrides, PLAIN_LOSS, FP32_WEIGHTS]), gpus, "h200")
    predicted = p.peak_gib_per_pipeline_rank[0]  # these runs' bench reported rank 0's peak
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


# Rehearsed, communication not measured: rank 0 of sweep-8l-{8,32,64,128} at dp8·ep8 alone on
# one H200 (`moetrain bench PRESET --rehearse 8 --parallel.ep=8 …`, its peers stood in for),
# 2026-12-02, tree of commit 1e7e5da, `ROWS=… WORLD=8 WARMUP=2 STEPS=4 bash benchmarks/rehearse.sh`
# (docs/benchmarks.md, "Rehearsed"): the peak while training, while saving this rank's checkpoint
# shard and while loading it back, GiB. "S": the capacity sweep's switches (`target_run` below).
REHEARSED_PEAKS = [
    ("sweep-8l-8", [], 47.7, 31.8, 31.8),
    ("sweep-8l-32", [], 63.5, 43.6, 43.7),
    ("sweep-8l-64", [], 84.5, 59.4, 59.4),
    ("sweep-8l-128", [], 126.6, 90.9, 91.0),
    ("sweep-8l-8", "S", 64.9, 20.6, 20.7),
    ("sweep-8l-32", "S", 74.8, 28.5, 28.6),
    ("sweep-8l-64", "S", 88.0, 39.0, 39.1),
    ("sweep-8l-128", "S", 114.3, 60.0, 60.1),
]


@pytest.mark.parametrize("preset, switches, training, saving, loading", REHEARSED_PEAKS)
def test_rehearsed_peaks_of_the_eight_gpu_sweep_are_within_10_percent(preset, switches, training, saving, loading):
    overrides = ["parallel.ep=8", *(target_run(preset) if switches == "S" else [])]
    p = plan(resolve_config(preset, overrides), 8, "h200")
    assert p.busiest_rank == 0  # the rank rehearsed
    for predicted, measured in (
        (p.peak_mem_gib_per_device, training),
        (p.save_peak_gib_per_device, saving),
        (p.load_peak_gib_per_device, loading),
    ):
        assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


@pytest.mark.parametrize("pp, ep, n_layers", [(1, 1, 4), (2, 2, 5), (3, 2, 4)])
def test_parameters_per_gpu_match_the_real_split(pp, ep, n_layers):
    """The planner's per-GPU parameters are those the pipeline split and the expert split leave
    on the busiest rank (uneven stages included)."""
    from moetrain.optim.grad_reducer import expert_param_ids
    from moetrain.parallel.dims import ParallelDims
    from moetrain.parallel.pipeline import split_model

    overrides = [
        f"model.n_layers={n_layers}",
        f"parallel.pp={pp}",
        f"parallel.ep={ep}",
        "train.global_batch_size=24",
        f"train.micro_batch_size={2 * ep}",
    ]
    cfg = resolve_config("tiny", overrides)
    gpus = pp * 2 * ep
    dims = ParallelDims(world_size=gpus, dp=2 * ep, ep=ep, pp=pp)
    real = []
    for r in range(pp):
        model = cfg.model.build(device="meta")
        if pp > 1:
            split_model(model, dims, r)
        experts = expert_param_ids(model)
        real.append(sum(p.numel() // (ep if id(p) in experts else 1) for p in model.parameters()))
    p = plan(cfg, gpus, "h100")
    assert p.params_per_pipeline_rank == real
    assert p.params_per_device in real


def test_ultra_128e_fits_a_b300_in_olmo_cores_layout_and_only_with_recompute():
    layout = ["parallel.ep=8", "parallel.pp=8", "parallel.shard_optimizer=true", "train.micro_batch_size=64"]
    fits = plan(resolve_config("ref-ultra-128e", layout + ["train.recompute=full"]), 512, "b300")
    assert (fits.layout.dp, fits.layout.ep, fits.layout.pp) == (64, 8, 8)
    assert fits.fits and fits.peak_mem_gib_per_device < 275
    assert not plan(resolve_config("ref-ultra-128e", layout), 512, "b300").fits
    assert not plan(resolve_config("ref-ultra-128e", layout + ["train.recompute=full"]), 512, "h100").fits


def test_plan_cli_prints_a_table_and_ends_with_one_json_line(capsys):
    assert main(["plan", "bench-8e", "--gpus", "1", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert any("optimizer state" in line for line in out) and any("layouts that fit" in line for line in out)
    record = json.loads(out[-1])
    for key in (
        "peak_mem_gib_per_device",
        "fits",
        "step_time_s",
        "mfu",
        "params_per_device",
        "comm_gb_per_step",
        "activations_without_recompute_gib",
        "activations_full_recompute_gib",
        "suggested",
    ):
        assert key in record, key
    assert record["fits"] is True and 0 < record["mfu"] < 1 and record["suggested"]
    assert main(["plan", "bench-8e", "--gpus", "1", "--gpu", "h100", "--no-suggest", f"--{FP32_WEIGHTS}"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["fits"] is False  # ~80 GiB: not in 80


@pytest.mark.parametrize(
    "argv, words",
    [
        (["plan", "tiny", "--gpus", "2", "--gpu", "v100"], ["--gpu='v100'", "h200"]),
        (["plan", "tiny", "--gpus", "4", "--parallel.ep=3"], ["parallel.ep=3"]),
        (["plan", "tiny", "--gpus", "4", "--parallel.pp=2", "--micro-batch", "0"], ["--micro-batch=0"]),
    ],
)
def test_plan_cli_names_bad_input(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and all(w in err for w in words), err


LAUNCH = sorted((ROOT / "scripts" / "launch").glob("ref-*.sh"))


def test_every_reference_preset_has_a_launch_script():
    from moetrain.presets import PRESETS

    assert sorted(p.stem for p in LAUNCH) == sorted(n for n in PRESETS if n.startswith("ref-"))


@pytest.fixture(scope="module")
def launch_plans():
    """{script: (returncode, stdout, stderr)} of `bash SCRIPT plan --no-suggest` for every launch
    script, run side by side (each is one interpreter start on one core)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    procs = {
        script: subprocess.Popen(
            ["bash", str(script), "plan", "--no-suggest"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for script in LAUNCH
    }
    outputs = {script: proc.communicate(timeout=300) for script, proc in procs.items()}
    return {script: (procs[script].returncode, *outputs[script]) for script in LAUNCH}


@pytest.mark.parametrize("script", LAUNCH, ids=lambda p: p.stem)
def test_launch_script_layout_fits_by_the_planner(launch_plans, script):
    returncode, stdout, stderr = launch_plans[script]
    assert returncode == 0, stderr
    assert "note:" not in stderr, stderr  # the flags use today's key names
    record = json.loads(stdout.strip().splitlines()[-1])
    text = script.read_text()
    nodes = int(text.split("NODES=${NODES:-")[1].split("}")[0])
    assert record["gpus"] == 8 * nodes and record["preset"] == script.stem
    assert record["fits"], record
    # Checkpoints never gather: every layout also fits while a checkpoint is
    # saved or loaded, and needs no more for it than for a training step.
    assert record["fits_while_saving"] and record["fits_while_loading"], record
    for key in ("save_peak_gib_per_device", "load_peak_gib_per_device"):
        assert 0 < record[key] <= record["peak_mem_gib_per_device"], (key, record)


def test_step_time_of_the_two_gpu_expert_parallel_run():
    """sweep-8l-8 at dp2·ep2, 8 sequences of 4096 per GPU per step, measured on two H200s
    (docs/measurements.md, "At the preset's batch": compiled blocks; nosync in its padded mode
    then): 1.5264 s, predicted from constants of other runs."""
    cfg = resolve_config(
        "sweep-8l-8",
        [
            "parallel.ep=2",
            "train.compile=true",
            PADDED,
            "train.global_batch_size=16",
            "train.micro_batch_size=2",
            PLAIN_LOSS,
            FP32_WEIGHTS,
        ],
    )
    assert plan(cfg, 2, "h200").step_time_s == pytest.approx(1.5264, rel=0.10)


@pytest.mark.parametrize("preset_name", sorted(__import__("moetrain.presets", fromlist=["PRESETS"]).PRESETS))
def test_parameter_groups_add_up_to_the_built_models_count(preset_name):
    """The planner's parameter groups (its components' declarations) add up to the parameters of
    the model a meta-device build holds."""
    from moetrain.model.counting import count_params
    from moetrain.plan import ParamGroups

    m = resolve_config(preset_name).model
    g = ParamGroups.of(m)
    total = g.embedding + g.head + m.num_dense_layers * g.dense_block + m.num_moe_layers * (g.moe_dense + g.moe_experts)
    assert total == count_params(m).total == sum(p.numel() for p in m.build(device="meta").parameters())
    assert g.moe_experts == m.moe.num_experts * 3 * m.d_model * m.moe.expert_hidden


@pytest.mark.parametrize(
    "overrides, ratio",
    [
        ([], 4 / 8),  # replicated: the two moments, 8 → 4 B
        (["parallel.shard_optimizer=true"], 8 / 12),  # fp32 master + moments: 12 → 8 B per shard element
        (["parallel.shard_optimizer=true", "optim.bf16_weights=true"], 6 / 10),  # remainder + moments
        (["parallel.stack=fsdp"], 4 / 8),
    ],
)
def test_bf16_moments_shrink_the_optimizer_state_by_their_bytes(overrides, ratio):
    def optimizer_gib(moments):
        sizes = ["train.micro_batch_size=4", "train.global_batch_size=4"]
        cfg = resolve_config("bench-tiny64e-l6", [*sizes, *overrides, f"optim.moments_dtype={moments}"])
        return plan(cfg, 4, "h200").memory_gib["optimizer"]

    assert optimizer_gib("bf16") == pytest.approx(ratio * optimizer_gib("fp32"), rel=1e-3)


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # replicated, dp4: the reducer's buckets
        ["parallel.shard_optimizer=true"],
        ["parallel.shard_optimizer=true", "optim.bf16_weights=true"],
        ["parallel.stack=fsdp", "train.global_batch_size=8"],  # two micro-batches: FSDP's unsharded gradients
    ],
)
def test_bf16_gradients_halve_the_gradient_bytes_and_their_reduction(overrides):
    """optim.grad_dtype=bf16: the ddp stack's gradients (persistent at dp4: in the peak) take 2 B
    instead of 4 and so do the data-parallel reductions; FSDP keeps its fp32 shards, and its
    unsharded gradients between micro-batches (4 B × the local parameters) take 2 B."""

    def planned(grad_dtype):
        sizes = ["train.micro_batch_size=4", "train.global_batch_size=4"]
        cfg = resolve_config("bench-tiny64e-l6", [*sizes, *overrides, f"optim.grad_dtype={grad_dtype}"])
        return plan(cfg, 4, "h200")

    fp32, bf16 = planned("fp32"), planned("bf16")
    if "parallel.stack=fsdp" in overrides:
        assert bf16.memory_gib["grads"] == fp32.memory_gib["grads"]
        unsharded = fp32.params_per_device * 4  # FSDP holds 1/dp of them, dp = 4
        saved = 2 * unsharded / GIB
    else:
        assert bf16.memory_gib["grads"] == pytest.approx(0.5 * fp32.memory_gib["grads"], abs=0.01)
        saved = fp32.memory_gib["grads"] - bf16.memory_gib["grads"]
    assert fp32.peak_mem_gib_per_device - bf16.peak_mem_gib_per_device == pytest.approx(saved, abs=0.02)
    reductions = ("dp_all_reduce", "dp_reduce_scatter", "fsdp_reduce_scatter")
    for key in (k for k in reductions if k in fp32.comm_gb_per_step):
        assert bf16.comm_gb_per_step[key] == pytest.approx(0.5 * fp32.comm_gb_per_step[key], rel=1e-3)


def _peak_bytes(fn) -> int:
    """The most bytes torch's CPU allocator held at once during `fn()` beyond what it held before:
    every allocation and free while torch.profiler records memory (blocks allocated earlier and
    freed meanwhile do not count, which errs on the high side)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def _checkpoint_peaks(args):
    """Per run on this rank: the peak bytes allocated during `Trainer.save()` after one step and
    during a load of that checkpoint into a fresh engine (`load_checkpoint` into
    `checkpoint_state()`, then `checkpoint_loaded`); the bytes of the whole state (12 a parameter
    element: fp32 weights, two moments), for comparison; the largest entry's bytes; what gloo's
    all-gather of one split bucket's bf16 weights stages; whether the load restored every tensor
    (both engines saved again and read back)."""
    import torch
    import torch.distributed as dist
    from support.steps import saved_state

    from moetrain.train.checkpoint_io import load_checkpoint
    from moetrain.train.engine import TrainEngine
    from moetrain.train.run_dir import resolve_checkpoint
    from moetrain.train.trainer import Trainer

    out = {}
    for name, overrides in args:
        cfg = resolve_config("tiny", overrides)
        trainer = Trainer(cfg, quiet=True)
        trainer.train_step()
        save = _peak_bytes(trainer.save)
        fresh = TrainEngine(cfg, trainer.par, trainer.device)
        state = fresh.checkpoint_state()  # the live tensors (a fresh torch AdamW makes its zero moments)
        path = resolve_checkpoint(cfg.train.run_dir)

        def load_it(path=path, state=state, engine=fresh):
            load_checkpoint(path, state)
            engine.checkpoint_loaded()

        load = _peak_bytes(load_it)
        want = saved_state(trainer.engine, Path(cfg.train.run_dir) / "want")  # read back whole
        got = saved_state(fresh, Path(cfg.train.run_dir) / "got")
        restored = want.keys() == got.keys() and all(torch.equal(want[s][k], got[s][k]) for s in want for k in want[s])
        experts = {n for n, p in trainer.engine.model.named_parameters() if p.ndim == 3}
        entry = max(
            p.numel() // (p.shape[0] if n in experts else 1) for n, p in trainer.engine.model.named_parameters()
        )
        split_buckets = [b for b in getattr(trainer.engine.optimizer, "buckets", []) if b.split]
        gloo = max((2 * b.params_N.numel() for b in split_buckets), default=0)
        out[name] = {
            "save": save,
            "load": load,
            "whole": sum(t.nbytes for entries in want.values() for t in entries.values()),
            "entry_bytes": 4 * entry,
            "gloo_bytes": gloo,
            "restored": restored,
        }
        dist.barrier()
    return out


PLANS = 2**20
"""DCP's planning exchange: the coordinator receives every rank's pickled plan (tens of KB each here)."""

# dp4 on four gloo ranks: the sharded optimizer (dp4, and dp4·ep2 with bf16 weights), FSDP, and
# the replicated optimizer with bf16 weights.
CHECKPOINT_RUNS = {
    "sharded": ["parallel.shard_optimizer=true", "optim.bf16_weights=false"],
    "sharded-ep2-bf16w": [
        "parallel.shard_optimizer=true",
        "parallel.ep=2",
        "train.precision=bf16",
        "optim.bf16_weights=true",
    ],
    "fsdp": ["parallel.stack=fsdp"],
    "replicated-bf16w": ["train.precision=bf16", "optim.bf16_weights=true"],
}


def test_checkpoint_save_and_load_allocate_one_entry_not_the_model(tmp_path):
    """Four gloo ranks save and load checkpoints of a `tiny` variant (2.6M parameters, 6 layers;
    its largest entry 64k elements) in four layouts. Each save and each load allocates at most
    what the planner predicts on a GPU (`save_temporaries`, `load_temporaries`) plus what is host
    memory there and the CPU's here: DCP's copies of an item and the one before it, gloo's staging
    of one bucket's all-gather (NCCL writes in place) and the ranks' plans. That is under an eighth
    of the whole state (nothing is gathered); and the load restores every tensor exactly."""
    from support.distributed import run_distributed

    from moetrain.plan import (
        Assumptions,
        ParamGroups,
        layout_of,
        load_temporaries,
        memory_per_rank,
        save_temporaries,
    )

    def overrides(name):
        return [
            "model.vocab_size=512",  # the largest entries are the blocks' matrices
            "model.n_layers=6",
            "train.device=cpu",
            "data.synthetic=true",
            f"train.run_dir={tmp_path / name}",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            "train.eval_every=0",
            "train.tensorboard=false",
            "train.plot=false",
            *CHECKPOINT_RUNS[name],
        ]

    results = run_distributed(_checkpoint_peaks, 4, [(name, overrides(name)) for name in CHECKPOINT_RUNS])
    for name in CHECKPOINT_RUNS:
        cfg = resolve_config("tiny", overrides(name))
        layout = layout_of(cfg, 4)
        (rank,) = memory_per_rank(cfg, layout, ParamGroups.of(cfg.model), Assumptions())
        saving, loading = save_temporaries(cfg, layout, rank), load_temporaries(cfg, layout, rank)
        for r, by_run in enumerate(results):
            got = by_run[name]
            host = 2 * got["entry_bytes"] + PLANS
            assert got["restored"], (name, r)
            assert got["save"] <= max(saving, 2 * got["entry_bytes"]) + PLANS, (name, r, got, saving)
            assert got["load"] <= loading + host + got["gloo_bytes"], (name, r, got, loading)
            assert max(got["save"], got["load"]) < got["whole"] / 8, (name, r, got)
        if "bf16_weights=true" in " ".join(CHECKPOINT_RUNS[name]):  # the join of the largest block happens
            largest = 4 * ParamGroups.of(cfg.model).largest_split_entry(rank.last)
            assert max(by_run[name]["save"] for by_run in results) >= largest, (name, results)


def test_overlap_hides_the_all_to_all_by_the_stated_model_and_charges_its_chunks():
    """parallel.overlap_chunks on sweep-8l at ep8: the all-to-all's charge is what the model of
    `_overlapped_exchange_time` leaves (exposed first transfers + overlap_slowdown of the rest),
    n = 1 costs the experts nothing more, chunks by experts are charged their measured device
    time (`chunk_bytes` per expert parameter and micro-batch, whatever n), and one exchange
    buffer joins the activations."""
    from moetrain.plan import Assumptions

    def p(preset, n):
        cfg = resolve_config(preset, ["parallel.ep=8", f"parallel.overlap_chunks={n}"])
        return plan(cfg, 8, "h200")

    for preset in ("sweep-8l-32", "sweep-8l-128"):
        base, one, four = p(preset, 0), p(preset, 1), p(preset, 4)
        full = base.time_s["expert_all_to_all"]
        # never less than the slowdown alone on all of it, never more than exposing all of it
        floor = Assumptions().overlap_slowdown * full
        assert floor < four.time_s["expert_all_to_all"] < one.time_s["expert_all_to_all"] < full
        assert one.time_s["overlap_chunk_grads"] == 0 < four.time_s["overlap_chunk_grads"]
        assert four.memory_gib["activations"] > base.memory_gib["activations"]
        assert "overlap×4" in four.layout.describe()
    e128 = [p("sweep-8l-128", n).time_s["overlap_chunk_grads"] for n in (2, 4)]
    assert e128[0] == pytest.approx(e128[1])


def test_the_planner_splits_a_ranks_tokens_where_chunks_cannot_split_its_experts():
    """sweep-8l-8 with 4 chunks configured: at ep8 a rank holds one expert, so the 4 chunks split
    its tokens; with deferred expert weight gradients (one product per expert and micro-batch)
    those layouts are searched with one chunk instead."""
    from moetrain.plan import suggest

    for defer, want in (("false", {4}), ("true", {1})):
        cfg = resolve_config("sweep-8l-8", ["parallel.overlap_chunks=4", f"train.defer_expert_weight_grad={defer}"])
        plans = suggest(cfg, 8, "h200", limit=50)
        ep8 = {q.layout.overlap_chunks for q in plans if q.layout.ep == 8 and q.layout.dispatcher == "nosync"}
        assert ep8 and ep8 <= want | {1} and want <= ep8, (defer, [q.layout.describe() for q in plans])


# Training-step throughput measured with `moetrain bench --device cuda` on one H200 (docs/measurements.md,
# "One-GPU tokens/s"): the planner's step time, with its per-parameter passes at their measured
# rates, lands within 10%.
MEASURED_TOKENS_PER_S = [
    ("bench-8e", [], 27748),
    ("bench-tiny64e-l6", [], 91385),
    ("bench-small32e", [], 111882),
    ("bench-sweep-8", [], 111920),  # random routing
    ("bench-sweep-64", [], 97698),
    ("bench-sweep-8", ["optim.grad_dtype=bf16"], 109103),
    ("bench-sweep-64", ["optim.grad_dtype=bf16"], 97507),
]


@pytest.mark.parametrize("preset, overrides, measured", MEASURED_TOKENS_PER_S)
def test_predicted_tokens_per_second_on_one_gpu_is_within_10_percent(preset, overrides, measured):
    predicted = plan(resolve_config(preset, overrides), 1, "h200").tokens_per_sec_per_device
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


@pytest.mark.parametrize("grads, measured_drop", [("fp32", 0.127), ("bf16", 0.106)])
def test_the_one_gpu_expert_sweep_loses_what_was_measured(grads, measured_drop):
    """bench-sweep-8 → 64 on one H200 (8 → 64 experts at constant active parameters): what grows is
    the per-parameter passes (optimizer, norm, gradient accumulation) and the grouped GEMMs' partial
    tiles. The planner's drop is within 2 points of the measured one, and under it: its
    `group_tile_rows` is the waste measured at sweep-8l's large experts, which these small ones
    (D 2048, F 1024: ~190 rows per group) exceed."""

    def rate(preset):
        return plan(resolve_config(preset, [f"optim.grad_dtype={grads}"]), 1, "h200").tokens_per_sec_per_device

    drop = 1 - rate("bench-sweep-64") / rate("bench-sweep-8")
    assert measured_drop - 0.02 <= drop <= measured_drop, drop


def test_the_dp_reduction_exposes_the_embeddings_buckets():
    """sweep-8l-8 at dp2·ep2 on two H200s (fp32 buckets, the padded nosync then): 32.1–33.2 ms
    of all-reduce per step, of which 10.7–13.6 ms were exposed (docs/measurements.md, "Where the ep2
    step's time goes"); the rest ran under the last backward. The planner exposes the embedding's
    reduction (plus what the backward cannot cover); counted in full without `dp_tail`."""
    from moetrain.plan import Assumptions

    over = ["parallel.ep=2", PADDED, "train.global_batch_size=16", "train.micro_batch_size=2", PLAIN_LOSS, FP32_WEIGHTS]
    cfg = resolve_config("sweep-8l-8", over)
    exposed = plan(cfg, 2, "h200").time_s["dp_reductions"]
    full = plan(cfg, 2, "h200", Assumptions(dp_tail=False)).time_s["dp_reductions"]
    assert 0.0107 * 0.8 <= exposed <= 0.0136 * 1.2, exposed
    assert full > 2 * exposed


def test_experts_alone_in_their_group_cost_no_bucket_copy():
    """At dp8·ep8 (edp = 1) the experts' gradients stay where backward puts them
    (`GradReducer.unreduced`): with one micro-batch the planner charges the gradient copy into
    the buckets for the dense parameters only; at dp8·ep4 (edp = 2) for the experts too."""
    one = ["train.micro_batch_size=64", "optim.grad_dtype=bf16", "optim.bf16_weights=true"]
    p8 = plan(resolve_config("sweep-8l-32", ["parallel.ep=8", *one]), 8, "h200")
    p4 = plan(resolve_config("sweep-8l-32", ["parallel.ep=4", *one]), 8, "h200")
    from moetrain.plan import GPUS, Assumptions, ParamGroups

    m = resolve_config("sweep-8l-32").model
    g = ParamGroups.of(m)
    dense = g.embedding + g.head + m.num_dense_layers * g.dense_block + m.num_moe_layers * g.moe_dense
    rate = GPUS["h200"].hbm_bytes_s * Assumptions().param_pass_eff
    assert p8.time_s["weight_casts"] == pytest.approx(4 * dense / rate)  # bf16 into the bf16 buckets
    experts4 = m.num_moe_layers * g.moe_experts / 4
    assert p4.time_s["weight_casts"] == pytest.approx(4 * (dense + experts4) / rate)


# The capacity sweep's switches S: sweep-8l-{8,32,64,128} on 8 H200s at ep8, the default dispatcher,
# no recompute, bf16 gradients and moments, 4 sequences per micro-batch, compiled blocks and the
# overlapped exchange in 4 chunks, or in 1 where a rank holds one expert (sweep-8l-8)
# (docs/benchmarks.md, "Rehearsed").
def target_run(preset: str) -> list[str]:
    chunks = 1 if preset == "sweep-8l-8" else 4
    return [
        "optim.grad_dtype=bf16",
        "optim.moments_dtype=bf16",
        "train.micro_batch_size=32",
        "train.compile=true",
        f"parallel.overlap_chunks={chunks}",
    ]


def test_the_capacity_sweep_on_eight_gpus_fits_and_loses_at_most_5_percent():
    """Every shape fits and 8 → 128 experts lose at most 5% of the tokens per GPU, by the
    planner whose compute part is within 10% of the rehearsed ranks (the test below). The other
    half of the target, ≥ 90% of one GPU's, does not hold by it (80% at 8 experts: the exchange's
    modelled exposed time and the rank's extra kernels; docs/measurements.md, "The projected
    8-GPU sweep")."""
    rates = {}
    for e in (8, 32, 64, 128):
        p = plan(resolve_config(f"sweep-8l-{e}", ["parallel.ep=8", *target_run(f"sweep-8l-{e}")]), 8, "h200")
        assert p.fits and p.layout.recompute == "none" and p.layout.dispatcher == "nosync", e
        rates[e] = p.tokens_per_sec_per_device
    assert 1 - rates[128] / rates[8] <= 0.05, rates


# An expert-parallel rank against one GPU at equal tokens per GPU (docs/benchmarks.md, "Rehearsed",
# one H100: 0e215a2, benchmarks/probes/ep_call7.sh; the sweep-8l-128 and one-GPU sweep-8l-8 rows
# c35ba73, ep_call10.sh): the planner's compute part
# (`Plan.compute_s`) within 10% of the rehearsed rank's compute (the step without its stand-ins'
# copies) and of one GPU's measured step. sweep-8l-E cut to 4 layers; S as `target_run`.
_S4 = ["model.n_layers=4", "optim.grad_dtype=bf16", "optim.moments_dtype=bf16", "train.compile=true"]
_ONE4 = ["train.global_batch_size=8"]
_EP8 = ["parallel.ep=8", "train.micro_batch_size=32"]
_NO_OVERLAP = "parallel.overlap_chunks=0"  # the bare rows were measured before auto chose 2 chunks on GPUs
REHEARSED_COMPUTE_S = [
    ("sweep-8l-8", 1, [*_S4, *_ONE4, "train.micro_batch_size=4"], 32768 / 54763),
    ("sweep-8l-8", 1, ["model.n_layers=4", *_ONE4, "train.micro_batch_size=1"], 32768 / 41320),
    ("sweep-8l-8", 8, [*_S4, *_EP8, "parallel.overlap_chunks=1"], 0.6099),
    ("sweep-8l-128", 8, [*_S4, *_EP8, "parallel.overlap_chunks=1"], 0.6241),
    ("sweep-8l-128", 8, [*_S4, *_EP8, "parallel.overlap_chunks=2"], 0.6392),
    ("sweep-8l-128", 8, [*_S4, *_EP8, "parallel.overlap_chunks=4"], 0.6437),
    ("sweep-8l-8", 8, ["model.n_layers=4", "parallel.ep=8", _NO_OVERLAP], 0.7695),
    ("sweep-8l-128", 8, ["model.n_layers=4", "parallel.ep=8", _NO_OVERLAP], 0.8630),
    ("sweep-8l-128", 8, ["model.n_layers=4", "parallel.ep=8", "parallel.overlap_chunks=2"], 0.9012),
    ("bench-tiny64e-l6", 1, [], 16384 / 86016),
    (
        "bench-tiny64e-l6",
        2,
        ["parallel.ep=2", "train.micro_batch_size=4", "train.global_batch_size=4", _NO_OVERLAP],
        0.1779,
    ),
    (
        "bench-tiny64e-l6",
        4,
        ["parallel.ep=4", "train.micro_batch_size=8", "train.global_batch_size=8", _NO_OVERLAP],
        0.1674,
    ),
]


@pytest.mark.parametrize("preset, gpus, flags, measured", REHEARSED_COMPUTE_S)
def test_rehearsed_expert_parallel_compute_is_within_10_percent(preset, gpus, flags, measured):
    p = plan(resolve_config(preset, flags), gpus, "h100")
    assert abs(p.compute_s - measured) <= 0.10 * measured, (p.compute_s, measured)


def _ref_layout(pp: int, ep: int, recompute: str, micro_batch: int, *extra: str) -> list[str]:
    """A scripts/launch/ref-*.sh layout (common.sh's flags)."""
    return [
        f"parallel.pp={pp}",
        f"parallel.ep={ep}",
        "parallel.dispatcher=alltoall",
        "parallel.shard_optimizer=true",
        f"compute.recompute={recompute}",
        f"train.micro_batch_size={micro_batch}",
        *extra,
    ]


BF16W = "optim.bf16_weights=true"
# The busiest rank of each reference layout rehearsed on one H200 (docs/benchmarks.md,
# "Rehearsed"): preset, GPUs, flags, the rank, then compute s and the training, save and load
# peaks in GiB (None: not recorded). The launch layouts as they are (bf16 weights), and as they were
# (fp32 weights: each micro-batch in flight keeps its own bf16 weight copies).
REHEARSED_REFS = [
    ("ref-tiny-64e", 16, _ref_layout(2, 8, "none", 16, BF16W), 0, 3.643, 64.9, 16.2, 16.2),
    ("ref-small-64e", 128, _ref_layout(8, 8, "none", 16, BF16W), 0, 2.723, 70.9, 12.0, 12.0),
    ("ref-medium-128e", 128, _ref_layout(8, 8, "none", 16, BF16W), 16, 4.858, 118.9, 35.5, 35.7),
    ("ref-large-128e", 512, _ref_layout(16, 8, "none", 32, BF16W, "model.n_layers=24"), 32, 5.923, 126.5, 31.7, 31.8),
    ("ref-ultra-128e", 512, _ref_layout(8, 8, "full", 64, BF16W, "model.n_layers=24"), 448, 15.263, 78.8, 67.6, 68.0),
    ("ref-ultra-256e", 512, _ref_layout(16, 32, "full", 32, BF16W), 32, 35.169, 123.0, 103.7, 104.1),
    ("ref-tiny-64e", 16, _ref_layout(2, 8, "none", 16), 0, 3.57, 71.5, 19.3, None),
    ("ref-small-64e", 128, _ref_layout(8, 8, "none", 16), 0, 2.68, 83.2, 13.7, None),
    ("ref-large-128e", 512, _ref_layout(16, 8, "none", 32, "model.n_layers=16"), 64, 3.047, 95.0, 25.9, 25.9),
    ("ref-ultra-128e", 512, _ref_layout(8, 8, "full", 64, "model.n_layers=8"), 448, 6.717, 50.4, 35.6, 35.6),
    ("ref-ultra-256e", 512, _ref_layout(16, 32, "selective", 32, "model.n_layers=16"), 64, 7.688, 100.9, 49.0, 49.0),
    # compiled blocks, the sync-free dispatcher, fp32 weights
    (
        "ref-small-64e",
        128,
        _ref_layout(8, 8, "none", 16, "parallel.dispatcher=nosync", "train.compile=true"),
        0,
        2.028,
        69.1,
        13.7,
        13.7,
    ),
]


@pytest.mark.parametrize("preset, gpus, flags, rank, compute, training, saving, loading", REHEARSED_REFS)
def test_rehearsed_reference_layouts_are_within_10_percent(
    preset, gpus, flags, rank, compute, training, saving, loading
):
    """The planner's compute, and the rehearsed rank's pipeline rank's training, save and load
    peaks, within 10% of the rehearsal; the rank rehearsed is the one the planner names busiest."""
    p = plan(resolve_config(preset, flags), gpus, "h200")
    assert p.busiest_rank == rank
    stage = rank // p.layout.dp
    for predicted, measured in (
        (p.compute_s, compute),
        (p.peak_gib_per_pipeline_rank[stage], training),
        (p.save_peak_gib_per_pipeline_rank[stage], saving),
        (p.load_peak_gib_per_pipeline_rank[stage], loading),
    ):
        if measured is not None:
            assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured)


def test_a_pipeline_stage_keeps_one_bf16_weight_copy_per_micro_batch_in_flight():
    """Without optim.bf16_weights each micro-batch's forward casts the weights and its saved
    tensors keep the copy: compiled nosync blocks too (ref-small-64e's stage 0, 8 micro-batches in
    flight, rehearsed: 69.1 GiB)."""
    flags = _ref_layout(8, 8, "none", 16, "parallel.dispatcher=nosync", "train.compile=true")
    assert abs(plan(resolve_config("ref-small-64e", flags), 128, "h200").peak_gib_per_pipeline_rank[0] - 69.1) <= 6.91

    def stage0(*extra):
        cfg = resolve_config("ref-small-64e", [*flags, *extra])
        return memory_per_rank(cfg, layout_of(cfg, 128), ParamGroups.of(cfg.model), Assumptions())[0]

    fp32_weights, bf16_weights = stage0(), stage0(BF16W)
    copies = fp32_weights.activations - bf16_weights.activations
    blocks = fp32_weights.local - fp32_weights.embedding_local  # the embedding is not cast
    assert copies == pytest.approx(8 * 2 * blocks)


LONG = "long-small32e-64k"


def test_the_long_context_preset_is_planned_at_full_size_under_cp():
    """long-small32e-64k on 8 H200s: dp2·cp4 fits; at 131,072 tokens it fits only with cp (a
    whole sequence per GPU does not)."""
    p = plan(resolve_config(LONG), 8, "h200")
    assert (p.layout.dp, p.layout.cp, p.layout.tokens(65_536)) == (2, 4, 16_384)
    assert p.fits and "dp2·cp4" in p.layout.describe()
    assert p.time_s["context_exchange"] > 0
    assert plan(resolve_config(LONG, ["data.seq_len=131072"]), 8, "h200").fits
    whole = ["data.seq_len=131072", "parallel.cp=1", "train.micro_batch_size=8"]
    assert not plan(resolve_config(LONG, whole), 8, "h200").fits


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_context_parallelism_divides_the_activations_and_keeps_the_gathered_keys(cp):
    """Per rank, cp splits each sequence's tokens; each attention layer keeps its two chunks'
    key prefixes ((cp + 1) × its own keys and values, bf16) instead of its own."""
    whole = resolve_config(LONG, ["parallel.cp=1", "train.micro_batch_size=8"])
    split = resolve_config(LONG, [f"parallel.cp={cp}", f"train.micro_batch_size={8 // cp}"])
    m = whole.model
    mem = {}
    for name, cfg in (("whole", whole), ("split", split)):
        L = layout_of(cfg, 8)
        mem[name] = (L, memory_per_rank(cfg, L, ParamGroups.of(m), Assumptions())[0])
    (L1, r1), (Lc, rc) = mem["whole"], mem["split"]
    t = Lc.tokens(65_536)
    assert t * cp == L1.tokens(65_536) == 65_536
    gathered = m.n_layers * t * 2 * 2 * m.n_kv_heads * m.resolved_head_dim * cp
    assert rc.blocks_none == pytest.approx(r1.blocks_none / cp + gathered, rel=1e-12)


def test_the_context_exchange_is_one_gather_and_one_reduce_scatter_per_layer():
    """(cp − 1) shards of this rank's bf16 keys and values sent per collective, per attention
    layer and micro-batch; a fully recomputed layer gathers again; time at NVLink's rate."""
    for recompute, passes in (("none", 2), ("full", 3)):
        cfg = resolve_config(LONG, [f"train.recompute={recompute}"])
        p = plan(cfg, 8, "h200")
        m, L = cfg.model, p.layout
        shard = L.tokens(cfg.data.seq_len) * 2 * m.n_kv_heads * m.resolved_head_dim * 2
        sent = L.micro_batches * m.n_layers * passes * shard * (L.cp - 1)
        assert p.comm_gb_per_step["context_all_gather"] == pytest.approx(sent / 1e9, abs=1e-3)
        assert p.time_s["context_exchange"] == pytest.approx(sent / (p.gpu.nvlink_bytes_s * Assumptions().link_eff))


def test_the_planner_suggests_cp_for_long_sequences_only():
    from moetrain.plan import suggest

    long = suggest(resolve_config(LONG, ["data.seq_len=131072"]), 8, "h200", limit=50)
    assert long[0].layout.cp > 1  # a whole 131,072-token sequence per GPU fits only with recompute
    assert {s.layout.cp for s in long} >= {2, 4, 8}
    assert all(s.layout.recompute != "none" for s in long if s.layout.cp == 1 and s.layout.pp == 1)
    short = suggest(resolve_config("bench-small32e", ["train.global_batch_size=16"]), 8, "h200", limit=50)
    assert short and all(s.layout.cp == 1 for s in short)


# One cp rank of long-small32e-64k rehearsed on one H200: (overrides, compute s, peak GiB).
# docs/benchmarks.md, "Rehearsed".
REHEARSED_CP = [
    ([], 2.003, 48.8),
    (["data.seq_len=131072"], 6.902, 68.4),
]


@pytest.mark.parametrize("overrides, compute_s, peak_gib", REHEARSED_CP)
def test_rehearsed_cp_ranks_are_within_10_percent(overrides, compute_s, peak_gib):
    p = plan(resolve_config(LONG, overrides), 8, "h200")
    assert p.compute_s == pytest.approx(compute_s, rel=0.10)
    assert p.peak_mem_gib_per_device == pytest.approx(peak_gib, rel=0.10)


# Muon's optimizer step and the training step (the rehearsed rank's compute), measured:
# (preset, gpus, overrides, gpu, optimizer s, step or compute s). The rehearsed row orthogonalizes
# its share of the replicated matrices, Newton–Schulz one triangle at a time from 1,024 rows (one
# H100, tree of a9b1d17). docs/benchmarks.md, tables muon-step and muon-rehearsed.
EP8 = ["parallel.ep=8", "train.micro_batch_size=8", "train.global_batch_size=8"]
MEASURED_MUON = [
    ("bench-tiny64e-l6", 1, [], "h100", 0.4794, 0.6466),
    ("bench-8e", 1, [], "h100", 0.6698, 0.9592),
    ("bench-8e", 8, EP8, "h100", 0.1157, 0.4193),
]


@pytest.mark.parametrize("preset, gpus, overrides, gpu, optimizer_s, step_s", MEASURED_MUON)
def test_muon_steps_are_within_10_percent_of_the_measured(preset, gpus, overrides, gpu, optimizer_s, step_s):
    p = plan(resolve_config(preset, ["optim.name=muon", *overrides]), gpus, gpu)
    assert p.time_s["optimizer"] == pytest.approx(optimizer_s, rel=0.10)
    assert p.compute_s == pytest.approx(step_s, rel=0.10)


def test_muon_keeps_one_momentum_per_matrix_element_and_pays_its_iterations():
    """optim.name=muon: the blocks' matrices hold 4 B of momentum instead of AdamW's 8; the
    optimizer's time grows by the Newton–Schulz FLOPs of each further iteration at their rate."""
    from moetrain.plan import GPUS

    adamw = plan(resolve_config("bench-8e"), 1, "h200")
    muon = {
        k: plan(resolve_config("bench-8e", ["optim.name=muon", f"optim.muon_ns_steps={k}"]), 1, "h200") for k in (5, 6)
    }
    groups = ParamGroups.of(resolve_config("bench-8e").model)
    m = resolve_config("bench-8e").model
    matrices = (
        groups.muon_dense_block * m.num_dense_layers + (groups.muon_moe_dense + groups.moe_experts) * m.num_moe_layers
    )
    assert adamw.memory_gib["optimizer"] - muon[5].memory_gib["optimizer"] == pytest.approx(
        4 * matrices / GIB, abs=0.02
    )
    flops = groups.ns_dense_block * m.num_dense_layers + (groups.ns_moe_dense + groups.ns_experts) * m.num_moe_layers
    rate = GPUS["h200"].bf16_flops * Assumptions().ns_eff
    assert muon[6].time_s["optimizer"] - muon[5].time_s["optimizer"] == pytest.approx(flops / rate, rel=1e-9)


def test_multi_token_prediction_adds_its_modules_to_the_last_stage_and_its_embeddings_to_the_sends():
    base = ["parallel.pp=2", "train.global_batch_size=16", "train.micro_batch_size=2"]
    plain, mtp = (
        plan(resolve_config("bench-small32e", base + extra), 2, "h200") for extra in ([], ["model.mtp_depth=2"])
    )
    groups = ParamGroups.of(resolve_config("bench-small32e", ["model.mtp_depth=2"]).model)
    assert mtp.params_per_pipeline_rank[0] == plain.params_per_pipeline_rank[0]
    assert mtp.params_per_pipeline_rank[1] == plain.params_per_pipeline_rank[1] + groups.mtp
    assert mtp.comm_gb_per_step["pipeline_send_recv"] == pytest.approx(
        3 * plain.comm_gb_per_step["pipeline_send_recv"], rel=1e-3
    )
    assert mtp.time_s["gemm_and_attention"] > plain.time_s["gemm_and_attention"]


def test_suggestions_rank_the_layouts_with_headroom_first_and_mark_the_tight_ones():
    """A layout whose largest peak (training, saving, loading) comes within the memory model's
    error of the GPU is tight; the suggestions list every layout with headroom before any tight
    one, fastest first within each (ref-medium-128e on 64 H200s has both)."""
    from moetrain.plan import PEAK_ERROR, suggest

    found = suggest(resolve_config("ref-medium-128e"), 64, "h200", limit=200)
    tight = [s.tight for s in found]
    assert any(tight) and not all(tight)
    assert tight == sorted(tight), "a tight layout before one with headroom"
    for group in (False, True):
        speeds = [s.tokens_per_sec_per_device for s in found if s.tight == group]
        assert speeds == sorted(speeds, reverse=True)
    for s in found:
        peak = max(s.peak_mem_gib_per_device, s.save_peak_gib_per_device, s.load_peak_gib_per_device)
        assert s.tight == (peak > (1 - PEAK_ERROR) * 139.0)


@pytest.mark.parametrize("preset, gpus", [("ref-medium-128e", 64), ("long-small32e-64k", 8), ("ref-small-64e", 16)])
def test_each_suggestions_flags_reproduce_its_layout(preset, gpus):
    """The flags `moetrain plan` prints to paste for a suggestion give exactly that layout
    (context and expert parallelism, pipeline, recompute, the sharded optimizer, the dispatcher
    and the overlapped exchange's chunks)."""
    from moetrain.plan import suggest

    cfg = resolve_config(preset)
    found = suggest(cfg, gpus, "h200", limit=20)
    assert found
    for s in found:
        pasted = [f.removeprefix("--") for f in s.layout.to_flags(cfg)]
        assert plan(resolve_config(preset, pasted), gpus, "h200").layout == s.layout, pasted


def test_moetrain_plan_leads_with_the_recommended_layout_and_its_flags():
    """`moetrain plan ref-medium-128e --gpus 64 --gpu h200`: the bare dp64 layout does not fit,
    so the first lines recommend the fastest layout with headroom, its flags to paste and its
    rehearsal; each suggestion carries its flags and rehearsal command in the JSON line too.
    Asked for a tight layout, the report says TIGHT and still recommends one with headroom."""
    from moetrain.plan import suggest

    def run(*flags):
        argv = [sys.executable, "-m", "moetrain", "plan", "ref-medium-128e", "--gpus", "64", "--gpu", "h200", *flags]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    lines = run()
    assert lines[0].startswith("recommended: ") and "does NOT fit" in lines[0]
    assert lines[1].startswith("  flags: --") and lines[2].startswith("  rehearse one rank: moetrain bench")
    out = json.loads(lines[-1])
    assert out["fits"] is False and out["tight"] is False and out["suggested"]
    first = out["suggested"][0]
    assert first["tight"] is False and " ".join(first["flags"]) == lines[1].removeprefix("  flags: ")
    assert first["rehearse_command"] == lines[2].removeprefix("  rehearse one rank: ")
    tight = next(s for s in suggest(resolve_config("ref-medium-128e"), 64, "h200", limit=200) if s.tight)
    lines = run(*tight.layout.to_flags(resolve_config("ref-medium-128e")))
    assert lines[0].startswith("recommended: ") and "TIGHT" in lines[0]
    assert any(line.startswith("  -> TIGHT") for line in lines)
    assert json.loads(lines[-1])["tight"] is True


def test_deferred_expert_weight_gradients_charge_the_kept_operands():
    """train.defer_expert_weight_grad keeps, of every micro-batch but the last, each MoE layer's
    expert rows' inputs and output gradients of both products: bench-sweep-64 (8 micro-batches of
    8192 tokens, top-4, 7 MoE layers, D 2048, F 1024, bf16) 7 × 32,768 rows × 7 layers × 7168 × 2
    bytes = 21.4 GiB more at the start of the last backward; one micro-batch keeps nothing."""

    def rank(preset, *extra):
        cfg = resolve_config(preset, list(extra))
        return memory_per_rank(cfg, layout_of(cfg, 1), ParamGroups.of(cfg.model), Assumptions())[0]

    defer = "train.defer_expert_weight_grad=true"
    held = rank("bench-sweep-64", defer).activations - rank("bench-sweep-64").activations
    assert held == 7 * 8192 * 4 * 7 * (2 * 2048 + 3 * 1024) * 2
    assert rank("bench-sweep-64", defer).peak - rank("bench-sweep-64").peak == pytest.approx(held)
    assert rank("bench-8e", defer).activations == rank("bench-8e").activations


def test_deferred_expert_weight_gradients_trade_the_accumulation_for_one_row_copy():
    """The modelled step: deferred, the experts' gradients are no longer read and written per
    micro-batch, and every micro-batch's expert operands are copied once into expert order. Many
    small experts gain (bench-sweep-64: 2.82B expert parameters against 3.3 GB of operands per
    micro-batch), few large ones lose (bench-sweep-8: 0.35B), one micro-batch changes nothing."""

    def rate(preset, *extra):
        return plan(resolve_config(preset, list(extra)), 1, "h200").tokens_per_sec_per_device

    defer = "train.defer_expert_weight_grad=true"
    assert rate("bench-sweep-64", defer) > 1.03 * rate("bench-sweep-64")
    assert rate("bench-sweep-8", defer) < rate("bench-sweep-8")
    assert rate("bench-8e", defer) == rate("bench-8e")
