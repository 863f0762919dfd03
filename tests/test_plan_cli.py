"""`moetrain plan`'s answers for a user who sizes a run (issue 57, item 3): tokens/s and the time to
a token budget for each layout (--tokens), a table across GPU counts (--gpus 64,128,256), the line
that launches a layout (torchrun on one node, srun across several), GPUs the planner does not know
(--gpu NAME:memory_gib=…), and GPU counts that are not powers of two where nothing fits. Through
the command line, in-process; the argument mistakes also in one subprocess, to see torch stay out."""

import json
import subprocess
import sys

import pytest

from moetrain.cli import main
from moetrain.plan import GPUS, fewest_gpus, plan, suggest, with_layout
from moetrain.plan.hardware import KNOWN_GPUS
from moetrain.presets import resolve_config


def run_plan(capsys, *argv: str) -> tuple[list[str], dict, str]:
    """(stdout lines, the JSON line, stderr) of `moetrain plan ARGV`, which must succeed."""
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    return lines, json.loads(lines[-1]), out.err


def refused(capsys, *argv: str) -> str:
    """stderr of `moetrain plan ARGV`, which must exit 2 without a traceback."""
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


@pytest.fixture
def custom_gpus():
    """Forget the GPUs a test added to the planner's (`--gpu NAME:…` adds them for the process)."""
    yield
    for key in [k for k in GPUS if k not in KNOWN_GPUS]:
        del GPUS[key]


@pytest.mark.parametrize(
    "text, tokens",
    [("250B", 250 * 10**9), ("1T", 10**12), ("1.5t", 15 * 10**11), ("500M", 5 * 10**8), ("2e12", 2 * 10**12),
     ("123456789", 123456789)],
)  # fmt: skip
def test_the_token_budget_is_read_in_every_form(capsys, text, tokens):
    _, record, _ = run_plan(capsys, "tiny", "--gpus", "1", "--no-suggest", "--tokens", text)
    assert record["tokens_budget"] == tokens
    assert record["time_to_budget_s"] == pytest.approx(tokens / record["tokens_per_sec"], rel=1e-3)


@pytest.mark.parametrize("text", ["x", "", "B", "-5", "0", "0.5", "inf", "nan", "10Q", "1e3e"])
def test_a_bad_token_budget_is_refused_with_the_forms_it_takes(capsys, text):
    err = refused(capsys, "tiny", "--gpus", "1", "--tokens", text)
    assert f"--tokens={text!r}" in err and "250B, 1.5T, 500M" in err and "2e12" in err, err


def test_each_layout_is_timed_on_the_budget_over_all_its_gpus(capsys):
    """ref-small-64e on 16 H200s with --tokens 250B: the layout as given does not fit, so the first
    line recommends one, with its tokens/s per GPU and on all 16, and the days 250B tokens take;
    every suggestion says the same, and the JSON line carries each as tokens_per_sec and
    time_to_budget_s = budget / (tokens_per_sec_per_device × GPUs)."""
    lines, record, _ = run_plan(capsys, "ref-small-64e", "--gpus", "16", "--tokens", "250B")
    assert record["tokens_budget"] == 250 * 10**9
    for entry in [record] + record["suggested"]:
        assert entry["tokens_per_sec"] == pytest.approx(16 * entry["tokens_per_sec_per_device"], rel=1e-4)
        expected = 250e9 / (entry["tokens_per_sec_per_device"] * 16)
        assert entry["time_to_budget_s"] == pytest.approx(expected, rel=1e-4)
    first = record["suggested"][0]
    per_gpu = f"{first['tokens_per_sec_per_device']:,.0f} tokens/s per GPU, {first['tokens_per_sec']:,.0f} on 16 GPUs"
    days = f"250B tokens in {first['time_to_budget_s'] / 86400:.1f} days"
    assert lines[0].startswith("recommended: ") and f"{per_gpu}: {days}" in lines[0], lines[0]
    assert f"      {per_gpu}: {days}" in lines
    given = f"{record['time_to_budget_s'] / 86400:,.1f} days at {record['tokens_per_sec']:,.0f} tokens/s on 16 GPUs"
    assert f"  time to train 250B tokens: {given}" in lines


