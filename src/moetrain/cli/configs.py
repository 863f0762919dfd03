"""`moetrain config`, `params`, `presets` and `prepare-data`: the first three load no torch."""

from __future__ import annotations

import argparse
import json

from moetrain.cli.args import command_parser, config_parser, resolve_args, split_overrides
from moetrain.config import keys_reference
from moetrain.model.counting import count_params, flops_per_token
from moetrain.presets import PRESETS, PURPOSES
from moetrain.train.config import RunConfig


def cmd_config(argv: list[str]) -> int:
    parser = config_parser("config", "Print the resolved config as YAML.", train_flags=True)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    if "-h" in argv or "--help" in argv:  # the reference reads the config classes' source: for --help only
        parser.epilog += (
            "\n\nEvery config key (--key=value or --key value; the defaults are the dataclasses', "
            "presets set their own):\n" + keys_reference(RunConfig)
        )
    args, overrides = split_overrides(parser, argv)
    print(resolve_args(args, overrides).to_yaml(), end="")
    return 0


def cmd_params(argv: list[str]) -> int:
    parser = config_parser("params", "Parameter and FLOP counts.", train_flags=False)
    args, overrides = split_overrides(parser, argv)
    cfg = resolve_args(args, overrides)
    counts, seq_len = count_params(cfg.model), cfg.data.seq_len
    flops = flops_per_token(cfg.model, seq_len)
    record = dict(
        preset=args.spec, total_params=counts.total, active_params=counts.active, flops_per_token=flops, seq_len=seq_len
    )
    print(json.dumps(record))
    return 0


def cmd_presets(argv: list[str]) -> int:
    command_parser(
        "presets", "The shipped presets: parameters total and active, sequence length, what each is for."
    ).parse_args(argv)
    width = max(map(len, PRESETS))
    print(f"{'preset':<{width}} {'total':>9} {'active':>9} {'seq_len':>8}  purpose")
    for name, make in PRESETS.items():
        cfg = make()
        counts = count_params(cfg.model)
        # 12.912B, 1.587B, 3.70M: billions from a billion up, else millions
        total, active = (f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" for n in (counts.total, counts.active))
        print(f"{name:<{width}} {total:>9} {active:>9} {cfg.data.seq_len:>8}  {PURPOSES[name]}")
    return 0


def cmd_prepare_data(argv: list[str]) -> int:
    from moetrain.data.prepare import main as prepare_main

    return prepare_main(argv)
