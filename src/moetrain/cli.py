"""The `moetrain` command line.

Every subcommand that ends with a result prints it as one JSON line on stdout; progress and notes
go to stderr. User mistakes (`MoetrainError`) print one paragraph and exit 2 without a traceback,
unless --debug is given.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import signal
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from moetrain import __version__, rehearse
from moetrain.bench import run_bench
from moetrain.config import keys_reference
from moetrain.data.prepare import main as prepare_main
from moetrain.destinations import check_file, check_overwrite
from moetrain.errors import ConfigError, MoetrainError
from moetrain.generation import generate
from moetrain.hf import export_hf, export_replaces, import_hf, import_replaces
from moetrain.inference import load_for_inference, text_loss, token_loss
from moetrain.memory_advice import advice, layout_flags
from moetrain.model.counting import count_params, flops_per_token
from moetrain.parallel.distributed import shutdown, unresponsive_ranks
from moetrain.parallel.rehearsal import is_rehearsal
from moetrain.plan import (
    MAX_GPUS,
    PEAK_ERROR,
    device_capacity_floor,
    fewest_gpus,
    layout_legend,
    layouts_text,
    legend_lines,
    more_gpus_json,
    more_gpus_text,
    plan,
    plan_gpu,
    report,
    suggest,
    to_json,
)
from moetrain.presets import PRESETS, PURPOSES, resolve_config, run_name
from moetrain.train.config import RunConfig
from moetrain.train.oom import OutOfMemory
from moetrain.train.plot import is_image_name, plot_compare
from moetrain.train.trainer import Trainer

SUBCOMMANDS: dict[str, str] = {
    "train": "train a model from a preset or YAML file (+ --key=value overrides)",
    "config": "print the resolved config of a preset or YAML file as YAML",
    "params": "print total/active parameters and FLOPs per token of a preset as JSON",
    "prepare-data": "tokenize text/JSONL files (or the embedded corpus) into a token directory",
    "eval": "loss and perplexity of a checkpoint on raw text files",
    "generate": "sample text from a checkpoint",
    "presets": "list the shipped presets: parameters, sequence length and what each is for",
    "plot": "draw the loss curves of one or more run directories into one PNG",
    "bench": "time training steps of a preset (tokens/s, TFLOP/s, MFU, memory, host syncs) as JSON lines",
    "export-hf": "write a checkpoint as a Hugging Face model directory (safetensors, config, tokenizer)",
    "import-hf": "turn a Hugging Face Qwen3-MoE or GLM-4-MoE directory into a moetrain checkpoint (--train.init_from)",
    "plan": "predict per-GPU memory, communication, step time and MFU of a preset on N GPUs; suggest layouts",
}

# Everyday flags of `train`, and the config keys they set.
TRAIN_FLAGS = {
    "--steps": ("train.steps", int),
    "--seed": ("train.seed", int),
    "--run-dir": ("train.run_dir", str),
    "--save-every": ("train.save_every", int),
    "--eval-every": ("train.eval_every", int),
    "--device": ("train.device", str),
}
TRAIN_FLAG_HELP = {
    "--run-dir": "sets train.run_dir; default runs/NAME, NAME the preset's or the YAML file's, or when that holds an "
    "earlier run the next number: runs/NAME-2, runs/NAME-3, … (printed at start-up)",
}


def main(argv: list[str] | None = None) -> int:
    # Expandable segments: the CUDA caching allocator grows segments instead of keeping many
    # fixed-size ones, so varying expert-batch shapes fragment less (read at the first CUDA
    # allocation; a user's own setting wins).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("--version", "-V", "version"):
        print(f"moetrain {__version__} (torch {torch.__version__})")
        return 0
    command, rest = argv[0], argv[1:]
    handler = _HANDLERS.get(command)
    if handler is None:
        close = difflib.get_close_matches(command, list(_HANDLERS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        print(f"moetrain: unknown command '{command}'.{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        return handler(rest) or 0
    except MoetrainError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug or not _lost_a_peer(e):
            raise
        rank = os.environ.get("RANK", "0")
        # A few seconds watching whose heartbeat stopped. The launcher may already be sending
        # SIGTERM to the survivors (torchrun does once a worker died): we are exiting anyway.
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            gone = unresponsive_ranks()
        finally:
            signal.signal(signal.SIGTERM, previous)
        who = (
            f"rank {gone[0]} is gone"
            if gone and len(gone) == 1
            else f"ranks {', '.join(map(str, gone))} are gone"
            if gone
            else "another rank is gone"
        )
        print(
            f"error: rank {rank}: a collective failed because {who} ({_first_line(e)}). "
            + ("" if gone else "The launcher's log names the rank that failed first. ")
            + "Completed checkpoints are intact: continue with --resume (under torchrun, "
            "--max-restarts=N with --resume restarts and resumes by itself).",
            file=sys.stderr,
        )
        return 1


_LOST_PEER = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
    "Socket Timeout",
)


def _lost_a_peer(e: BaseException) -> bool:
    """A communication error that means another rank died (gloo/NCCL wording)."""
    text = str(e)
    return isinstance(e, dist.DistNetworkError) or any(s in text for s in _LOST_PEER)


def _first_line(e: BaseException) -> str:
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return line[:300]


def _usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: moetrain COMMAND [ARGS] [--debug]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", "Run 'moetrain COMMAND --help' for a command's arguments."]
    return "\n".join(lines)


def _split_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Known flags go to argparse; `--section.key=value` and `--section.key value` become config
    overrides; an unknown flag is refused with the nearest known one."""
    args, unknown = parser.parse_known_args(argv)
    overrides, i = [], 0
    while i < len(unknown):
        item = unknown[i]
        if item.startswith("--") and "." in item.split("=", 1)[0]:
            if "=" not in item and i + 1 < len(unknown) and not unknown[i + 1].startswith("--"):
                item, i = f"{item}={unknown[i + 1]}", i + 1  # --optim.lr 3e-4
            overrides.append(item[2:])
        elif item.startswith("-"):
            flags = [f for action in parser._actions for f in action.option_strings]
            close = difflib.get_close_matches(item.split("=", 1)[0], flags, n=1)
            hint = f" Did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"Unknown option '{item}' for 'moetrain {parser.prog.split()[-1]}'.{hint} Config keys are set as "
                "--section.key=value or --section.key value (for example --optim.lr=1e-3); see --help."
            )
        else:
            raise ConfigError(
                f"Unexpected argument '{item}' for 'moetrain {parser.prog.split()[-1]}'. Config keys "
                "are set as --section.key=value or --section.key value (for example --optim.lr 1e-3); see --help."
            )
        i += 1
    return args, overrides