def test_the_default_budget_is_the_runs_length_as_configured(capsys):
    """Without --tokens the budget is train.steps × the global batch × seq_len of the config as
    given, named by its steps; planning on more GPUs than the batch divides over (tiny's 24
    sequences on 16 GPUs: planned at 32) leaves it the run's."""
    cfg = resolve_config("tiny", ["train.steps=5000"])
    tokens = 5000 * 24 * cfg.data.seq_len
    lines, record, err = run_plan(capsys, "tiny", "--gpus", "16", "--no-suggest", "--train.steps=5000")
    assert "--train.global_batch_size=32" in err and record["tokens_budget"] == tokens
    named = f"  time to train the run's 5,000 steps ({tokens / 1e6:.3g}M tokens): "
    assert any(line.startswith(named) for line in lines), lines


def test_micro_batch_is_sequences_per_data_parallel_rank_under_context_parallelism(capsys):
    """--micro-batch B sets train.micro_batch_size = B × dp, dp = GPUs / (pp · cp): a cp2 group
    shares its sequences, so each GPU plans B of them, not B · cp."""
    _, record, _ = run_plan(capsys, "tiny", "--gpus", "8", "--parallel.cp=2", "--micro-batch", "1", "--no-suggest")
    assert (record["dp"], record["cp"], record["sequences_per_micro_batch_per_gpu"]) == (4, 2, 1)
    assert record["launch"].endswith("--train.micro_batch_size=4")


def test_a_micro_batch_that_does_not_fit_the_batch_names_the_flag(capsys):
    """--micro-batch 5 on 4 GPUs is train.micro_batch_size=20, which 24 sequences do not hold a
    whole number of: the refusal names --micro-batch, not only a key the user never typed."""
    err = refused(capsys, "tiny", "--gpus", "4", "--micro-batch", "5")
    assert "--micro-batch=5 on 4 data-parallel ranks sets train.micro_batch_size=20" in err, err
    assert "train.global_batch_size=24 is not a multiple" in err


def test_the_table_across_gpu_counts_has_a_row_and_a_launch_line_per_count(capsys):
    """--gpus 8,16: one row per count with suggest's first layout there (16 GPUs: on the batch
    that divides, said on stderr), its peak, step time, tokens/s, time to the budget and MFU;
    each count's launch line (8 GPUs: one node, torchrun; 16: srun, a task per GPU)."""
    lines, record, err = run_plan(capsys, "tiny", "--gpus", "8,16", "--tokens", "1B")
    assert record["preset"] == "tiny" and record["gpu"] == "h200" and record["tokens_budget"] == 10**9
    assert [c["gpus"] for c in record["counts"]] == [8, 16]
    assert "ranks of 16 GPUs: planned with --train.micro_batch_size=32 --train.global_batch_size=32" in err
    eight, sixteen = record["counts"]
    best = suggest(resolve_config("tiny"), 8, "h200", limit=1)[0]
    assert eight["layout"] == best.layout.describe() and eight["fits"] is True
    assert eight["step_time_s"] == round(best.step_time_s, 4) and eight["mfu"] == round(best.mfu, 4)
    assert eight["launch"] == f"torchrun --nproc-per-node=8 -m moetrain train tiny {' '.join(eight['flags'])}"
    assert sixteen["launch"].startswith("srun --ntasks=16 --ntasks-per-node=8 --gpus-per-task=1 python -m moetrain ")
    assert sixteen["launch"].endswith(f"train tiny {' '.join(sixteen['flags'])}")
    assert "--train.global_batch_size=32" in sixteen["flags"]
    for c in record["counts"]:
        assert c["time_to_budget_s"] == pytest.approx(1e9 / (c["tokens_per_sec_per_device"] * c["gpus"]), rel=1e-4)
        row = next(line for line in lines if line.split()[:1] == [str(c["gpus"])])
        assert f"{c['tokens_per_sec']:,.0f}" in row and row.endswith(c["layout"]) and f"{100 * c['mfu']:.1f}%" in row
        assert f"  {c['gpus']:>6}  {c['launch']}" in lines
    assert "layout abbreviations:" in lines


def test_a_count_where_nothing_fits_is_a_row_that_says_so(capsys):
    lines, record, _ = run_plan(capsys, "ref-small-64e", "--gpus", "2,8")
    assert "       2  nothing fits" in lines
    nothing, eight = record["counts"]
    assert nothing["fits"] is False and nothing["layout"] is None and nothing["launch"] is None
    assert eight["fits"] is True and eight["launch"].startswith("torchrun --nproc-per-node=8 ")


