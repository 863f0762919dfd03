"""`moetrain plan`. The planner (and torch, which it counts the model with) loads once the
arguments and the config are read: --help and their mistakes answer without it."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from moetrain.cli.args import split_overrides
from moetrain.errors import ConfigError
from moetrain.parallel.config import layout_legend
from moetrain.presets import resolve_config
from moetrain.train.config import RunConfig


def _plan_parser() -> argparse.ArgumentParser:
    def fill(text: str) -> str:
        return textwrap.fill(text, width=100)

    legend = "\n".join(
        textwrap.fill(m, width=100, initial_indent="  ", subsequent_indent="      ") for m in layout_legend()
    )
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="moetrain plan",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=fill(
            "Per-GPU parameters, gradients, optimizer state, activations (with and without recompute), "
            "communication per step, step time (communication only where compute does not hide it: its exposed "
            "part) and MFU of a preset on N GPUs, from the config alone; then layouts that fit, fastest first, "
            "or, when none does, the fewest GPUs of the kind on which one fits. Ends with one "
            "JSON line (peak_mem_gib_per_device, fits, step_time_s, mfu, exposed_comm_s, fewest_gpus, …). "
            "Assumptions: src/moetrain/plan/calibration.py."
        ),
        epilog=fill(
            "Set the layout with config keys: --parallel.ep=8 --parallel.pp=8 --train.recompute=full "
            "--parallel.shard_optimizer=true …"
        )
        + f"\n\nLayout abbreviations:\n{legend}",
    )
    parser.add_argument("spec", metavar="PRESET_OR_YAML")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs (world size)")
    parser.add_argument("--gpu", default="h200", help="a100, h100, h200, b200 or b300 (default h200)")
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="sequences per GPU per micro-batch (sets train.micro_batch_size = this × dp)",
    )
    parser.add_argument(
        "--no-suggest", action="store_true", help="skip the search for layouts that fit (and for more GPUs)"
    )
    return parser


def _plan_config(args: argparse.Namespace, overrides: list[str]) -> tuple[RunConfig, list[str]]:
    """The config `plan` plans, and the overrides it was given (--micro-batch as the key it sets)."""
    cfg = resolve_config(args.spec, overrides, validate=args.micro_batch is None)
    if args.micro_batch is None:
        return _dividing_batch(cfg, args, overrides)
    if args.micro_batch <= 0:
        raise ConfigError(f"--micro-batch={args.micro_batch} must be a positive number of sequences.")
    pp = cfg.parallel.pp
    if args.gpus % pp:
        raise ConfigError(f"parallel.pp={pp} does not divide --gpus={args.gpus}.")
    dp = cfg.parallel.dp or args.gpus // pp
    cfg = resolve_config(args.spec, overrides + [f"train.micro_batch_size={args.micro_batch * dp}"])
    return cfg, [f"--{o}" for o in overrides] + [f"--train.micro_batch_size={cfg.train.micro_batch_size}"]


def _dividing_batch(cfg: RunConfig, args: argparse.Namespace, overrides: list[str]) -> tuple[RunConfig, list[str]]:
    """`cfg` and the flags given, where its micro-batch divides over the data-parallel ranks of
    --gpus; else, unless the command line set the batch, the smallest batch that does (the
    micro-batch a multiple of dp sequences, the global batch the smallest multiple of that not
    below the preset's), said on stderr and added to the flags."""
    p, tc, given = cfg.parallel, cfg.train, [f"--{o}" for o in overrides]
    if args.gpus % (p.pp * p.cp):
        return cfg, given  # the plan names what does not divide
    dp = p.dp or args.gpus // (p.pp * p.cp)
    if tc.micro_batch_size % dp == 0:
        return cfg, given
    if any(o.startswith(("train.micro_batch_size=", "train.global_batch_size=")) for o in overrides):
        raise ConfigError(
            f"train.micro_batch_size={tc.micro_batch_size} does not divide over the {dp} data-parallel ranks of "
            f"--gpus={args.gpus}: pass --micro-batch N (sequences per GPU per micro-batch) or a multiple of {dp}."
        )
    micro = -(-tc.micro_batch_size // dp) * dp
    flags = [f"train.micro_batch_size={micro}", f"train.global_batch_size={-(-tc.global_batch_size // micro) * micro}"]
    print(
        f"note: {args.spec}'s micro-batch of {tc.micro_batch_size} sequences does not divide over {dp} data-parallel "
        f"ranks: planned with --{flags[0]} --{flags[1]} ({micro // dp} per GPU per micro-batch; --micro-batch N "
        "sets another).",
        file=sys.stderr,
    )
    return resolve_config(args.spec, overrides + flags), given + [f"--{f}" for f in flags]


def cmd_plan(argv: list[str]) -> int:
    args, overrides = split_overrides(_plan_parser(), argv)
    cfg, given = _plan_config(args, overrides)
    from moetrain import rehearse
    from moetrain.plan import (
        PEAK_ERROR,
        fewest_gpus,
        layouts_text,
        legend_lines,
        more_gpus_json,
        more_gpus_text,
        plan,
        report,
        suggest,
        to_json,
    )

    gpu = args.gpu.lower()
    result = plan(cfg, args.gpus, gpu)
    suggestions = [] if args.no_suggest else suggest(cfg, args.gpus, gpu)
    command = rehearse.command(args.spec, args.gpus, result.busiest_rank, given)
    pasted = [_suggestion_flags(cfg, s, given) for s in suggestions]
    commands = [rehearse.command(args.spec, args.gpus, s.busiest_rank, f) for s, f in zip(suggestions, pasted)]
    roomy = [i for i, s in enumerate(suggestions) if not s.tight]
    shown, more = [result] + suggestions, None
    if not suggestions and not args.no_suggest:  # nothing fits: the answer is a GPU count, said first
        more = fewest_gpus(cfg, args.gpus, gpu)
        more_flags = _more_gpus_flags(args.spec, cfg, more, given)
        shown += [more.plan] if more.plan else []
        print("\n".join(more_gpus_text(more, args.gpus, gpu, *more_flags)) + "\n\nthe layout as given:")
    elif roomy and (not result.fits or result.tight):  # lead with what to run instead
        i = roomy[0]
        print(
            f"recommended: {suggestions[i].layout.describe()}, {_fit_words(suggestions[i])}; the layout as given "
            f"{_fit_words(result)}\n  flags: {' '.join(pasted[i])}\n  rehearse one rank: {commands[i]}\n"
        )
        print("the layout as given:")
    print(report(result))
    if result.tight:
        print(f"  -> TIGHT: within the memory model's {PEAK_ERROR:.0%} error of the {result.gpu.memory_gib:g} GiB")
    if suggestions:
        print("\n".join(layouts_text(suggestions, pasted, commands)))
    print(
        "measure one rank of this layout on one GPU (its compute, memory and checkpoint shard; communication "
        f"modelled):\n  {command}"
    )
    if suggestions:
        print(f"the same for the recommended layout:\n  {commands[roomy[0] if roomy else 0]}")
    print("\n".join(legend_lines([p.layout.describe() for p in shown])))
    out = to_json(result, args.spec, args.gpus, gpu, suggestions)
    out["busiest_rank"] = result.busiest_rank
    out["rehearse_command"] = command
    for entry, flags, cmd in zip(out["suggested"], pasted, commands):
        entry["flags"], entry["rehearse_command"] = flags, cmd
    out["fewest_gpus"] = None if more is None else more_gpus_json(more, *more_flags)
    print(json.dumps(out))
    return 0


def _more_gpus_flags(spec: str, cfg: RunConfig, more, given: list[str]) -> tuple[list[str], str]:
    """The flags of `fewest_gpus`'s layout and the command that rehearses it (none found: empty)."""
    from moetrain import rehearse

    if more.plan is None:
        return [], ""
    flags = _suggestion_flags(cfg, more.plan, given)
    return flags, rehearse.command(spec, more.gpus, more.plan.busiest_rank, flags)


def _suggestion_flags(cfg: RunConfig, suggestion, given: list[str]) -> list[str]:
    """The command line's flags with a suggested layout's in place of the ones it changes."""
    from moetrain.memory_advice import layout_flags

    changed = layout_flags(cfg, suggestion.layout)
    keys = {f.split("=")[0] for f in changed}
    return [g for g in given if g.split("=")[0] not in keys] + changed


def _fit_words(p) -> str:
    """ "peak 101.5 of 139 GiB" with "does NOT fit" or "TIGHT" where it applies."""
    from moetrain.plan import PEAK_ERROR

    words = f"peak {p.largest_peak_gib:.1f} of {p.gpu.memory_gib:g} GiB"
    if not p.fits:
        return words + ": does NOT fit"
    return words + (f": TIGHT (within the memory model's {PEAK_ERROR:.0%})" if p.tight else "")
