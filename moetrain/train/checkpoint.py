"""Checkpoints with torch.distributed.checkpoint (DCP).

Layout: RUN_DIR/checkpoints/step-N/ holds
  - the DCP files: model parameters and buffers (the aux-free router biases among them; fp32
    masters in place of bf16 weights) and the AdamW moments, tensors only (loading executes no
    pickled code), experts one entry each so that any expert-parallel layout can load them. Each
    entry has its global shape whatever the layout; each rank writes and reads only the part it
    holds (`checkpoint_entries`: views of live tensors, `FlatShard` ranges of sharded state,
    stored as rectangular blocks by moetrain/train/dcp_shards.py), so nothing is gathered;
  - trainer_state.json: step and data-loader position (rank 0); rng-rankR.json: each rank's RNG;
  - config.yaml (the run's resolved config) and tokenizer.json, so `eval`/`generate` need
    nothing else;
  - COMPLETE, written last.
A checkpoint is written under a temporary name and renamed when complete, so a crash never leaves
a directory that looks finished. Every command taking CHECKPOINT accepts a run directory (its
newest complete checkpoint) or a step-N directory. Before anything is loaded, the checkpoint's
index and files are checked (moetrain/train/checkpoint_index.py): a damaged checkpoint is named as
such, with the file, and a model of another shape with the first tensor that differs.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.errors import CheckpointError
from moetrain.model.experts import GroupedExperts
from moetrain.model.transformer import canonical_name
from moetrain.optim.base import FlatShard
from moetrain.parallel.fsdp import copy_shard, full_tensor, is_sharded, local_flat_range, reshard
from moetrain.train.checkpoint_index import (  # noqa: F401 (SafeFileSystemReader: ckpt.SafeFileSystemReader)
    SafeFileSystemReader,
    diagnose,
    first_mismatch,
    read_index,
)
from moetrain.train.dcp_shards import CpuStager, ShardLoadPlanner, ShardSavePlanner, ShardWriter

# DCP's note for single-process saves, also from async_save's background thread.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

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
    """A step-N directory, or a run directory (-> its newest complete checkpoint), checked
    intact (`diagnose`): a damaged one is refused naming the damage (and the newest intact
    checkpoint before it, if any)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"Checkpoint path '{path}' does not exist: pass a run directory or its checkpoints/step-N."
        )
    if (path / COMPLETE).is_file():
        found = path
    elif STEP_DIR.match(path.name):
        raise CheckpointError(
            f"'{path}' is an incomplete checkpoint (no {COMPLETE} marker: the run was interrupted "
            "while writing it). Use an earlier step or the run directory."
        )
    else:
        complete = list_checkpoints(path)
        if not complete:
            raise CheckpointError(
                f"'{path}' holds no complete checkpoint (looked for {checkpoints_dir(path)}/step-N/"
                f"{COMPLETE}). Train with --save-every N, or point at a step-N directory."
            )
        found = complete[-1][1]
    damage = diagnose(found)
    if damage is not None:
        raise CheckpointError(damaged(found, damage))
    return found


def damaged(path: Path, damage: str) -> str:
    """The message for a checkpoint `diagnose` found damaged, with the newest intact one
    before it."""
    m = STEP_DIR.match(path.name)
    earlier = [p for s, p in list_checkpoints(path.parent.parent) if m and s < int(m.group(1))]
    intact = next((p for p in reversed(earlier) if diagnose(p) is None), None)
    instead = (
        f"the newest intact checkpoint before it is {intact}: pass that one"
        if intact
        else "no intact checkpoint precedes it"
    )
    return (
        f"Checkpoint '{path}' is damaged: {damage}. {instead[0].upper()}{instead[1:]} (`moetrain train … --resume` "
        "falls back to it by itself), or restore the files from a copy."
    )


