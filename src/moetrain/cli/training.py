"""`moetrain train`, `moetrain bench` and `moetrain check-layout`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moetrain import layout_check, rehearse
from moetrain.bench import run_bench
from moetrain.cli.args import (
    check_rehearsal_flags,
    command_parser,
    config_parser,
    rehearsal_flags,
    resolve_args,
    split_overrides,
)
from moetrain.errors import ConfigError
from moetrain.memory_advice import advice
from moetrain.parallel.distributed import shutdown
from moetrain.parallel.rehearsal import is_rehearsal
from moetrain.plan import device_capacity_floor, plan_gpu
from moetrain.presets import resolve_config, run_name
from moetrain.train.oom import OutOfMemory
from moetrain.train.runtime import cpu_threads, resolve_device
from moetrain.train.trainer import Trainer


def cmd_train(argv: list[str]) -> int:
    parser = config_parser("train", "Train a model.", train_flags=True)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in the run directory (without --run-dir: the "
        "newest of runs/NAME, runs/NAME-2, … that holds a run)",
    )
    parser.add_argument("--quiet", action="store_true", help="no start-up header, no progress output")
    rehearsal_flags(parser, "train the steps (default --steps 4), then save and load back this rank's checkpoint")
    parser.epilog += (
        " Every key with its type, default and meaning: moetrain config --help. A mistake in the command or "
        "the config prints one paragraph and exits 2; add --debug for the traceback."
    )
    args, overrides = split_overrides(parser, argv)
    check_rehearsal_flags(args)
    rehearsal = None
    if args.rehearse is not None:
        args.steps = 4 if args.steps is None else args.steps
        overrides.append("checkpoint.save_final=false")  # the rehearsal saves and loads back itself
        rehearsal = rehearse.resolve(resolve_args(args, overrides), args.rehearse, args.rank)
    cfg = resolve_args(args, overrides)
    if rehearsal is None:
        _fit_cpu_threads(cfg, args.quiet)

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


def _fit_cpu_threads(cfg, quiet: bool) -> None:
    """One process on the CPU with no OMP_NUM_THREADS: as many intra-op threads as cores other
    processes leave idle (`cpu_threads`), said when fewer than torch's default."""
    launched = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")  # several ranks: their launcher's threads
    if "OMP_NUM_THREADS" in os.environ or any(os.environ.get(v, "1") != "1" for v in launched):
        return
    if resolve_device(cfg.train.device).type != "cpu":
        return
    threads, cores, busy = cpu_threads()
    if threads < torch.get_num_threads():
        torch.set_num_threads(threads)
        if not quiet:
            print(
                f"note: {threads} intra-op CPU thread{'s' * (threads > 1)}: other processes keep about {busy:.1f} of "
                f"the {cores} cores this run may use busy, and threads beyond the idle cores wait on each other "
                f"(OMP_NUM_THREADS=N sets the count).",
                file=sys.stderr,
            )