def _config_parser(prog: str, description: str, train_flags: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog=f"moetrain {prog}", description=description)
    parser.add_argument("spec", metavar="PRESET_OR_YAML", help="a preset name (moetrain presets) or a YAML run file")
    if train_flags:
        for flag, (key, tp) in TRAIN_FLAGS.items():
            parser.add_argument(flag, type=tp, help=TRAIN_FLAG_HELP.get(flag, f"sets {key}"))
        parser.add_argument(
            "--resume",
            action="store_true",
            help="continue from the newest complete checkpoint in the run directory (without --run-dir: the "
            "newest of runs/NAME, runs/NAME-2, … that holds a run)",
        )
        parser.add_argument("--quiet", action="store_true", help="no start-up header, no progress output")
        _rehearsal_flags(parser, "train the steps (default --steps 4), then save and load back this rank's checkpoint")
    parser.epilog = (
        "Any config key can be set with --section.key=value, e.g. --optim.lr=1e-3 --model.moe.routing=random."
    )
    return parser


def _rehearsal_flags(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--rehearse",
        type=int,
        metavar="N",
        default=None,
        help=f"rehearse one rank of an N-rank run alone on this device, its peers stood in for: {what}; "
        "communication is not measured (docs/architecture.md, 'Rehearsal')",
    )
    parser.add_argument(
        "--rank",
        type=int,
        default=None,
        help="with --rehearse: the rank to run (default: the one `moetrain plan` says needs most memory)",
    )


def _check_rehearsal_flags(args: argparse.Namespace) -> None:
    if args.rank is not None and args.rehearse is None:
        raise ConfigError(f"--rank={args.rank} names a rank to rehearse: add --rehearse N (the run's world size).")


def _resolve(args: argparse.Namespace, overrides: list[str]):

    flag_overrides = []
    for flag, (key, _) in TRAIN_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            flag_overrides.append(f"{key}={value}")
    return resolve_config(args.spec, overrides + flag_overrides)