def estimated_bytes(num_params: int, optimizer_bytes_per_param: int = 0) -> int:
    """About what a checkpoint of `num_params` parameters takes on disk: fp32 weights (4 B per
    parameter) and the optimizer state saved with them (AdamW's two moments: 8 B, or 4 B in
    bf16), plus 1% and 1 MiB for DCP's per-entry headers, the index and the small files."""
    return int(num_params * (4 + optimizer_bytes_per_param) * 1.01) + (1 << 20)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    trainer_state: dict[str, Any],
    extra_files: dict[str, Path | str] | None = None,
    keep_last: int = 0,
    rank: int = 0,
    async_write: bool = False,
    process_group=None,
) -> Path | PendingCheckpoint:
    """Write step-N atomically (every rank calls this); then keep the newest `keep_last`.
    `state` is what DCP writes (`TrainEngine.checkpoint_state()`, or `{"model":
    model_state_dict(m)}` for weights only): tensors and `FlatShard`s, each rank's own part;
    `trainer_state` goes to trainer_state.json (rank 0).

        DCP coordinates over `process_group` (a CPU-capable group: the ranks' plans then travel
        in host memory). With `async_write` the tensors are staged (copied to host memory) now and
        written by a background thread (`dcp.async_save`); the returned
        `PendingCheckpoint` completes the checkpoint — COMPLETE marker, rename, retention — when
        `finish()` is called, so it becomes visible only once every file is written, exactly as a
        synchronous save. Training may continue meanwhile."""
    root = checkpoints_dir(run_dir)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    _barrier()

    def failed(e: BaseException) -> CheckpointError:
        # Disk full, quota, a vanished mount: drop the partial write; earlier checkpoints are
        # untouched (nothing is replaced before the write is complete).
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = list_checkpoints(run_dir)
        kept = (
            f"the newest complete checkpoint, {previous[-1][1]}, is intact"
            if previous
            else "no earlier checkpoint exists"
        )
        return CheckpointError(
            f"Writing checkpoint step-{step} in '{root}' failed ({_first_line(e)}); {kept}. Free space "
            "(or fix the directory) and continue with --resume."
        )

    def complete() -> Path:
        try:
            _barrier()
            if rank == 0:
                (tmp / "trainer_state.json").write_text(json.dumps(trainer_state))
                for name, src in (extra_files or {}).items():
                    src = Path(src)
                    if src.is_file():
                        shutil.copyfile(src, tmp / name)
                (tmp / COMPLETE).write_text(f"step {step}\n")
                _fsync_dir(tmp)
        except (OSError, CheckpointException) as e:
            raise failed(e) from None
        if rank == 0:
            if final.exists():  # a re-save of the same step (e.g. after a resume): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(root)
            if keep_last > 0:
                for _, old in list_checkpoints(run_dir)[:-keep_last]:
                    shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            if async_write:
                future = dcp.async_save(
                    state,
                    checkpoint_id=str(tmp),
                    process_group=process_group,
                    planner=ShardSavePlanner(),
                    async_stager=CpuStager(),
                )
            else:
                dcp.save(
                    state, storage_writer=ShardWriter(str(tmp)), planner=ShardSavePlanner(), process_group=process_group
                )
        (tmp / f"rng-rank{rank}.json").write_text(json.dumps(rng_state()))  # the state at save time
    except (OSError, CheckpointException) as e:
        raise failed(e) from None
    if async_write:
        return PendingCheckpoint(step, future, complete, failed)
    return complete()


class PendingCheckpoint:
    """A checkpoint whose tensors are being written in the background (`save_checkpoint` with
    `async_write`). `finish()` waits for the write and completes it; until then it is invisible
    to `--resume` (a crash leaves only the ignored temporary directory)."""

    def __init__(self, step: int, future, complete, failed):
        self.step, self._future, self._complete, self._failed = step, future, complete, failed

    def finish(self) -> Path:
        try:
            self._future.result()
        except (Exception, CheckpointException) as e:
            raise self._failed(e) from None
        return self._complete()


def load_checkpoint(
    path: Path, state: dict[str, Any], rank: int = 0, restore_rng: bool = False, process_group=None
) -> dict[str, Any]:
    """Fill `state` (entries as `TrainEngine.checkpoint_state()` gives them: this rank's part,
    filled in place; or a template of whole tensors) from the checkpoint at `path`, whatever
    layout saved it; with `restore_rng`, this rank's RNG state as saved (when the checkpoint has
    one for it); return the trainer state. DCP coordinates over `process_group` (as for
    `save_checkpoint`). The caller finishes the load (`TrainEngine.checkpoint_loaded`,
    `load_model_state_dict`)."""
    check_loadable(path, state)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(str(path)),
                planner=ShardLoadPlanner(),
                process_group=process_group,
            )
    # DCP reports failures as CheckpointException, a BaseException that wraps per-rank errors.
    except (Exception, CheckpointException) as e:
        damage = diagnose(path)  # a file that went missing since: say which
        if damage is not None:
            raise CheckpointError(damaged(path, damage)) from None
        raise CheckpointError(
            f"Checkpoint '{path}' could not be read: {_first_line(e)}. Its index and files look intact; if the "
            "problem stays, load an earlier checkpoint."
        ) from None
    rng_file = path / f"rng-rank{rank}.json"
    if restore_rng and rng_file.is_file():
        set_rng_state(json.loads(rng_file.read_text()))
    trainer_state_file = path / "trainer_state.json"
    return json.loads(trainer_state_file.read_text()) if trainer_state_file.is_file() else {}


