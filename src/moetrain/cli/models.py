"""`moetrain eval`, `generate`, `export-hf`, `import-hf` and `plot`: what reads a checkpoint or
a run."""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path

from moetrain.cli.args import command_parser, split_overrides
from moetrain.data.tokens import open_source
from moetrain.destinations import check_file, check_overwrite
from moetrain.errors import ConfigError, DataError
from moetrain.generation import generate
from moetrain.hf import export_hf, export_replaces, import_hf, import_replaces
from moetrain.inference import load_for_inference, text_loss, token_loss
from moetrain.parallel.distributed import from_rank_0, init_distributed, refuse_unless_alike, shutdown
from moetrain.train.metrics import read_metrics
from moetrain.train.plot import is_image_name, plot_compare


def cmd_eval(argv: list[str]) -> int:
    parser = command_parser("eval", "Loss of a checkpoint on text or prepared tokens.")
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
    parser.add_argument(
        "--tokens",
        metavar="N|all",
        help="with --data: evaluate the first N tokens in whole windows of data.seq_len (default: the checkpoint's "
        "train.eval_tokens, what the run's val_loss read), or all of the split",
    )
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if (args.text is None) == (args.data is None):
        raise ConfigError("moetrain eval needs one of --text FILE… (text, .jsonl) or --data DIR (prepared tokens).")
    if args.tokens is not None and args.data is None:
        raise ConfigError("--tokens counts the tokens of --data DIR; --text files are evaluated whole.")
    if args.tokens not in (None, "all") and not (args.tokens.isdigit() and int(args.tokens) > 0):
        raise ConfigError(f"--tokens {args.tokens}: give a positive number of tokens, or all.")

    model, cfg, tokenizer = load_for_inference(args.checkpoint, args.device)
    if args.data is not None:
        tokens = cfg.train.eval_tokens if args.tokens is None else None if args.tokens == "all" else int(args.tokens)
        result = token_loss(model, cfg, tokenizer, args.data, args.split, tokens)
        source = open_source(args.data, args.split)  # a .bin file names its split itself
        why = "" if args.tokens else " (train.eval_tokens, what the run's val_loss read; --tokens all for every one)"
        print(
            f"eval: {result['tokens']:,} of the {source.num_tokens - 1:,} tokens of {source.split}{why}",
            file=sys.stderr,
        )
    else:
        result = text_loss(model, cfg, tokenizer, args.text, args.text_key)
    if not math.isfinite(result["loss"]):
        raise DataError(
            f"the loss is {result['loss']} over {result['tokens']:,} tokens: the checkpoint's outputs are not finite "
            "(weights with NaN or infinite values, or activations that overflow)."
        )
    print(json.dumps(result))
    return 0


def cmd_generate(argv: list[str]) -> int:
    parser = command_parser("generate", "Sample text from a checkpoint.")
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
    if 0 < args.temperature < 1e-3 or not math.isfinite(args.temperature):
        raise ConfigError(
            f"--temperature {args.temperature}: logits divided by it overflow; give 0 (greedy) or at least 0.001."
        )
    if not 0 <= args.seed < 2**63:
        raise ConfigError(f"--seed {args.seed}: give a number from 0 to 2**63 - 1.")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the terminal passed that are not UTF-8
        raise ConfigError("--prompt is not UTF-8 text: pass it in UTF-8 (e.g. from a UTF-8 terminal).") from None
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: must be ≥ 1 (leave it out to draw among every token).")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p {args.top_p}: must be in (0, 1] (leave it out to draw among every token).")
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        print(
            "note: --top-k and --top-p choose among tokens drawn at random: with --temperature 0 (the default) "
            "generation is greedy and they do nothing; add --temperature 0.8, say.",
            file=sys.stderr,
        )
        args.top_k = args.top_p = None

    model, cfg, tokenizer = load_for_inference(args.checkpoint, args.device)
    # Each token is predicted from at most the training sequence length of context.
    options = dict(top_k=args.top_k, top_p=args.top_p, kv_cache=not args.no_kv_cache)
    text, ids = generate(
        model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.seed, cfg.data.seq_len, **options
    )
    if args.json:
        print(json.dumps({"prompt": args.prompt, "completion": text, "token_ids": ids}))
    else:
        print(args.prompt + text)
    return 0


def _convert_parser(prog: str, description: str, source: str, source_help: str) -> argparse.ArgumentParser:
    """The parser of `moetrain export-hf` / `import-hf`: SOURCE OUT_DIR [--force]."""
    parser = command_parser(prog, description)
    parser.add_argument(source, help=source_help)
    parser.add_argument("out_dir")
    parser.add_argument("--force", action="store_true", help="replace what an earlier run wrote into OUT_DIR")
    return parser