def cmd_train(argv: list[str]) -> int:
    parser = _config_parser("train", "Train a model.", train_flags=True)
    parser.epilog += (
        " Every key with its type, default and meaning: moetrain config --help. A mistake in the command or "
        "the config prints one paragraph and exits 2; add --debug for the traceback."
    )
    args, overrides = _split_overrides(parser, argv)
    _check_rehearsal_flags(args)
    rehearsal = None
    if args.rehearse is not None:
        if args.steps is None:
            args.steps = 4
        overrides.append("train.save_final=false")  # the rehearsal saves and loads back itself
        rehearsal = rehearse.resolve(_resolve(args, overrides), args.rehearse, args.rank)
    cfg = _resolve(args, overrides)

    trainer = Trainer(
        cfg,
        resume=args.resume,
        quiet=args.quiet,
        name=run_name(args.spec),
        rehearsal=rehearsal,
        capacity_floor=device_capacity_floor,
    )
    try:
        summary = trainer.fit()
        if rehearsal is not None:
            summary["rehearsal"] = rehearse.train_record(trainer)
            summary["checkpoint"] = summary["rehearsal"]["checkpoint"]["checkpoint"]
    except OutOfMemory as e:
        e.advice = advice(trainer.cfg, trainer.par.dims.world_size, plan_gpu(e.device_name, e.capacity))
        raise
    finally:
        trainer.run.release()
    if trainer.par.is_main:
        print(json.dumps(summary))
    shutdown()
    return 0


def cmd_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="moetrain bench",
        description="Warm up, then time training steps of a preset on random token ids; one JSON line "
        "per routing mode with tokens_per_sec_per_device, tflops_per_device, mfu, peak_mem_gib, "
        "sync_free and the exact shape, batch, routing and precision.",
        epilog="Any config key can be set with --section.key=value, e.g. --train.compile=true "
        "--train.micro_batch_size=2.",
    )
    parser.add_argument("spec", metavar="PRESET_OR_YAML")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (and after each routing switch)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per routing mode")
    parser.add_argument("--routing", default="learned,random", help="comma-separated routing modes (default both)")
    parser.add_argument("--no-sync-check", action="store_true", help="skip the extra step that counts host syncs")
    parser.add_argument(
        "--forward-backward-only",
        action="store_true",
        help="time the micro-batches' forward and backward alone (no clipping, no optimizer step)",
    )
    parser.add_argument(
        "--also-forward-backward",
        action="store_true",
        help="after the training-step window, time forward+backward alone too (one more JSON line)",
    )
    parser.add_argument(
        "--also-optimizer-step",
        action="store_true",
        help="after the training-step window, time the optimizer's part alone too (clipping, the step guard, the "
        "update, the router bias; gradients of one forward+backward kept): one more JSON line, with its share of "
        "the training step",
    )
    parser.add_argument("--device", default=None, help="sets train.device (default: auto)")
    parser.add_argument("--run-dir", default=None, help="where the trainer may write (default: a temporary directory)")
    _rehearsal_flags(
        parser,
        "its step time without the stand-ins, device time by kernel kind, peak memory while training, saving and "
        "loading its checkpoint shard, and tokens/s projected with the planner's communication model",
    )
    parser.add_argument(
        "--no-checkpoint", action="store_true", help="with --rehearse: skip saving and loading the rank's checkpoint"
    )
    args, overrides = _split_overrides(parser, argv)
    _check_rehearsal_flags(args)
    if args.no_checkpoint and args.rehearse is None:
        raise ConfigError("--no-checkpoint skips a rehearsal's checkpoint: add --rehearse N (plain bench saves none).")
    if args.also_optimizer_step and args.forward_backward_only:
        raise ConfigError("--also-optimizer-step times a part of the training step: drop --forward-backward-only.")
    if args.warmup < 0 or args.steps <= 0:
        raise ConfigError(f"--warmup={args.warmup} must be ≥ 0 and --steps={args.steps} positive.")
    if args.device is not None:
        overrides.append(f"train.device={args.device}")

    records = run_bench(
        args.spec,
        overrides,
        warmup=args.warmup,
        steps=args.steps,
        routings=[r.strip() for r in args.routing.split(",") if r.strip()],
        sync_check=not args.no_sync_check,
        run_dir=args.run_dir,
        forward_backward_only=args.forward_backward_only,
        also_forward_backward=args.also_forward_backward,
        also_optimizer_step=args.also_optimizer_step,
        rehearse=args.rehearse,
        rank=args.rank,
        checkpoint=not args.no_checkpoint,
    )
    if not dist.is_initialized() or dist.get_rank() == 0 or is_rehearsal():  # a rehearsal's one process reports
        for record in records:
            print(json.dumps(record), flush=True)
    shutdown()
    return 0


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
            f"or, when none does, the fewest GPUs of the kind (up to {MAX_GPUS}) on which one fits. Ends with one "
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
    parser.add_argument("--gpu", default="h200", help="h100, h200, b200 or b300 (default h200)")
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
        return cfg, [f"--{o}" for o in overrides]
    if args.micro_batch <= 0:
        raise ConfigError(f"--micro-batch={args.micro_batch} must be a positive number of sequences.")
    pp = cfg.parallel.pp
    if args.gpus % pp:
        raise ConfigError(f"parallel.pp={pp} does not divide --gpus={args.gpus}.")
    dp = cfg.parallel.dp or args.gpus // pp
    cfg = resolve_config(args.spec, overrides + [f"train.micro_batch_size={args.micro_batch * dp}"])
    return cfg, [f"--{o}" for o in overrides] + [f"--train.micro_batch_size={cfg.train.micro_batch_size}"]


