"""What the config-taking subcommands share: the everyday flags of `train`, `--section.key=value`
overrides beside argparse's flags, the rehearsal flags."""

from __future__ import annotations

import argparse
import difflib

from moetrain.errors import ConfigError

# Everyday flags of `train`, and the config keys they set.
TRAIN_FLAGS = {
    "--steps": ("train.steps", int),
    "--seed": ("train.seed", int),
    "--run-dir": ("train.run_dir", str),
    "--save-every": ("checkpoint.save_every", int),
    "--eval-every": ("train.eval_every", int),
    "--device": ("train.device", str),
}
TRAIN_FLAG_HELP = {
    "--run-dir": "sets train.run_dir; default runs/NAME, NAME the preset's or the YAML file's, or when that holds an "
    "earlier run the next number: runs/NAME-2, runs/NAME-3, … (printed at start-up)",
}


def split_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
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
                f"Unknown option '{item}' for '{parser.prog}'.{hint} Config keys are set as "
                "--section.key=value or --section.key value (for example --optim.lr=1e-3); see --help."
            )
        else:
            raise ConfigError(
                f"Unexpected argument '{item}' for '{parser.prog}'. Config keys are set as --section.key=value "
                "or --section.key value (for example --optim.lr 1e-3); see --help."
            )
        i += 1
    return args, overrides


def command_parser(prog: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """The parser of `moetrain PROG`: no abbreviated flags (a prefix could later name a new one)."""
    return argparse.ArgumentParser(allow_abbrev=False, prog=f"moetrain {prog}", description=description, **kwargs)


def config_parser(prog: str, description: str, train_flags: bool) -> argparse.ArgumentParser:
    """PRESET_OR_YAML, and with `train_flags` the everyday flags that set config keys (`TRAIN_FLAGS`)."""
    parser = command_parser(
        prog,
        description,
        epilog="Any config key can be set with --section.key=value, e.g. --optim.lr=1e-3 --model.moe.routing=random.",
    )
    parser.add_argument("spec", metavar="PRESET_OR_YAML", help="a preset name (moetrain presets) or a YAML run file")
    for flag, (key, tp) in TRAIN_FLAGS.items() if train_flags else ():
        parser.add_argument(flag, type=tp, help=TRAIN_FLAG_HELP.get(flag, f"sets {key}"))
    return parser


def rehearsal_flags(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--rehearse",
        type=int,
        metavar="N",
        help=f"rehearse one rank of an N-rank run alone on this device, its peers stood in for: {what}; "
        "communication is not measured (docs/architecture.md, 'Rehearsal')",
    )
    parser.add_argument(
        "--rank",
        type=int,
        help="with --rehearse: the rank to run (default: the one `moetrain plan` says needs most memory)",
    )


def check_rehearsal_flags(args: argparse.Namespace) -> None:
    if args.rank is not None and args.rehearse is None:
        raise ConfigError(f"--rank={args.rank} names a rank to rehearse: add --rehearse N (the run's world size).")


def resolve_args(args: argparse.Namespace, overrides: list[str]):
    """The run config of `spec` with the overrides and the everyday flags set."""
    from moetrain.presets import resolve_config

    values = {key: getattr(args, flag[2:].replace("-", "_"), None) for flag, (key, _) in TRAIN_FLAGS.items()}
    return resolve_config(args.spec, overrides + [f"{key}={v}" for key, v in values.items() if v is not None])