def _convert(parser: argparse.ArgumentParser, argv: list[str], source: str, convert, replaces) -> int:
    """`_convert_parser`'s command (and its flags beyond those, passed to `convert` by name): one
    JSON line out. Files of OUT_DIR that `replaces` names are replaced only with --force."""
    args = parser.parse_args(argv)
    refuse_unless_alike(vars(args))  # ranks of an export-hf under torchrun (each writes part of OUT_DIR)
    # Rank 0's view of OUT_DIR decides for every rank (another could already see its new files).
    if replaced := from_rank_0(None if args.force else replaces(args.out_dir)):
        check_overwrite(args.out_dir, replaced, "OUT_DIR", parser.prog)
    options = {k: v for k, v in vars(args).items() if k not in (source, "out_dir", "force")}
    print(json.dumps(convert(getattr(args, source), args.out_dir, **options)))
    return 0


def cmd_export_hf(argv: list[str]) -> int:
    parser = _convert_parser(
        "export-hf",
        "Write a checkpoint as a directory that transformers loads offline with a native architecture "
        "(Qwen3-MoE for softmax gating, GLM-4-MoE for sigmoid gating, DeepSeek-V3 for multi-head latent attention): "
        "safetensors weights (sharded with an index past --max-shard-size), config.json, tokenizer files, and a "
        "model card (README.md: the Hub's metadata, the model's shape, parameters, tokens, data and validation "
        "loss). Models that no native class represents exactly are refused, naming the feature and the variant "
        "that exports.",
        "checkpoint",
        "a run directory (newest checkpoint) or a step-N directory",
    )
    parser.add_argument("--dtype", default="bfloat16", help="weight dtype: bfloat16 (default) or float32")
    parser.add_argument("--max-shard-size", default="5GB", help="shard the weights past this size (5GB, 500MiB, bytes)")
    parser.add_argument("--max-position-embeddings", type=int, help="default: the trained data.seq_len")
    parser.add_argument(
        "--remote-code",
        action="store_true",
        help="write moetrain's own modeling file beside the weights (any grouped-query-attention model: load "
        "it with trust_remote_code=True) instead of a native transformers class",
    )
    parser.add_argument(
        "--license",
        dest="license_id",
        default="other",
        help="the model card's Hub license id (apache-2.0, mit, cc-by-4.0, …; default other: none chosen)",
    )
    # Under torchrun each rank writes every WORLD_SIZE-th shard; the ranks meet on a CPU group.
    rank, world = init_distributed("cpu")
    try:
        return _convert(parser, argv, "checkpoint", partial(export_hf, rank=rank, world_size=world), export_replaces)
    finally:
        shutdown()


def cmd_import_hf(argv: list[str]) -> int:
    parser = _convert_parser(
        "import-hf",
        "Read a Hugging Face Qwen3-MoE, GLM-4-MoE or DeepSeek-V3 directory (config.json, safetensors, "
        "tokenizer.json) into OUT_DIR: config.yaml, tokenizer.json and a weights-only checkpoint. Continue training "
        "it with `moetrain train OUT_DIR/config.yaml --data.sources=… --run-dir NEW` (the config's "
        "checkpoint.init_from is OUT_DIR).",
        "hf_dir",
        "a Hugging Face model directory",
    )
    return _convert(parser, argv, "hf_dir", import_hf, import_replaces)


def cmd_upcycle(argv: list[str]) -> int:
    from moetrain.upcycle import upcycle

    parser = command_parser(
        "upcycle",
        "Turn a dense checkpoint into a mixture-of-experts one whose first step computes the dense "
        "model's function: every expert (and the shared expert) a copy of its block's MLP, the down projections "
        "scaled so the block's output is the MLP's, a fresh router. The MoE blocks are given as overrides of the "
        "dense run's config, e.g. --model.num_dense_layers=1 --model.moe.num_experts=8 --model.moe.top_k=2 "
        "--model.moe.expert_hidden=H (H: the dense MLP's hidden size). OUT_DIR gets config.yaml, the tokenizer and "
        "checkpoints/step-0: train it with `moetrain train OUT_DIR/config.yaml --run-dir NEW` (the config's "
        "checkpoint.init_from is OUT_DIR).",
    )
    parser.add_argument("dense", help="a dense run directory (newest checkpoint) or a step-N directory")
    parser.add_argument("out_dir")
    parser.add_argument(
        "--force", action="store_true", help="replace the config.yaml and tokenizer.json already in OUT_DIR"
    )
    args, overrides = split_overrides(parser, argv)
    if not args.force:
        check_overwrite(args.out_dir, import_replaces(args.out_dir), "OUT_DIR", parser.prog)
    print(json.dumps(upcycle(args.dense, args.out_dir, overrides)))
    return 0


def cmd_plot(argv: list[str]) -> int:
    parser = command_parser("plot", "Compare the loss curves of runs.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", help="the PNG to write (default: FIRST_RUN_DIR/loss-compare.png)")
    parser.add_argument("--force", action="store_true", help="replace --out even when it is not an image")
    args = parser.parse_args(argv)

    for run_dir in args.run_dirs:
        if not (Path(run_dir) / "metrics.jsonl").is_file():
            raise ConfigError(f"'{run_dir}' has no metrics.jsonl: pass run directories written by moetrain train.")
        if not read_metrics(Path(run_dir) / "metrics.jsonl"):
            raise ConfigError(f"'{run_dir}/metrics.jsonl' holds no step yet: plot the run once it has logged one.")
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
