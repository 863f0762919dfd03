"""The `moetrain` command line: one module per group of subcommands (`MODULES`; args.py: the flags
they share), imported when its command runs, so `moetrain --help` and `--version` load no torch.

Every subcommand that ends with a result prints it as one JSON line on stdout; progress and notes
go to stderr. User mistakes (`MoetrainError`) print one paragraph and exit 2 without a traceback,
unless --debug is given.
"""

from __future__ import annotations

import difflib
import importlib
import os
import select
import signal
import sys
from importlib.metadata import version as _version

from moetrain import __version__
from moetrain.errors import MoetrainError

SUBCOMMANDS: dict[str, str] = {
    "train": "train a model from a preset or YAML file (+ --key=value overrides)",
    "config": "print the resolved config of a preset or YAML file as YAML",
    "params": "print total/active parameters and FLOPs per token of a preset as JSON",
    "prepare-data": "tokenize text/JSONL files (or the embedded corpus) into a token directory",
    "eval": "loss and perplexity of a checkpoint on text files or prepared token data",
    "generate": "sample text from a checkpoint",
    "presets": "list the shipped presets: parameters, sequence length and what each is for",
    "plot": "draw the loss curves of one or more run directories into one PNG",
    "bench": "time training steps of a preset (tokens/s, TFLOP/s, MFU, memory, host syncs) as JSON lines",
    "export-hf": "write a checkpoint as a Hugging Face model directory (safetensors, config, tokenizer)",
    "import-hf": "turn a Hugging Face Qwen3-MoE, GLM-4-MoE, DeepSeek-V3 or dense Qwen3 / Llama directory into a "
    "checkpoint (--checkpoint.init_from)",
    "plan": "predict per-GPU memory, communication, step time and MFU of a preset on N GPUs; suggest layouts",
    "check-layout": "train a run's first steps in its layout and in a reference (one process or FSDP); compare them",
    "upcycle": "turn a dense checkpoint into an MoE one that starts as the dense model (--checkpoint.init_from)",
}

MODULES = {
    **dict.fromkeys(("train", "bench", "check-layout"), "training"),
    "plan": "planning",
    **dict.fromkeys(("config", "params", "presets", "prepare-data"), "configs"),
    **dict.fromkeys(("eval", "generate", "export-hf", "import-hf", "plot", "upcycle"), "models"),
}
"""Each subcommand's module in this package, whose `cmd_NAME` (argv in, exit code out) runs it."""


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
        print(f"moetrain {__version__} (torch {_version('torch')})")
        return 0
    command, rest = argv[0], argv[1:]
    try:
        os.getcwd()
    except FileNotFoundError:  # before torch loads: it fails to, without a word on why
        print(
            "error: the current directory no longer exists (deleted or moved while this shell stood in it): cd to "
            "an existing directory and run the command again.",
            file=sys.stderr,
        )
        return 2
    if command not in MODULES:
        close = difflib.get_close_matches(command, list(SUBCOMMANDS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        print(f"moetrain: unknown command '{command}'.{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:  # a command's module imports what it needs (torch, the model): --help and --version do not
        module = importlib.import_module(f"moetrain.cli.{MODULES[command]}")
        return getattr(module, "cmd_" + command.replace("-", "_"))(rest) or 0
    except MoetrainError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        said = f": {e}" if str(e) else ""
        after = ". Continue with --resume." if said and command == "train" else ""
        print(f"interrupted{said}{after}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if debug or not _stdout_closed():
            raise
        return 0  # whoever read stdout stopped reading (`moetrain presets | head -1`): a normal end
    except Exception as e:
        failed = None if debug else _storage_failure(e, command)
        if failed is not None:
            print(f"error: {failed}", file=sys.stderr)
            return 1
        if debug or not _lost_a_peer(e):
            raise
        rank = os.environ.get("RANK", "0")
        # A few seconds watching whose heartbeat stopped. The launcher may already be sending
        # SIGTERM to the survivors (torchrun does once a worker died): we are exiting anyway.
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            from moetrain.parallel.distributed import unresponsive_ranks

            gone = unresponsive_ranks()
        finally:
            signal.signal(signal.SIGTERM, previous)
        who = f"ranks {', '.join(map(str, gone))} are gone" if gone else "another rank is gone"
        who = f"rank {gone[0]} is gone" if gone and len(gone) == 1 else who
        first = (str(e).strip() or type(e).__name__).splitlines()[0][:300]
        print(
            f"error: rank {rank}: a collective failed because {who} ({first}). "
            + ("" if gone else "The launcher's log names the rank that failed first. ")
            + "Completed checkpoints are intact: continue with --resume (under torchrun, "
            "--max-restarts=N with --resume restarts and resumes by itself).",
            file=sys.stderr,
        )
        return 1


_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
              "NCCL communicator was aborted", "Socket Timeout")  # fmt: skip


_KEPT = {
    "train": "Completed checkpoints are intact (a checkpoint appears only once whole): make room and continue "
    "with --resume.",
    "prepare-data": "The token files are written under temporary names and renamed only at the end, so an "
    "earlier output in --out is as it was.",
    "export-hf": "config.json is written last, so the directory is no model until an export completes: make "
    "room and run it again with --force.",
    "import-hf": "The checkpoint appears only once whole: make room and run it again.",
}
"""What a command that stopped on its storage leaves behind, and how to go on."""


def _storage_failure(e: BaseException, command: str) -> str | None:
    """One paragraph for a write the storage refused (`storage_reason`), with what the command
    leaves behind; None for any other error."""
    from moetrain.destinations import storage_reason

    what = storage_reason(e)
    if what is None:
        return None
    where = f" {e.filename}" if getattr(e, "filename", None) else ""
    return f"moetrain {command} could not write{where}: {what}. {_KEPT.get(command, '')}".rstrip()


def _lost_a_peer(e: BaseException) -> bool:
    """A communication error that means another rank died (gloo/NCCL wording)."""
    import torch.distributed as dist

    return isinstance(e, dist.DistNetworkError) or any(s in str(e) for s in _LOST_PEER)


def _stdout_closed() -> bool:
    """Whether stdout's reader is gone (a pipe whose other end closed polls as an error); if so,
    stdout is pointed at /dev/null, so the flush at exit does not fail again."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        closed = any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll(), or stdout is no file
        return False
    if closed:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return closed


def _usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: moetrain COMMAND [ARGS] [--debug]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", "Run 'moetrain COMMAND --help' for a command's arguments."]
    return "\n".join(lines)