def check_loadable(path: Path, state: dict[str, Any]) -> None:
    """Refuse, before reading any tensor, a damaged checkpoint (`diagnose`) or one that lacks an
    entry of `state` or holds it with another shape (the first such entry, both shapes)."""
    metadata, damage = read_index(path)
    damage = damage or diagnose(path)
    if damage is not None:
        raise CheckpointError(damaged(path, damage))
    mismatch = first_mismatch(metadata, state)
    if mismatch is not None:
        raise CheckpointError(
            f"Checkpoint '{path}' does not fit this model: {mismatch}; check its config.yaml against the current "
            "model config."
        )


def load_model(path: Path, model: nn.Module, masters: dict[str, torch.Tensor] | None = None) -> None:
    """Load only the model's weights (and persistent buffers) from a checkpoint, in place;
    `masters` (canonical name → fp32 tensor, as `Optimizer.master_weights` gives them) are filled
    with their entries too, for the caller to hand back to the optimizer."""
    state = {"model": model_state_dict(model, masters)}
    load_checkpoint(path, state)
    load_model_state_dict(model, state["model"])


# ---- the layout-free entries ------------------------------------------------------------------
# Stacked expert tensors are split into one entry per *global* expert index ("…w_down_EDF/5"): a
# rank holding experts [a, b) writes and reads just those entries, so a checkpoint written with
# one expert-parallel degree loads into any other. Replicated entries (dense parameters, experts
# held by several ranks) are identical and DCP stores them once. Optimizer hyperparameters are
# not saved (they come from the config, the LR from the schedule): tensors only.


def checkpoint_entries(
    model: nn.Module,
    masters: dict[str, FlatShard],
    optim_tensors: dict[str, dict[str, torch.Tensor | FlatShard]] | None = None,
) -> dict[str, dict[str, torch.Tensor | FlatShard]]:
    """{"model": …} (and {"optim": …} given an optimizer's `checkpoint_tensors()`): the entries of
    `model_state_dict` / `optimizer_state_dict`, names and global shapes alike, as the part of
    each this rank holds — views of the live tensors it holds whole, `FlatShard`s of FSDP's
    shards (the local rows), of the sharded optimizer's ranges and of the split fp32 masters
    (`masters`, `Optimizer.checkpoint_masters`, standing in for the bf16 parameters). DCP saves
    from them and loads into them in place. No copy, no communication."""
    reshard(model)  # FSDP's root keeps its parameters gathered after a no-grad forward (eval)
    offsets = _expert_offsets(model)
    out: dict[str, dict[str, torch.Tensor | FlatShard]] = {"model": {}}
    for name, tensor in model.state_dict(keep_vars=True).items():
        name = canonical_name(name)
        assert name in masters or tensor.dtype == torch.float32 or not tensor.is_floating_point(), (
            f"{name} is {tensor.dtype}: its fp32 master must come from the optimizer"
        )
        _put(out["model"], name, masters[name] if name in masters else _local(tensor.detach()), offsets.get(name))
    if optim_tensors is not None:
        out["optim"] = {}
        for name, entry in optim_tensors.items():
            for key, value in entry.items():
                _put(out["optim"], f"{name}.{key}", _local(value), offsets.get(name))
    return out


def _local(t: torch.Tensor | FlatShard) -> torch.Tensor | FlatShard:
    """A DTensor (FSDP's dim-0 shard) as the `FlatShard` of its local rows; anything else as is."""
    if isinstance(t, FlatShard) or not is_sharded(t):
        return t
    start, values = local_flat_range(t)
    return FlatShard(tuple(t.shape), start, values=values)