def test_the_recommended_layout_is_launched_with_its_flags(capsys):
    """One node: torchrun with the recommended layout's pasted flags; a GPU of 4 a node launches
    the same 8 GPUs with srun over two nodes."""
    lines, record, _ = run_plan(capsys, "tiny", "--gpus", "8")
    first = record["suggested"][0]
    launch = lines[lines.index("launch the recommended layout:") + 1].strip()
    assert launch == first["launch"] == f"torchrun --nproc-per-node=8 -m moetrain train tiny {' '.join(first['flags'])}"
    assert record["launch"] == "torchrun --nproc-per-node=8 -m moetrain train tiny"  # the layout as given


def test_a_gpu_the_planner_does_not_know_is_planned_from_its_figures(capsys, custom_gpus):
    """--gpu NAME:memory_gib=…,bf16_tflops=…,hbm_tb_s=…: its memory is the capacity; the keys
    left out are an H100 SXM's, as --help says (an H100's three figures plan as an H100)."""
    _, record, _ = run_plan(capsys, "tiny", "--gpus", "1", "--gpu", "mygpu:memory_gib=24,bf16_tflops=165,hbm_tb_s=1")
    assert record["gpu"] == "mygpu" and record["capacity_gib"] == 24 and record["suggested"]
    h100 = GPUS["h100"]
    like = f"like:memory_gib={h100.memory_gib},bf16_tflops={h100.bf16_flops / 1e12},hbm_tb_s={h100.hbm_bytes_s / 1e12}"
    _, mine, _ = run_plan(capsys, "ref-small-64e", "--gpus", "16", "--no-suggest", "--gpu", like)
    _, theirs, _ = run_plan(capsys, "ref-small-64e", "--gpus", "16", "--no-suggest", "--gpu", "h100")
    assert mine["step_time_s"] == theirs["step_time_s"] and mine["capacity_gib"] == theirs["capacity_gib"]
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    defaults = f"nvlink_gb_s={h100.nvlink_bytes_s / 1e9:g}, network_gb_s={h100.network_bytes_s / 1e9:g}, "
    defaults += f"gpus_per_node={h100.gpus_per_node}, fp8={str(h100.fp8).lower()}"
    assert f"default to an H100 SXM's ({defaults})" in help_text
    four = "four:memory_gib=80,bf16_tflops=989,hbm_tb_s=3.35,gpus_per_node=4,fp8=false,nvlink_gb_s=100,network_gb_s=25"
    _, record, _ = run_plan(capsys, "tiny", "--gpus", "8", "--gpu", four)
    assert record["suggested"][0]["launch"].startswith("srun --ntasks=8 --ntasks-per-node=4 --gpus-per-task=1 ")
    assert GPUS["four"].nvlink_bytes_s == 100e9 and GPUS["four"].network_bytes_s == 25e9 and not GPUS["four"].fp8


REQUIRED = "memory_gib=24,bf16_tflops=165,hbm_tb_s=1"


@pytest.mark.parametrize(
    "gpu, words",
    [
        ("x:memory_gib=24,bf16_tflops=165", ["hbm_tb_s missing", "NAME:memory_gib="]),
        (f"x:{REQUIRED},colour=red", ["'colour' is not a key", "nvlink_gb_s", "gpus_per_node"]),
        (f"x:{REQUIRED},memory_gib=32", ["memory_gib is given twice"]),
        ("x:memory_gib=lots,bf16_tflops=165,hbm_tb_s=1", ["memory_gib='lots' is not a positive number"]),
        ("x:memory_gib=24,bf16_tflops=-1,hbm_tb_s=1", ["bf16_tflops='-1' is not a positive number"]),
        ("x:memory_gib=24,bf16_tflops=165,hbm_tb_s=0", ["hbm_tb_s='0' is not a positive number"]),
        (f"x:{REQUIRED},gpus_per_node=2.5", ["gpus_per_node='2.5' is not a positive whole number"]),
        (f"x:{REQUIRED},fp8=maybe", ["fp8='maybe' must be true or false"]),
        (f"x:{REQUIRED},nvlink_gb_s=", ["nvlink_gb_s='' is not a positive number"]),
        (f":{REQUIRED}", ["names no GPU before the ':'"]),
        (f"H100:{REQUIRED}", ["h100 is a GPU the planner knows", "--gpu myh100:"]),
        ("v100", ["--gpu='v100'", "a100, h100, h200, b200, b300", "NAME:memory_gib="]),
    ],
)
def test_a_bad_gpu_is_refused_naming_the_key_and_the_fix(capsys, custom_gpus, gpu, words):
    err = refused(capsys, "tiny", "--gpus", "1", "--gpu", gpu)
    assert all(w in err for w in words), err
    assert "h100" not in GPUS or GPUS["h100"].name == "H100 SXM"