def cmd_bench(argv: list[str]) -> int:
    parser = command_parser(
        "bench",
        "Warm up, then time training steps of a preset on random token ids; one JSON line "
        "per routing mode with tokens_per_sec_per_device, tflops_per_device, mfu, peak_mem_gib, "
        "sync_free and the exact shape, batch, routing and precision.",
        epilog="Any config key can be set with --section.key=value, e.g. --compute.compile=true "
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
    parser.add_argument("--device", help="sets train.device (default: auto)")
    parser.add_argument("--run-dir", help="where the trainer may write (default: a temporary directory)")
    rehearsal_flags(
        parser,
        "its step time without the stand-ins, device time by kernel kind, peak memory while training, saving and "
        "loading its checkpoint shard, and tokens/s projected with the planner's communication model",
    )
    parser.add_argument(
        "--no-checkpoint", action="store_true", help="with --rehearse: skip saving and loading the rank's checkpoint"
    )
    args, overrides = split_overrides(parser, argv)
    check_rehearsal_flags(args)
    if args.no_checkpoint and args.rehearse is None:
        raise ConfigError("--no-checkpoint skips a rehearsal's checkpoint: add --rehearse N (plain bench saves none).")
    if args.also_optimizer_step and args.forward_backward_only:
        raise ConfigError("--also-optimizer-step times a part of the training step: drop --forward-backward-only.")
    if args.warmup < 0 or args.steps <= 0:
        raise ConfigError(f"--warmup={args.warmup} must be ≥ 0 and --steps={args.steps} positive.")
    if args.device is not None:
        overrides.append(f"train.device={args.device}")

    as_given = ("warmup", "steps", "run_dir", "forward_backward_only", "also_forward_backward", "also_optimizer_step")
    records = run_bench(
        args.spec,
        overrides,
        routings=[r.strip() for r in args.routing.split(",") if r.strip()],
        sync_check=not args.no_sync_check,
        checkpoint=not args.no_checkpoint,
        **{key: getattr(args, key) for key in (*as_given, "rehearse", "rank")},
    )
    if not dist.is_initialized() or dist.get_rank() == 0 or is_rehearsal():  # a rehearsal's one process reports
        for record in records:
            print(json.dumps(record), flush=True)
    shutdown()
    return 0


def cmd_check_layout(argv: list[str]) -> int:
    parser = command_parser(
        "check-layout",
        "Train the first steps of a run in its parallel layout and in a reference (one process, or "
        "the FSDP stack for a model one device cannot hold), and compare them "
        "step by step: the loss, the gradient norm, each parameter group's gradient norm (embeddings, attention, "
        "norms, dense MLP, router, routed experts, shared experts, head, MTP) and the drops. Exits 1 naming what "
        "differs beyond the precision's tolerance. Launch it as the run: torchrun --nproc-per-node=4 -m moetrain "
        "check-layout tiny --parallel.ep=2 --device cpu.",
        epilog="Any config key can be set with --section.key=value. The reference runs after the layout: one "
        "process on rank 0's device, or for a model one device cannot hold the FSDP stack over the launch's ranks "
        "(--reference).",
    )
    parser.add_argument("spec", metavar="PRESET_OR_YAML", help="a preset name (moetrain presets) or a YAML run file")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps to compare (default 5)")
    parser.add_argument("--seed", type=int, help="sets train.seed")
    parser.add_argument("--device", help="sets train.device")
    parser.add_argument(
        "--rtol",
        type=float,
        nargs=2,
        metavar=("LOSS", "GRAD"),
        help="the largest relative differences allowed for the loss and for the gradient norms at every step "
        "(default by precision, tighter at the first step, whose parameters both runs share: fp32 1e-6 1e-4, "
        "then 1e-4 1e-1; bf16 1e-3 1e-2, then 1e-2 1e-1; fp8 2e-3 2e-2, then 2e-2 2e-1)",
    )
    parser.add_argument(
        "--reference",
        choices=("auto", "one", "fsdp"),
        default="auto",
        help="what the layout is compared with: one process on rank 0's device (one), the FSDP stack over the "
        "launch's ranks and no other parallelism, for a model one device cannot hold (fsdp), or one where the "
        "planner's modelled peak of one process fits the device, else fsdp (auto, the default)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line instead of a table")
    parser.add_argument("--reference-out", help=argparse.SUPPRESS)  # the reference's child process
    args, overrides = split_overrides(parser, argv)
    if not 1 <= args.steps <= 1000:
        raise ConfigError(f"--steps={args.steps}: compare between 1 and 1000 steps (a few are the point).")
    if args.rtol is not None and not all(r > 0 for r in args.rtol):
        raise ConfigError(f"--rtol {args.rtol[0]} {args.rtol[1]}: tolerances must be positive.")
    overrides += [f"train.{k}={v}" for k, v in (("seed", args.seed), ("device", args.device)) if v is not None]
    cfg = resolve_config(args.spec, overrides)
    if args.reference_out is not None:
        Path(args.reference_out).write_text(json.dumps(layout_check.run_steps(cfg)))  # `run_reference`'s child
        return 0
    result = layout_check.check_layout(cfg, args.steps, tuple(args.rtol) if args.rtol else None, args.reference)
    if result is None:  # not rank 0
        return 0
    print(json.dumps(layout_check.plain(result)) if args.json else layout_check.describe(result), flush=True)
    return 0 if result["ok"] else 1
