"""Checkpoints with torch.distributed.checkpoint (DCP).

Layout: RUN_DIR/checkpoints/step-N/ holds
  - the DCP files: model parameters and buffers (the aux-free router biases among them) and the
    AdamW moments, tensors only (loading executes no pickled code);
  - trainer_state.json: step, data-loader position, RNG states (base64), written by rank 0;
  - config.yaml (the run's resolved config) and tokenizer.json, so `eval`/`generate` need
    nothing else;
  - COMPLETE, written last.
A checkpoint is written under a temporary name and renamed when complete, so a crash never leaves
a directory that looks finished. Every command taking CHECKPOINT accepts a run directory (its
newest complete checkpoint) or a step-N directory.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from moetrain.errors import CheckpointError

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and (child / COMPLETE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def resolve_checkpoint(path: str | Path) -> Path:
    """A step-N directory, or a run directory (-> its newest complete checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"Checkpoint path '{path}' does not exist: pass a run directory or its checkpoints/step-N.")
    if (path / COMPLETE).is_file():
        return path
    if STEP_DIR.match(path.name):
        raise CheckpointError(
            f"'{path}' is an incomplete checkpoint (no {COMPLETE} marker: the run was interrupted "
            "while writing it). Use an earlier step or the run directory."
        )
    found = list_checkpoints(path)
    if not found:
        raise CheckpointError(
            f"'{path}' holds no complete checkpoint (looked for {checkpoints_dir(path)}/step-N/"
            f"{COMPLETE}). Train with --save-every N, or point at a step-N directory."
        )
    return found[-1][1]


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    extra_files: dict[str, Path | str] | None = None,
    keep_last: int = 0,
    rank: int = 0,
) -> Path:
    """Write step-N atomically; then delete all but the newest `keep_last` (0 = keep all)."""
    root = checkpoints_dir(run_dir)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    state = {"model": get_model_state_dict(model), "optim": _optim_tensors(model, optimizer)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(state, checkpoint_id=str(tmp))
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state))
        for name, src in (extra_files or {}).items():
            src = Path(src)
            if src.is_file():
                shutil.copyfile(src, tmp / name)
        (tmp / COMPLETE).write_text(f"step {step}\n")
        _fsync_dir(tmp)
        if final.exists():  # a re-save of the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep_last > 0:
            for _, old in list_checkpoints(run_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load model (and optimizer) state in place; return the trainer state."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = _optim_tensors(model, optimizer)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, checkpoint_id=str(path))
    # DCP reports mismatches as CheckpointException, a BaseException that wraps per-rank errors.
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"Checkpoint '{path}' does not fit this model: {_first_line(e)}. It was saved from a "
            f"different model shape; check its config.yaml against the current model config."
        ) from None
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        full = get_optimizer_state_dict(model, optimizer)
        for fqn, tensors in state["optim"].items():
            full["state"][fqn].update(tensors)
        set_optimizer_state_dict(model, optimizer, full)
    trainer_state_file = path / "trainer_state.json"
    return json.loads(trainer_state_file.read_text()) if trainer_state_file.is_file() else {}


def _optim_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's per-parameter tensors keyed by parameter name. Hyperparameters are not
    saved: they come from the config (the LR from the schedule), so a checkpoint holds tensors
    only. A fresh optimizer gets zero state first, so shapes exist to load into."""
    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=False))
    return {fqn: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for fqn, s in full["state"].items()}


def rng_state() -> dict[str, str]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in states.items()}


def set_rng_state(states: dict[str, str]) -> None:
    def tensor(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    if "cpu" in states:
        torch.set_rng_state(tensor(states["cpu"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(states["cuda"]))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _first_line(e: BaseException) -> str:
    """The informative line of a (possibly multi-rank, traceback-laden) DCP error."""
    text = str(e).strip()
    for line in text.splitlines():
        low = line.lower()
        if "mismatch" in low or "missing key" in low or "unexpected key" in low:
            return line.strip().removeprefix("ValueError: ").removeprefix("RuntimeError: ")
    return text.splitlines()[0] if text else type(e).__name__