def cmd_plan(argv: list[str]) -> int:
    args, overrides = _split_overrides(_plan_parser(), argv)
    cfg, given = _plan_config(args, overrides)
    gpu = args.gpu.lower()
    result = plan(cfg, args.gpus, gpu)
    suggestions = [] if args.no_suggest else suggest(cfg, args.gpus, gpu)
    command = rehearse.command(args.spec, args.gpus, result.busiest_rank, given)
    pasted = [_suggestion_flags(cfg, s, given) for s in suggestions]
    commands = [rehearse.command(args.spec, args.gpus, s.busiest_rank, f) for s, f in zip(suggestions, pasted)]
    roomy = [i for i, s in enumerate(suggestions) if not s.tight]
    if roomy and (not result.fits or result.tight):  # lead with what to run instead
        i = roomy[0]
        print(
            f"recommended: {suggestions[i].layout.describe()}, {_fit_words(suggestions[i])}; the layout as given "
            f"{_fit_words(result)}\n  flags: {' '.join(pasted[i])}\n  rehearse one rank: {commands[i]}\n"
        )
        print("the layout as given:")
    print(report(result))
    if result.tight:
        print(f"  -> TIGHT: within the memory model's {PEAK_ERROR:.0%} error of the {result.gpu.memory_gib:g} GiB")
    shown = [result] + suggestions
    more = None
    if suggestions:
        print("\n".join(layouts_text(suggestions, pasted, commands)))
    elif not args.no_suggest:
        more = fewest_gpus(cfg, args.gpus, gpu)
        more_flags = _more_gpus_flags(args.spec, cfg, more, given)
        shown += [more.plan] if more.plan else []
        print("\n".join(more_gpus_text(more, args.gpus, gpu, *more_flags)))
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
    if more.plan is None:
        return [], ""
    flags = _suggestion_flags(cfg, more.plan, given)
    return flags, rehearse.command(spec, more.gpus, more.plan.busiest_rank, flags)


def _suggestion_flags(cfg: RunConfig, suggestion, given: list[str]) -> list[str]:
    """The command line's flags with a suggested layout's in place of the ones it changes."""
    changed = layout_flags(cfg, suggestion.layout)
    keys = {f.split("=")[0] for f in changed}
    return [g for g in given if g.split("=")[0] not in keys] + changed


def _fit_words(p) -> str:
    """ "peak 101.5 of 139 GiB" with "does NOT fit" or "TIGHT" where it applies."""
    words = f"peak {p.largest_peak_gib:.1f} of {p.gpu.memory_gib:g} GiB"
    if not p.fits:
        return words + ": does NOT fit"
    return words + (f": TIGHT (within the memory model's {PEAK_ERROR:.0%})" if p.tight else "")


def cmd_config(argv: list[str]) -> int:
    parser = _config_parser("config", "Print the resolved config as YAML.", train_flags=True)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    if "-h" in argv or "--help" in argv:  # the reference reads the config classes' source: for --help only
        parser.epilog += (
            "\n\nEvery config key (--key=value or --key value; the defaults are the dataclasses', "
            "presets set their own):\n" + keys_reference(RunConfig)
        )
    args, overrides = _split_overrides(parser, argv)
    print(_resolve(args, overrides).to_yaml(), end="")
    return 0


