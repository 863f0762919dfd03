"""What a run prints: the start-up header and the step line (src/moetrain/train/console.py)."""

import pytest
import torch

from moetrain.presets import resolve_config
from moetrain.train.console import ConsoleSink, StepTimer, describe_layout, describe_precision, format_duration
from moetrain.train.trainer import Trainer

RECORD = {"loss": 5.4321, "lr": 3e-4, "tokens_per_sec": 12345.6, "mfu": None, "peak_mem_gib": 0.456}


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0s"), (45.4, "45s"), (59.6, "1m00s"), (725, "12m05s"), (3599.6, "1h00m"), (3720, "1h02m"), (97200, "27h00m")],
)
def test_durations_read_like_1h02m(seconds, text):
    assert format_duration(seconds) == text


def test_step_time_leaves_the_first_window_out_once_another_is_measured():
    timer = StepTimer(windows=2)
    assert timer.seconds_per_step() is None
    timer.add(10.0, 1)  # the first step: compilation, warm-up
    assert timer.seconds_per_step() == 10.0
    timer.add(9.0, 9)
    assert timer.seconds_per_step() == 1.0
    timer.add(6.0, 3)
    timer.add(4.0, 2)  # only the last two windows
    assert timer.seconds_per_step() == 2.0


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]


def test_cpu_line_has_step_loss_rate_ms_rss_and_eta_but_no_mfu(capsys):
    progress = ConsoleSink(start=0, total=300, quiet=False, device_type="cpu")
    progress.update(1, RECORD, (5.0, 1))
    progress.update(5, None)  # not a logged step: nothing printed
    progress.update(10, {**RECORD, "val_loss": 5.6789}, (9.0, 9))
    progress.update(300, RECORD, (290.0, 290))
    first, tenth, last = _lines(capsys)
    assert first == "step   1/300  loss 5.4321  lr 3.00e-04  12,346 tok/s  5000 ms/step  rss 0.46 GiB  ETA 24m55s"
    # 1 s/step (the first step left out) × 290 steps left
    assert tenth.endswith("1000 ms/step  rss 0.46 GiB  ETA 4m50s  val_loss 5.6789")
    assert "MFU" not in first + tenth + last
    assert last.startswith("step 300/300") and "ETA" not in last  # nothing left


def test_gpu_line_has_mfu_and_allocator_peak(capsys):
    progress = ConsoleSink(start=100, total=4010, quiet=False, device_type="cuda")
    progress.update(110, {**RECORD, "mfu": 0.4123, "peak_mem_gib": 61.27}, (0.5, 10))
    (line,) = _lines(capsys)
    assert "50.0 ms/step  MFU 41.2%  mem 61.27 GiB  ETA 3m15s" in line


def test_a_step_that_dropped_assignments_says_so(capsys):
    progress = ConsoleSink(start=0, total=10, quiet=False)
    progress.update(1, {**RECORD, "dropped_token_frac": 0.0}, (1.0, 1))
    progress.update(2, {**RECORD, "dropped_token_frac": 0.0123}, (1.0, 1))
    first, second = _lines(capsys)
    assert "dropped" not in first and second.endswith("dropped 1.23% of expert assignments")


def test_quiet_prints_nothing(capsys):
    ConsoleSink(start=0, total=10, quiet=True).update(1, RECORD, (1.0, 1))
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "overrides, world, degrees, text",
    [
        ([], 1, (1, 1, 1), "1 rank: dp1 ddp"),
        (
            ["parallel.pp=2", "parallel.ep=2", "parallel.shard_optimizer=true", "train.micro_batch_size=12"],
            4,
            (2, 2, 2),
            "4 ranks: dp2·ep2·pp2 ddp nosync(cf 1.25 + spill 0.125) sharded-optimizer",
        ),
        (["parallel.stack=fsdp"], 8, (8, 1, 1), "8 ranks: dp8 fsdp"),
        (["parallel.ep=2", "parallel.capacity_factor=null"], 2, (2, 2, 1), "2 ranks: dp2·ep2 ddp nosync(padded)"),
        (
            ["parallel.ep=2", "parallel.overlap_chunks=2", "parallel.spill_factor=0"],
            2,
            (2, 2, 1),
            "2 ranks: dp2·ep2 ddp nosync(cf 1.25) overlap×2",
        ),
        (["parallel.ep=2", "parallel.dispatcher=alltoall"], 2, (2, 2, 1), "2 ranks: dp2·ep2 ddp alltoall"),
        (
            ["parallel.cp=2", "parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "train.micro_batch_size=4"],
            8,
            (2, 1, 2),
            "8 ranks: dp2·cp2·pp2×v2 ddp",
        ),
    ],
)
def test_layout_names_every_degree(overrides, world, degrees, text):
    """The console's layout line is `ParallelDims.describe`, the words the planner writes; the
    dims carry every setting it names."""
    dims = resolve_config("tiny", overrides).parallel.build(world)
    assert (dims.dp, dims.ep, dims.pp) == degrees
    assert describe_layout(dims) == text