@pytest.mark.parametrize("gpus", ["64,,x", "0", "-8", "8,0", "two", "8;16", ""])
def test_a_bad_gpu_count_list_is_refused_naming_gpus(capsys, gpus):
    err = refused(capsys, "tiny", f"--gpus={gpus}")
    assert f"--gpus={gpus!r}" in err and "--gpus 64,128,256" in err, err


def test_the_table_needs_the_search(capsys):
    err = refused(capsys, "tiny", "--gpus", "8,16", "--no-suggest")
    assert "--gpus=8,16 --no-suggest" in err and "Drop --no-suggest, or plan one count" in err


def test_the_new_argument_mistakes_load_no_torch():
    """A bad --gpus list, --tokens and custom --gpu answer before the planner (and torch) loads."""
    argvs = [
        ["plan", "tiny", "--gpus", "64,,x"],
        ["plan", "tiny", "--gpus", "8", "--tokens", "lots"],
        ["plan", "tiny", "--gpus", "8", "--gpu", "x:memory_gib=24"],
    ]
    code = (
        "import sys\nfrom moetrain.cli import main\n"
        f"codes = [main(argv) for argv in {argvs!r}]\n"
        "print(codes, 'torch loaded' if 'torch' in sys.modules else 'no torch')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[2, 2, 2] no torch", (out.stdout, out.stderr[-800:])
    assert "'64,,x'" in out.stderr and "'lots'" in out.stderr and "bf16_tflops, hbm_tb_s missing" in out.stderr


def test_with_a_rounded_batch_the_search_finds_counts_that_are_not_powers_of_two(custom_gpus):
    """ref-tiny-64e with 8 experts does not fit a 16 GiB GPU below 48 of them. 48 divides its
    256 sequences only with the batch rounded up to a multiple of the micro-batch (288: 6 × 48),
    which `fewest_gpus(round_batch=True)` (moetrain plan's) does and shows in the flags; without
    it, as the out-of-memory advice asks, 64 is the fewest."""
    from moetrain.cli.planning import _suggestion_flags
    from moetrain.plan.hardware import custom_gpu

    cfg = resolve_config("ref-tiny-64e", ["model.moe.num_experts=8"])
    gpu = custom_gpu("small", memory_gib=16)
    rounded = with_layout(cfg, 24, pp=1, ep=8, recompute="full", rows=1, round_batch=True)
    assert rounded.train.global_batch_size == 264 and rounded.train.micro_batch_size == 24
    assert with_layout(cfg, 24, pp=1, ep=8, recompute="full", rows=1) is None
    assert with_layout(cfg, 512, pp=1, ep=8, recompute="full", rows=1, round_batch=True) is None
    more = fewest_gpus(cfg, 1, gpu, round_batch=True)
    assert more.gpus == 48 and fewest_gpus(cfg, 1, gpu).gpus == 64
    flags = _suggestion_flags(cfg, more.plan, ["--model.moe.num_experts=8"])
    assert "--train.global_batch_size=288" in flags
    again = plan(resolve_config("ref-tiny-64e", [f.removeprefix("--") for f in flags]), 48, gpu)
    assert again.layout == more.plan.layout and again.fits


def test_attention_sinks_are_said_to_be_priced_as_flash_attention(capsys):
    """The planner prices attention as FlashAttention's; with sinks SDPA's masked kernels run it on
    a GPU, and the plan says so."""
    _, _, err = run_plan(capsys, "tiny", "--gpus", "1", "--no-suggest", "--model.attention_sinks=true")
    assert "note: model.attention_sinks" in err and "not measured" in err
    _, _, err = run_plan(capsys, "tiny", "--gpus", "1", "--no-suggest")
    assert "attention_sinks" not in err
