"""`moetrain plan`. The planner (and torch, which it counts the model with) loads once the
arguments and the config are read: --help and their mistakes (--gpus, --tokens, a custom --gpu)
answer without it."""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import textwrap
from typing import TYPE_CHECKING

from moetrain.cli.args import command_parser, split_overrides
from moetrain.errors import ConfigError
from moetrain.parallel.config import layout_legend
from moetrain.presets import resolve_config
from moetrain.train.config import RunConfig

if TYPE_CHECKING:  # the planner loads torch: imported where the plan is made
    from moetrain.plan.report import Budget

GPU_KEYS: dict[str, tuple[str, float, str]] = {
    "memory_gib": ("memory_gib", 1.0, "GiB a run can allocate: the card's memory less ~1.5 GiB"),
    "bf16_tflops": ("bf16_flops", 1e12, "dense BF16 tensor-core TFLOP/s"),
    "hbm_tb_s": ("hbm_bytes_s", 1e12, "memory bandwidth, TB/s"),
    "nvlink_gb_s": ("nvlink_bytes_s", 1e9, "NVLink GB/s per GPU, one way"),
    "network_gb_s": ("network_bytes_s", 1e9, "network GB/s per GPU across nodes, one way"),
    "gpus_per_node": ("gpus_per_node", 1, "GPUs per node, a whole number"),
    "fp8": ("fp8", 1, "FP8 tensor cores, true or false"),
}
"""The keys of --gpu NAME:key=value,…: the field of `moetrain.plan.hardware.GPU` each sets, the scale from
the key's unit to the field's, and what it is."""
REQUIRED_GPU_KEYS = ("memory_gib", "bf16_tflops", "hbm_tb_s")
CUSTOM_GPU_FORM = (
    "NAME:memory_gib=80,bf16_tflops=989,hbm_tb_s=3.35[,nvlink_gb_s=450,network_gb_s=50,gpus_per_node=8,fp8=true]"
)
TOKEN_SCALES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
"""--tokens' suffixes."""