def test_precision_names_autocast_bf16_weights_and_fp8():

    cpu = torch.device("cpu")
    assert describe_precision(resolve_config("tiny"), cpu) == "fp32"
    bf16 = resolve_config("tiny", ["precision.dtype=bf16", "precision.fp8=rowwise", "precision.fp8_select=all"])
    assert describe_precision(bf16, cpu) == (
        "bf16 autocast (fp32 weights), fp8 rowwise on every product in the blocks (precision.fp8_select=all); "
        "and the LM head (precision.fp8_lm_head); fast accumulation in backward too"
    )
    plain = resolve_config(
        "tiny",
        ["precision.dtype=bf16", "precision.fp8=rowwise", "precision.fp8_select=all", "precision.fp8_lm_head=false"]
        + ["precision.fp8_fast_accum_backward=false"],
    )
    assert describe_precision(plain, cpu).endswith("every product in the blocks (precision.fp8_select=all)")
    auto = resolve_config("tiny", ["precision.dtype=bf16", "precision.fp8=rowwise"])
    assert describe_precision(auto, cpu).endswith("fp8 rowwise on no product: all are too small to repay it "
                                                  "(precision.fp8_select=auto)")  # fmt: skip
    fp32 = resolve_config("tiny", ["precision.fp8=rowwise"])  # the step stays fp32's, not bf16's
    assert describe_precision(fp32, cpu) == (
        "fp32, fp8 rowwise on no product: all are too small to repay it (precision.fp8_select=auto)"
    )
    head = resolve_config("tiny", ["precision.dtype=bf16", "precision.fp8=rowwise", "precision.fp8_lm_head=true"])
    assert describe_precision(head, cpu).endswith(
        "(precision.fp8_select=auto); and the LM head (precision.fp8_lm_head); fast accumulation in backward too"
    )
    mx = resolve_config("tiny", ["precision.dtype=bf16", "precision.fp8=mxfp8"])
    assert describe_precision(mx, cpu) == "bf16 autocast (fp32 weights), fp8 mxfp8 matrix products"
    weights = resolve_config("tiny", ["precision.dtype=bf16", "optim.bf16_weights=true"])
    assert describe_precision(weights, cpu) == "bf16 weights (fp32 masters in the optimizer)"
    defer = ["compute.defer_expert_weight_grad=true", "train.global_batch_size=8"]
    assert describe_precision(resolve_config("tiny", [*defer, "train.micro_batch_size=4"]), cpu) == (
        "fp32; expert weight gradients once per step (compute.defer_expert_weight_grad)"
    )
    assert describe_precision(resolve_config("tiny", [*defer, "train.micro_batch_size=8"]), cpu) == "fp32"
    dense = [*defer, "train.micro_batch_size=4", "model.num_dense_layers=4"]  # no experts: nothing deferred
    assert describe_precision(resolve_config("tiny", dense), cpu) == "fp32"
    graphs = resolve_config("tiny", ["compute.cuda_graphs=step"])
    assert describe_precision(graphs, cpu) == (
        "fp32; the training step replayed from a CUDA graph after 3 eager steps (compute.cuda_graphs)"
    )
    auto = resolve_config("tiny", [])  # compute.cuda_graphs=auto, the default
    assert describe_precision(auto, cpu) == "fp32"  # no graph to choose on the CPU
    recompute = resolve_config("tiny", ["compute.recompute=full"])
    assert describe_precision(recompute, torch.device("cuda")).endswith(
        "; no CUDA graph (compute.cuda_graphs=auto: the step graph cannot capture a step with "
        "compute.recompute=full: torch's checkpoint reads the CUDA generator's state in every recomputed block, "
        "which a graph capture forbids)"
    )
    assert describe_precision(auto, torch.device("cuda")).endswith(
        "; the training step replayed from a CUDA graph after 3 eager steps (compute.cuda_graphs=auto: one GPU "
        "and a layout the step graph captures; kept if its first replays take the device at least 3% less time "
        "than the eager steps)"
    )


def test_a_run_prints_the_header_once_then_a_line_per_logged_step(tiny_cfg, tmp_path, capsys):
    Trainer(tiny_cfg(tmp_path / "run", "train.steps=3", "train.eval_every=0"), quiet=False).fit()
    err = capsys.readouterr().err
    assert err.count("run dir   : ") == 1
    assert f"run dir   : {tmp_path / 'run'}\n" in err
    assert "layout    : 1 rank: dp1 ddp\n" in err
    assert "device    : cpu; precision fp32\n" in err
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    for line in lines:
        for field in ("loss ", " tok/s", " ms/step", "rss "):
            assert field in line, (field, line)
        assert "MFU" not in line  # CPU
    assert "ETA " in lines[0] and "ETA " not in lines[-1]