def cmd_params(argv: list[str]) -> int:
    parser = _config_parser("params", "Parameter and FLOP counts.", train_flags=False)
    args, overrides = _split_overrides(parser, argv)
    cfg = _resolve(args, overrides)

    counts = count_params(cfg.model)
    print(
        json.dumps(
            {
                "preset": args.spec,
                "total_params": counts.total,
                "active_params": counts.active,
                "flops_per_token": flops_per_token(cfg.model, cfg.data.seq_len),
                "seq_len": cfg.data.seq_len,
            }
        )
    )
    return 0


def cmd_presets(argv: list[str]) -> int:

    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="moetrain presets",
        description="The shipped presets: parameters total and active, sequence length, what each is for.",
    )
    parser.parse_args(argv)
    print(f"{'preset':<18} {'total':>10} {'active':>9} {'seq_len':>8}  purpose")
    for name, make in PRESETS.items():
        cfg = make()
        counts = count_params(cfg.model)
        print(
            f"{name:<18} {counts.total / 1e9:9.3f}B {counts.active / 1e9:8.3f}B {cfg.data.seq_len:>8}  {PURPOSES[name]}"
        )
    return 0


def cmd_prepare_data(argv: list[str]) -> int:

    return prepare_main(argv)


def cmd_eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="moetrain eval", description="Loss of a checkpoint on text or prepared tokens."
    )
    parser.add_argument("checkpoint", help="a run directory (newest checkpoint) or a step-N directory")
    parser.add_argument(
        "--text", nargs="+", metavar="FILE", help="text files (each one document) and .jsonl files (one per line)"
    )
    parser.add_argument("--text-key", default="text", help="the text field of .jsonl records (default text)")
    parser.add_argument(
        "--data",
        metavar="DIR",
        help="a prepared token directory (moetrain prepare-data's; e.g. what the run trained on)",
    )
    parser.add_argument("--split", default="val", help="with --data: the split to evaluate (default val)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if (args.text is None) == (args.data is None):
        raise ConfigError("moetrain eval needs one of --text FILE… (text, .jsonl) or --data DIR (prepared tokens).")

    model, cfg, tokenizer = load_for_inference(args.checkpoint, args.device)
    if args.data is not None:
        result = token_loss(model, cfg, tokenizer, args.data, args.split)
    else:
        result = text_loss(model, cfg, tokenizer, args.text, args.text_key)
    print(json.dumps(result))
    return 0


def cmd_generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="moetrain generate", description="Sample text from a checkpoint."
    )
    parser.add_argument("checkpoint", help="a run directory (newest checkpoint) or a step-N directory")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, help="with --temperature > 0: draw among the K most likely tokens only")
    parser.add_argument(
        "--top-p",
        type=float,
        help="with --temperature > 0: draw among the fewest most likely tokens whose probability reaches P",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--no-kv-cache", action="store_true", help="recompute the whole context for every token (slower, same tokens)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line with the text and token ids")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0 or args.temperature < 0:
        raise ConfigError("--max-new-tokens and --temperature must be ≥ 0.")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: must be ≥ 1 (leave it out to draw among every token).")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1] (leave it out to draw among every token).")

    model, cfg, tokenizer = load_for_inference(args.checkpoint, args.device)
    # Each token is predicted from at most the training sequence length of context.
    text, ids = generate(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        args.temperature,
        args.seed,
        cfg.data.seq_len,
        top_k=args.top_k,
        top_p=args.top_p,
        kv_cache=not args.no_kv_cache,
    )
    if args.json:
        print(json.dumps({"prompt": args.prompt, "completion": text, "token_ids": ids}))
    else:
        print(args.prompt + text)
    return 0