def _plan_parser() -> argparse.ArgumentParser:
    fill = functools.partial(textwrap.fill, width=100)
    legend = "\n".join(fill(m, initial_indent="  ", subsequent_indent="      ") for m in layout_legend())
    parser = command_parser(
        "plan",
        fill(
            "Per-GPU parameters, gradients, optimizer state, activations (with and without recompute), "
            "communication per step, step time (communication only where compute does not hide it: its exposed "
            "part), MFU, tokens/s and the time to train a token budget (--tokens) of a preset on N GPUs, from the "
            "config alone; then layouts that fit, fastest first, with the line that launches the recommended one, "
            "or, when none does, the fewest GPUs of the kind on which one fits. Several counts (--gpus "
            "64,128,256) print one row each instead: the fastest layout that fits, its speed and its launch line. "
            "Ends with one JSON line (peak_mem_gib_per_device, fits, step_time_s, mfu, tokens_per_sec, "
            "time_to_budget_s, exposed_comm_s, fewest_gpus, …). Assumptions: src/moetrain/plan/calibration.py."
        ),
        epilog=fill(
            "Set the layout with config keys: --parallel.ep=8 --parallel.pp=8 --compute.recompute=full "
            "--parallel.shard_optimizer=true …"
        )
        + f"\n\nLayout abbreviations:\n{legend}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("spec", metavar="PRESET_OR_YAML")
    parser.add_argument(
        "--gpus",
        required=True,
        metavar="N[,N…]",
        help="number of GPUs (world size); or several, comma-separated (64,128,256): one row per count with the "
        "fastest layout that fits, its speed, time to the budget and launch line",
    )
    keys = "; ".join(f"{key}: {meaning}" for key, (_, _, meaning) in GPU_KEYS.items())
    parser.add_argument(
        "--gpu",
        default="h200",
        help=f"a100, h100, h200, b200 or b300 (default h200); or a GPU the planner does not know, {CUSTOM_GPU_FORM} "
        f"({keys}). memory_gib, bf16_tflops and hbm_tb_s are required; the others default to an H100 SXM's "
        "(nvlink_gb_s=450, network_gb_s=50, gpus_per_node=8, fp8=true). Its step time rests on the efficiencies "
        "measured on Hopper",
    )
    parser.add_argument(
        "--tokens",
        metavar="N",
        help="the token budget each layout is timed on: 250B, 1.5T, 500M, 2e12 or a whole number (default: the "
        "run's length, train.steps × train.global_batch_size × data.seq_len)",
    )
    parser.add_argument(
        "--micro-batch", type=int, help="sequences per GPU per micro-batch (sets train.micro_batch_size = this × dp)"
    )
    parser.add_argument(
        "--no-suggest", action="store_true", help="skip the search for layouts that fit (and for more GPUs)"
    )
    return parser


def _gpu_counts(text: str) -> list[int]:
    """--gpus: one GPU count, or several, comma-separated."""
    counts = []
    for item in text.split(","):
        item = item.strip()
        if not (item.isascii() and item.isdigit()) or int(item) == 0:
            raise ConfigError(
                f"--gpus={text!r}: {item!r} is not a positive number of GPUs. Write one count (--gpus 64) or "
                "several, comma-separated (--gpus 64,128,256)."
            )
        counts.append(int(item))
    return counts


def _token_count(text: str) -> int:
    """--tokens: 250B, 1.5T, 500M, 2e12 or a whole number, as a number of tokens."""
    number, scale = text.strip(), 1.0
    if number[-1:].upper() in TOKEN_SCALES:
        number, scale = number[:-1], TOKEN_SCALES[number[-1].upper()]
    try:
        tokens = float(number) * scale
    except ValueError:
        tokens = math.nan
    if not math.isfinite(tokens) or tokens < 1:
        raise ConfigError(
            f"--tokens={text!r} is not a number of tokens. Write 250B, 1.5T, 500M (K, M, B, T: thousand, million, "
            "billion, trillion), 2e12 or a whole number; without --tokens each layout is timed on the run's length."
        )
    return round(tokens)


def _custom_gpu(text: str) -> tuple[str, dict[str, float | int | bool]] | None:
    """--gpu NAME:key=value,…: its name and the `GPU` fields it sets (None: a plain name)."""
    if ":" not in text:
        return None
    name, _, spec = (part.strip() for part in text.partition(":"))
    if not name:
        raise ConfigError(f"--gpu={text!r} names no GPU before the ':'. Write --gpu {CUSTOM_GPU_FORM}.")
    fields: dict[str, float | int | bool] = {}
    for item in spec.split(","):
        key, _, value = (part.strip() for part in item.partition("="))
        if key not in GPU_KEYS:
            raise ConfigError(
                f"--gpu {name}:…: {key!r} is not a key of a GPU. The keys: {', '.join(GPU_KEYS)}, as in --gpu "
                f"{CUSTOM_GPU_FORM}."
            )
        field = GPU_KEYS[key][0]
        if field in fields:
            raise ConfigError(f"--gpu {name}:…: {key} is given twice: give it once.")
        fields[field] = _gpu_value(name, key, value)
    missing = [key for key in REQUIRED_GPU_KEYS if GPU_KEYS[key][0] not in fields]
    if missing:
        raise ConfigError(
            f"--gpu {name}:…: {', '.join(missing)} missing. A GPU the planner does not know needs memory_gib, "
            f"bf16_tflops and hbm_tb_s: --gpu {CUSTOM_GPU_FORM}."
        )
    return name, fields


def _gpu_value(name: str, key: str, value: str) -> float | int | bool:
    """The `GPU` field's value of `key=value` in --gpu NAME:…."""
    field, scale, meaning = GPU_KEYS[key]
    if field == "fp8":
        if value.lower() not in ("true", "false"):
            raise ConfigError(f"--gpu {name}:…: fp8={value!r} must be true or false ({meaning}).")
        return value.lower() == "true"
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    whole = field == "gpus_per_node"
    if not math.isfinite(number) or number <= 0 or (whole and not number.is_integer()):
        raise ConfigError(
            f"--gpu {name}:…: {key}={value!r} is not a positive {'whole ' if whole else ''}number: write "
            f"{key}=N ({meaning})."
        )
    return int(number) if whole else number * scale


def _plan_config(args: argparse.Namespace, overrides: list[str], gpus: int) -> tuple[RunConfig, list[str]]:
    """The config `plan` plans on `gpus` GPUs, and the flags it was given: --micro-batch as the key
    it sets; else, where the micro-batch does not divide over the data-parallel ranks and the
    command line did not set the batch, the smallest batch that does (the micro-batch a multiple
    of dp sequences, the global batch the smallest multiple of that not below the preset's), said
    on stderr and added to the flags."""
    cfg = resolve_config(args.spec, overrides, validate=args.micro_batch is None)
    p, tc, given = cfg.parallel, cfg.train, [f"--{o}" for o in overrides]
    if args.micro_batch is not None and args.micro_batch <= 0:
        raise ConfigError(f"--micro-batch={args.micro_batch} must be a positive number of sequences.")
    if gpus % (p.pp * p.cp):
        if args.micro_batch is None:
            return cfg, given  # the plan names what does not divide
        ranks = f"parallel.pp={p.pp}" + (f" × parallel.cp={p.cp}" if p.cp > 1 else "")
        raise ConfigError(f"{ranks} does not divide --gpus={gpus}: plan a multiple of {p.pp * p.cp} GPUs.")
    dp = p.dp or gpus // (p.pp * p.cp)
    if args.micro_batch is not None:
        flags = [f"train.micro_batch_size={args.micro_batch * dp}"]
    elif tc.micro_batch_size % dp == 0:
        return cfg, given
    elif any(o.startswith(("train.micro_batch_size=", "train.global_batch_size=")) for o in overrides):
        raise ConfigError(
            f"train.micro_batch_size={tc.micro_batch_size} does not divide over the {dp} data-parallel ranks of "
            f"--gpus={gpus}: pass --micro-batch N (sequences per GPU per micro-batch) or a multiple of {dp}."
        )
    else:
        micro = -(-tc.micro_batch_size // dp) * dp
        batch = -(-tc.global_batch_size // micro) * micro
        flags = [f"train.micro_batch_size={micro}", f"train.global_batch_size={batch}"]
        print(
            f"note: {args.spec}'s micro-batch of {tc.micro_batch_size} sequences does not divide over {dp} "
            f"data-parallel ranks of {gpus} GPUs: planned with --{flags[0]} --{flags[1]} ({micro // dp} per GPU per "
            "micro-batch; --micro-batch N sets another).",
            file=sys.stderr,
        )
    try:
        return resolve_config(args.spec, overrides + flags), given + [f"--{f}" for f in flags]
    except ConfigError as e:
        if args.micro_batch is None:
            raise
        raise ConfigError(
            f"--micro-batch={args.micro_batch} on {dp} data-parallel ranks sets {flags[0]}: {e}"
        ) from None


def cmd_plan(argv: list[str]) -> int:
    args, overrides = split_overrides(_plan_parser(), argv)
    counts, custom = _gpu_counts(args.gpus), _custom_gpu(args.gpu)
    tokens = None if args.tokens is None else _token_count(args.tokens)
    if len(counts) > 1 and args.no_suggest:
        raise ConfigError(
            f"--gpus={args.gpus} --no-suggest: the table across GPU counts shows each count's fastest layout that "
            "fits, the search --no-suggest skips. Drop --no-suggest, or plan one count."
        )
    configs = [_plan_config(args, overrides, n) for n in counts]
    run = resolve_config(args.spec, overrides, validate=False)  # the run's length as given, before any batch note
    run_tokens = run.train.steps * run.train.global_batch_size * run.data.seq_len
    if run.model.attention_sinks:
        print(
            "note: model.attention_sinks: attention is priced as FlashAttention's, but on a GPU SDPA's masked kernels "
            "run it (src/moetrain/model/sinks.py), slower by an amount not measured, with a (T, T + 1) mask a layer.",
            file=sys.stderr,
        )
    from moetrain.plan.report import Budget

    gpu = _planner_gpu(args.gpu, custom)
    budget = Budget(run_tokens, run.train.steps) if tokens is None else Budget(tokens)
    if len(counts) > 1:
        return _plan_counts(args.spec, counts, configs, gpu, budget)
    return _plan_one(args, counts[0], *configs[0], gpu, budget)


def _planner_gpu(text: str, custom: tuple[str, dict] | None) -> str:
    """The planner's key of --gpu: one it ships with, or the custom GPU `custom`, added to its GPUs."""
    from moetrain.plan.hardware import KNOWN_GPUS, custom_gpu

    if custom is not None:
        return custom_gpu(custom[0], **custom[1])
    if text.lower() not in KNOWN_GPUS:
        raise ConfigError(
            f"--gpu={text!r} is not one the planner knows: choose one of {', '.join(KNOWN_GPUS)}, or describe "
            f"yours as --gpu {CUSTOM_GPU_FORM} (moetrain plan --help lists the keys)."
        )
    return text.lower()


def _plan_one(args: argparse.Namespace, gpus: int, cfg: RunConfig, given: list[str], gpu: str, budget: Budget) -> int:
    """The report of one GPU count: the layout as given, the layouts that fit (or the fewest GPUs
    on which one would) with their speed and time to the budget, launch lines, the JSON line."""
    import moetrain.plan as planner
    from moetrain import rehearse
    from moetrain.plan.report import budget_line, launch_command, speed_text

    result = planner.plan(cfg, gpus, gpu)
    suggestions = [] if args.no_suggest else planner.suggest(cfg, gpus, gpu)
    lines = [_command_lines(args.spec, cfg, gpus, s, given) for s in suggestions]
    pasted, commands, launches = ([line[i] for line in lines] for i in range(3))
    roomy = [i for i, s in enumerate(suggestions) if not s.tight]
    best = roomy[0] if roomy else 0
    shown, more, more_flags = [result] + suggestions, None, ([], "", "")
    if not suggestions and not args.no_suggest:  # nothing fits: the answer is a GPU count, said first
        more = planner.fewest_gpus(cfg, gpus, gpu, round_batch=True)
        more_flags = _command_lines(args.spec, cfg, more.gpus, more.plan, given) if more.plan else more_flags
        shown += [more.plan] if more.plan else []
        print("\n".join(planner.more_gpus_text(more, gpus, gpu, *more_flags, budget)) + "\n\nthe layout as given:")
    elif roomy and (not result.fits or result.tight):  # lead with what to run instead
        s = suggestions[best]
        print(
            f"recommended: {s.layout.describe()}, {_fit_words(s)}; {speed_text(s, gpus, budget)}; the layout as "
            f"given {_fit_words(result)}\n  flags: {' '.join(pasted[best])}\n  rehearse one rank: {commands[best]}"
            f"\n  launch: {launches[best]}\n\nthe layout as given:"
        )
    print(planner.report(result))
    print(budget_line(result, gpus, budget))
    if result.tight:
        print(
            f"  -> TIGHT: within the memory model's {planner.PEAK_ERROR:.0%} error of the {result.gpu.memory_gib:g} GiB"
        )
    if suggestions:
        print("\n".join(planner.layouts_text(suggestions, pasted, commands, gpus, budget)))
    out = planner.to_json(result, args.spec, gpus, gpu, suggestions, budget)
    out["busiest_rank"] = result.busiest_rank
    out["rehearse_command"] = rehearse.command(args.spec, gpus, result.busiest_rank, given)
    out["launch"] = launch_command(args.spec, gpus, result.gpu, given)
    print(
        "measure one rank of this layout on one GPU (its compute, memory and checkpoint shard; communication "
        f"modelled):\n  {out['rehearse_command']}"
    )
    if suggestions:
        print(f"the same for the recommended layout:\n  {commands[best]}")
        print(f"launch the recommended layout:\n  {launches[best]}")
    elif result.fits:
        print(f"launch this layout:\n  {out['launch']}")
    print("\n".join(planner.legend_lines([p.layout.describe() for p in shown])))
    for entry, flags, cmd, launch in zip(out["suggested"], pasted, commands, launches):
        entry["flags"], entry["rehearse_command"], entry["launch"] = flags, cmd, launch
    out["fewest_gpus"] = None if more is None else planner.more_gpus_json(more, *more_flags, budget)
    print(json.dumps(out))
    return 0


def _plan_counts(
    spec: str, counts: list[int], configs: list[tuple[RunConfig, list[str]]], gpu: str, budget: Budget
) -> int:
    """One row per GPU count (each count's config from `_plan_config`): the fastest layout that
    fits, its speed and time to the budget; then the launch lines, the legend and one JSON line."""
    from moetrain.plan import legend_lines, suggest
    from moetrain.plan.report import CountPlan, counts_json, counts_text

    rows = []
    for n, (cfg, given) in zip(counts, configs):
        found = (suggest(cfg, n, gpu, limit=1) or [None])[0]
        flags, _, launch = (None, None, None) if found is None else _command_lines(spec, cfg, n, found, given)
        rows.append(CountPlan(n, found, flags, launch))
    legend = legend_lines([r.plan.layout.describe() for r in rows if r.plan])
    print("\n".join(counts_text(rows, spec, gpu, budget) + legend))
    print(json.dumps(counts_json(rows, spec, gpu, budget)))
    return 0


def _command_lines(spec: str, cfg: RunConfig, gpus: int, p, given: list[str]) -> tuple[list[str], str, str]:
    """The flags of the planned layout `p` on `gpus` GPUs (`_suggestion_flags`), the command that
    rehearses it and the line that launches it."""
    from moetrain import rehearse
    from moetrain.plan.report import launch_command

    flags = _suggestion_flags(cfg, p, given)
    return flags, rehearse.command(spec, gpus, p.busiest_rank, flags), launch_command(spec, gpus, p.gpu, flags)


def _suggestion_flags(cfg: RunConfig, suggestion, given: list[str]) -> list[str]:
    """The command line's flags with a suggested layout's in place of the ones it changes, its
    global batch among them where the search rounded it (`fewest_gpus`' round_batch)."""
    L = suggestion.layout
    changed = L.to_flags(cfg)
    if L.micro_batches * L.rows_per_micro_batch * L.dp != cfg.train.global_batch_size:
        changed.append(f"--train.global_batch_size={L.micro_batches * L.rows_per_micro_batch * L.dp}")
    keys = {f.split("=")[0] for f in changed}
    return [g for g in given if g.split("=")[0] not in keys] + changed


def _fit_words(p) -> str:
    """ "peak 101.5 of 139 GiB" with "does NOT fit" or "TIGHT" where it applies."""
    from moetrain.plan import PEAK_ERROR

    words = f"peak {p.largest_peak_gib:.1f} of {p.gpu.memory_gib:g} GiB"
    if not p.fits:
        return words + ": does NOT fit"
    return words + (f": TIGHT (within the memory model's {PEAK_ERROR:.0%})" if p.tight else "")