def model_state_dict(model: nn.Module, masters: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by canonical name, experts split per global
    index, whole: views of the live tensors, or full temporaries for FSDP's sharded ones.
    Collective under FSDP (the shards are gathered): for one process (inference, HF import) and
    the in-memory `TrainEngine.state_dict()`; training checkpoints use `checkpoint_entries`.
    `masters` (canonical name → fp32 tensor) stand in for the live bf16 parameters of
    optim.bf16_weights, so that checkpoints always hold fp32 weights; DCP loads into them in place."""
    reshard(model)  # FSDP's root keeps its parameters gathered after a no-grad forward (eval)
    offsets = _expert_offsets(model)
    masters = masters or {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        name = canonical_name(name)
        tensor = masters[name] if name in masters else full_tensor(tensor.detach())
        _put(out, name, tensor, offsets.get(name))
    return out


@torch.no_grad()
def load_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Write entries as `model_state_dict` gives them into the model (this rank's shard of each
    sharded parameter; nothing for entries that are the live tensors already). No communication."""
    reshard(model)
    offsets = _expert_offsets(model)
    for name, live in model.state_dict(keep_vars=True).items():
        name = canonical_name(name)
        value = _take(state, name, live, offsets.get(name))
        if value is not None:
            copy_shard(live.detach(), value)


def model_entries(model: nn.Module, state: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """The model entries `names` (canonical parameter names) of `state`, experts joined back into
    this rank's stacked tensors."""
    offsets = _expert_offsets(model)
    live = {canonical_name(n): p for n, p in model.named_parameters()}
    return {
        name: _join(state, name, offsets.get(name), live[name].shape[0] if name in offsets else 0) for name in names
    }


def optimizer_state_dict(model: nn.Module, tensors: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """An optimizer's `state_dict_tensors()` as flat entries "NAME.KEY", experts split per
    global index like the model's."""
    offsets = _expert_offsets(model)
    out: dict[str, torch.Tensor] = {}
    for name, entry in tensors.items():
        for key, value in entry.items():
            _put(out, f"{name}.{key}", value, offsets.get(name))
    return out


def optimizer_tensors(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The inverse of `optimizer_state_dict`: per parameter name, its tensors as the optimizers'
    `load_state_dict_tensors` take them (split experts stacked again)."""
    offsets = _expert_offsets(model)
    keys_of: dict[str, set[str]] = {}
    for flat in state:
        name, key = flat.split("/")[0].rsplit(".", 1)
        keys_of.setdefault(name, set()).add(key)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        name = canonical_name(name)
        num_local = p.shape[0] if name in offsets else 1
        out[name] = {
            key: _join(state, f"{name}.{key}", offsets.get(name), num_local) for key in sorted(keys_of.get(name, ()))
        }
    return out


def _put(out: dict, key: str, tensor: torch.Tensor | FlatShard, expert_offset: int | None) -> None:
    if isinstance(tensor, FlatShard):  # one range of the (stacked) tensor: the experts it reaches
        if expert_offset is not None and len(tensor.shape) == 3:
            shape, per = tensor.shape[1:], math.prod(tensor.shape[1:])
            for i in range(tensor.shape[0]):
                part = tensor.window(i * per, (i + 1) * per, shape)
                if part.numel:
                    out[f"{key}/{expert_offset + i}"] = part
        elif tensor.numel:
            out[key] = tensor
    elif expert_offset is not None and tensor.ndim == 3:
        for i in range(tensor.shape[0]):
            out[f"{key}/{expert_offset + i}"] = tensor[i]
    else:
        out[key] = tensor


def _join(state: dict, key: str, expert_offset: int | None, num_local: int) -> torch.Tensor:
    if key in state:
        return state[key]
    return torch.stack([state[f"{key}/{expert_offset + i}"] for i in range(num_local)])


def _take(state: dict, key: str, live: torch.Tensor, expert_offset: int | None) -> torch.Tensor | None:
    """The value for `live` from `state`, or None when the entries are `live`'s own memory."""
    if key in state:
        value = state[key]
        return None if value is live or (not is_sharded(live) and _same_memory(value, live)) else value
    parts = [state[f"{key}/{expert_offset + i}"] for i in range(live.shape[0])]
    if not is_sharded(live) and all(_same_memory(part, live[i]) for i, part in enumerate(parts)):
        return None
    return torch.stack(parts)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _expert_offsets(model: nn.Module) -> dict[str, int]:
    """Canonical parameter name → global index of its first expert, for stacked expert tensors."""
    offsets = {}
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for pname, _ in module.named_parameters(recurse=False):
                offsets[f"{canonical_name(name)}.{pname}"] = module.expert_offset
    return offsets


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


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
    lines = [line.strip() for line in text.splitlines()]
    telling = [line for line in lines if any(k in line.lower() for k in ("mismatch", "missing key", "unexpected key"))]
    raised = [line for line in telling if re.match(r"^\w+(Error|Exception): ", line)]  # not a traceback's source line
    for line in raised + telling:
        return line.removeprefix("ValueError: ").removeprefix("RuntimeError: ")
    return lines[0] if text else type(e).__name__
