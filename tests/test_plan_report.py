"""What `moetrain plan` tells a reader (issue 32, item 5): where nothing fits, how many GPUs of
the kind would; communication in the step time labelled as its exposed part, beside the whole
transfer; a legend of the layout abbreviations under the output and in --help. The message
through the command line, in one subprocess; the rest in-process."""

import json
import subprocess
import sys

import pytest

from moetrain.cli import main
from moetrain.plan import (
    EXPOSED_PARTS,
    MAX_GPUS,
    MoreGpus,
    fewest_gpus,
    larger_counts,
    layout_legend,
    more_gpus_text,
    plan,
    report,
    suggest,
)
from moetrain.plan.report import Budget
from moetrain.presets import resolve_config


@pytest.fixture(scope="module")
def ref_large_on_8():
    """(stdout lines, JSON record) of `moetrain plan ref-large-128e --gpus 8`: a 296B model no
    layout fits on 8 H200s."""
    out = subprocess.run(
        [sys.executable, "-m", "moetrain", "plan", "ref-large-128e", "--gpus", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


@pytest.fixture(scope="module")
def ref_large_more():
    """`fewest_gpus` of ref-large-128e above 8 H200s, in-process."""
    return fewest_gpus(resolve_config("ref-large-128e"), 8, "h200")


def test_where_nothing_fits_plan_says_how_many_gpus_would(ref_large_on_8, ref_large_more):
    lines, record = ref_large_on_8
    text = "\n".join(lines)
    more = ref_large_more
    assert more.gpus > more.tight_gpus > 8  # a count with headroom, and a smaller one where all are tight
    assert "add GPUs or shrink the model" not in text
    assert (
        "no layout of the ddp stack fits 8 × h200. The fewest h200 GPUs on which a layout fits with headroom: "
        f"{more.gpus}" in text
    )
    assert (
        f"{more.tight_gpus} fit only TIGHT" in text and f"on {more.gpus} × h200: {more.plan.layout.describe()}" in text
    )
    assert f"rehearse one rank: moetrain bench ref-large-128e --rehearse {more.gpus}" in text
    assert lines[0].startswith("no layout of the ddp stack fits 8 × h200")  # the answer first
    assert text.index("the layout as given:") < text.index("layout: dp8 ddp")
    fewest = record["fewest_gpus"]
    assert (fewest["gpus"], fewest["tight_gpus"], fewest["searched_up_to"]) == (more.gpus, more.tight_gpus, MAX_GPUS)
    assert fewest["layout"] == more.plan.layout.describe() and fewest["tight"] is False and fewest["flags"]
    assert fewest["peak_mem_gib_per_device"] < 0.9 * record["capacity_gib"]
    srun = f"srun --ntasks={more.gpus} --ntasks-per-node=8 --gpus-per-task=1 python -m moetrain train ref-large-128e "
    assert fewest["launch"] == srun + " ".join(fewest["flags"]) and f"  launch: {fewest['launch']}" in lines
    assert fewest["time_to_budget_s"] == pytest.approx(record["tokens_budget"] / fewest["tokens_per_sec"], rel=1e-4)
    assert f"{fewest['tokens_per_sec']:,.0f} on {more.gpus} GPUs: " in text
    assert record["suggested"] == [] and record["fits"] is False  # the keys outside checks read stay


def test_the_exposed_part_of_communication_is_labelled_with_its_transfer(ref_large_on_8):
    lines, record = ref_large_on_8
    p = plan(resolve_config("ref-large-128e"), 8, "h200")
    dp = next(line for line in lines if line.strip().startswith("dp_reductions"))
    assert f"exposed, of {p.transfer_s('dp_reductions'):.4f} s of transfer" in dp, dp
    assert 0 < p.time_s["dp_reductions"] < p.transfer_s("dp_reductions")
    assert record["exposed_comm_s"] == round(p.exposed_comm_s, 4)
    assert record["comm_transfer_s"] == round(p.transfer_s("dp_reductions"), 4)


def test_the_layout_abbreviations_are_explained_once(ref_large_on_8):
    lines, _ = ref_large_on_8
    assert lines.count("layout abbreviations:") == 1
    legend = lines[lines.index("layout abbreviations:") + 1 : -1]
    for word in ("dpN:", "epN:", "ppN:", "cf F:", "spill S:", "overlap×N:", "sharded-optimizer:", "recompute="):
        assert any(line.strip().startswith(word) for line in legend), word
    assert not any(line.strip().startswith("cpN:") for line in legend)  # no cp in any layout shown


def test_plan_help_explains_every_abbreviation(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Layout abbreviations:" in help_text
    for meaning in layout_legend():
        assert " ".join(meaning.split()) in help_text, meaning


def test_every_communication_line_of_the_step_is_labelled_exposed():
    cfg = resolve_config(
        "sweep-8l-128", ["parallel.ep=8", "parallel.overlap_chunks=4", "parallel.shard_optimizer=true"]
    )
    p = plan(cfg, 8, "h200")
    lines = report(p).splitlines()
    lines = lines[lines.index("step time (s), by part:") :]
    for part in ("expert_all_to_all", "dp_reductions"):
        line = next(x for x in lines if x.strip().startswith(part))
        assert f"exposed, of {p.transfer_s(part):.4f} s of transfer" in line
        assert 0 < p.time_s[part] < p.transfer_s(part)  # compute hides some of each
    total = next(x for x in lines if "communication exposed" in x)
    assert f"{p.exposed_comm_s:.4f}" in total and p.exposed_comm_s == sum(p.time_s[k] for k in EXPOSED_PARTS)


def test_fewest_gpus_searches_counts_above_the_given_one():
    assert larger_counts(8) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    assert larger_counts(12)[:4] == [16, 24, 32, 48] and larger_counts(MAX_GPUS) == []
    assert larger_counts(20)[:4] == [24, 32, 40, 48]  # the count given, doubled
    cfg = resolve_config("ref-small-64e")
    assert not suggest(cfg, 2, "h200")
    more = fewest_gpus(cfg, 2, "h200")
    assert more.gpus == 8 and not more.plan.tight and suggest(cfg, 8, "h200", limit=1)[0].layout == more.plan.layout


def test_a_model_too_large_for_any_count_is_told_to_shrink():
    text = more_gpus_text(MoreGpus(None, None, 2048), 8, "h100", [], "", "", Budget(10**12))
    assert text == [
        f"no layout of the ddp stack fits 8 × h100, nor on any count of them up to {MAX_GPUS} "
        "(from 2048 on, layouts fit only TIGHT): shrink the model."
    ]


def test_the_out_of_memory_advice_names_the_gpus_too(ref_large_more):
    from moetrain.memory_advice import advice

    text = advice(resolve_config("ref-large-128e"), 8, "h200")
    more = ref_large_more
    assert (
        f"finds no layout that fits 8 × h200: the fewest h200 GPUs on which one fits with headroom are {more.gpus}"
        in text
    )
    assert "--parallel.ep=" in text and text.endswith("or shrink the model")


def test_a_gpu_count_the_presets_batch_does_not_divide_over_is_planned_at_one_it_does(capsys):
    """ref-large-128e's micro-batch of 512 sequences over 1,024 data-parallel ranks: planned at
    the smallest batch that divides (one sequence per GPU, the global batch a multiple of that),
    said on stderr and carried into the rehearsal's flags; a batch the command line set is refused
    instead, naming --micro-batch."""
    assert main(["plan", "ref-large-128e", "--gpus", "1024", "--gpu", "h100", "--no-suggest"]) == 0
    out = capsys.readouterr()
    assert "planned with --train.micro_batch_size=1024 --train.global_batch_size=2048" in out.err
    record = json.loads(out.out.strip().splitlines()[-1])
    assert "--train.micro_batch_size=1024" in record["rehearse_command"]
    assert "dp1024" in out.out and "1 seq × 2 micro-batches per rank" in out.out
    given = ["--train.micro_batch_size=512", "--no-suggest"]
    assert main(["plan", "ref-large-128e", "--gpus", "1024", "--gpu", "h100", *given]) == 2
    err = capsys.readouterr().err
    assert "does not divide over the 1024 data-parallel ranks" in err and "--micro-batch N" in err


def test_a100s_are_planned_without_fp8(capsys):
    """--gpu a100: its memory, BF16 peak and links from the datasheet (no FP8 tensor cores, so an
    FP8 plan is refused by name); a run on an A100 is planned on it."""
    from moetrain.plan import GPUS, plan_gpu

    p = plan(resolve_config("bench-small32e", ["train.micro_batch_size=8", "train.global_batch_size=8"]), 8, "a100")
    h100 = plan(resolve_config("bench-small32e", ["train.micro_batch_size=8", "train.global_batch_size=8"]), 8, "h100")
    assert p.gpu.name == "A100 SXM" and p.step_time_s > h100.step_time_s  # a third of the FLOP/s
    assert plan_gpu("NVIDIA A100-SXM4-80GB", 85_899_345_920) == "a100" and not GPUS["a100"].fp8
    assert main(["plan", "bench-small32e", "--gpus", "8", "--gpu", "a100", "--precision.fp8=rowwise"]) == 2
    assert "needs FP8 tensor cores, which A100 SXM lacks" in capsys.readouterr().err