def _convert(
    argv: list[str],
    prog: str,
    description: str,
    source: str,
    source_help: str,
    convert,
    replaces: Callable[[str], list[str]],
    add_options=None,
) -> int:
    """`moetrain export-hf` / `import-hf`: SOURCE OUT_DIR (and `add_options`' flags, passed to
    `convert` by name) in, one JSON line out. Files of OUT_DIR that `replaces` names are
    replaced only with --force."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog=prog, description=description)
    parser.add_argument(source, help=source_help)
    parser.add_argument("out_dir")
    parser.add_argument("--force", action="store_true", help="replace what an earlier run wrote into OUT_DIR")
    if add_options is not None:
        add_options(parser)
    args = parser.parse_args(argv)
    # Under torchrun only rank 0 looks: the other ranks would see its files appear.
    if not args.force and os.environ.get("RANK", "0") == "0":
        check_overwrite(args.out_dir, replaces(args.out_dir), "OUT_DIR", prog)
    options = {k: v for k, v in vars(args).items() if k not in (source, "out_dir", "force")}
    print(json.dumps(convert(getattr(args, source), args.out_dir, **options)))
    return 0


def cmd_export_hf(argv: list[str]) -> int:
    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dtype", default="bfloat16", help="weight dtype: bfloat16 (default) or float32")
        parser.add_argument(
            "--max-shard-size", default="5GB", help="shard the weights past this size (5GB, 500MiB, bytes)"
        )
        parser.add_argument(
            "--max-position-embeddings", type=int, default=None, help="default: the trained data.seq_len"
        )
        parser.add_argument(
            "--remote-code",
            action="store_true",
            help="write moetrain's own modeling file beside the weights (any model: load it with "
            "trust_remote_code=True) instead of a native transformers class",
        )
        parser.add_argument(
            "--license",
            dest="license_id",
            default="other",
            help="the model card's Hub license id (apache-2.0, mit, cc-by-4.0, …; default other: none chosen)",
        )

    # Under torchrun each rank writes every WORLD_SIZE-th shard (no process group is needed).
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return _convert(
        argv,
        "moetrain export-hf",
        "Write a checkpoint as a directory that transformers loads offline with a native architecture "
        "(Qwen3-MoE for softmax gating, GLM-4-MoE for sigmoid gating): safetensors weights (sharded with an "
        "index past --max-shard-size), config.json, tokenizer files, and a model card (README.md: the Hub's metadata, "
        "the model's shape, parameters, tokens, data and validation loss). Models that no native class represents "
        "exactly are refused, naming the feature and the variant that exports.",
        "checkpoint",
        "a run directory (newest checkpoint) or a step-N directory",
        lambda checkpoint, out_dir, **kw: export_hf(checkpoint, out_dir, rank=rank, world_size=world, **kw),
        export_replaces,
        options,
    )


def cmd_import_hf(argv: list[str]) -> int:

    return _convert(
        argv,
        "moetrain import-hf",
        "Read a Hugging Face Qwen3-MoE or GLM-4-MoE directory (config.json, safetensors, tokenizer.json) into "
        "OUT_DIR: "
        "config.yaml, tokenizer.json and a weights-only checkpoint. Continue training it with `moetrain "
        "train OUT_DIR/config.yaml --train.init_from=OUT_DIR --data.sources=… --run-dir NEW`.",
        "hf_dir",
        "a Hugging Face model directory",
        import_hf,
        import_replaces,
    )


def cmd_plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="moetrain plot", description="Compare the loss curves of runs."
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", default=None, help="the PNG to write (default: FIRST_RUN_DIR/loss-compare.png)")
    parser.add_argument("--force", action="store_true", help="replace --out even when it is not an image")
    args = parser.parse_args(argv)

    for run_dir in args.run_dirs:
        if not (Path(run_dir) / "metrics.jsonl").is_file():
            raise ConfigError(f"'{run_dir}' has no metrics.jsonl: pass run directories written by moetrain train.")
    out = args.out or Path(args.run_dirs[0]) / "loss-compare.png"
    check_file(
        out,
        "The plot",
        "Pass --out a PNG file name you can write",
        replaceable=is_image_name,
        kind="an image",
        force=args.force,
    )
    print(json.dumps({"plot": str(plot_compare(args.run_dirs, out))}))
    return 0


_HANDLERS: dict[str, Callable[[list[str]], int]] = {
    "plot": cmd_plot,
    "train": cmd_train,
    "config": cmd_config,
    "params": cmd_params,
    "prepare-data": cmd_prepare_data,
    "eval": cmd_eval,
    "generate": cmd_generate,
    "presets": cmd_presets,
    "bench": cmd_bench,
    "export-hf": cmd_export_hf,
    "import-hf": cmd_import_hf,
    "plan": cmd_plan,
}
