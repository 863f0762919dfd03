"""What a checkpoint holds, written and read with torch.distributed.checkpoint (DCP).

RUN_DIR/checkpoints/step-N/ (named, listed and kept by src/moetrain/train/run_dir.py) holds the
DCP files (model parameters and buffers, fp32 masters in place of bf16 weights, the optimizer's
moments: tensors only, experts one entry each, every entry in its global shape, each rank writing
and reading only its part: `checkpoint_entries`), trainer_state.json, rng-rankR.json, config.yaml
and tokenizer.json, and COMPLETE, written last (docs/architecture.md, "Checkpoints"). Before a
load the index and files are checked (src/moetrain/train/checkpoint_index.py), so a damaged
checkpoint or a model of another shape is named as such.
"""

from __future__ import annotations

import base64
import dataclasses
import heapq
import json
import math
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.destinations import storage_reason
from moetrain.errors import CheckpointError
from moetrain.model.experts import GroupedExperts
from moetrain.model.transformer import canonical_name
from moetrain.optim.base import FlatShard
from moetrain.parallel.dims import ParallelState
from moetrain.parallel.fsdp import full_tensor, is_sharded, local_flat_range, reshard
from moetrain.parallel.rehearsal import Rehearsal
from moetrain.train.checkpoint_index import (
    SafeFileSystemReader,
    first_mismatch,
    first_unexpected,
    merge_rank_indexes,
    read_index,
)
from moetrain.train.dcp_shards import CpuStager, ShardLoadPlanner, ShardSavePlanner, ShardWriter
from moetrain.train.run_dir import COMPLETE, check_intact, checkpoints_dir, fsync_dir, list_checkpoints, publish

# DCP's note for single-process saves, also from async_save's background thread.
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


@dataclasses.dataclass(frozen=True)
class ShardRole:
    """What one process writes of a checkpoint, and whether it completes it.

    Each rank writes the entries it owns into its own file and index (`__R_0.distcp`,
    `__R.metadata`), and the main process merges the indexes: no plan crosses ranks. A sharded
    range is its holder's; an entry held whole by several ranks is dealt, largest first, to the
    member with the fewest bytes so far (`owners`), which every member computes alike."""

    rank: int = 0
    world: int = 1
    main: bool = True
    """Completes the checkpoint (merges the indexes, writes trainer_state.json, COMPLETE): rank 0,
    or a rehearsal's one process."""
    dense_replicas: tuple[int, ...] = (0,)
    """The global ranks holding this rank's dense entries whole."""
    expert_replicas: tuple[int, ...] = (0,)
    """The global ranks holding this rank's (plain) expert entries whole."""
    writes_for: tuple[int, ...] = (0,)
    """The ranks whose files this process writes: its own; in a rehearsal every rank's, each with
    the entries this process holds that the rank owns (what a peer would write of them)."""
    rehearsal: Rehearsal | None = None
    """A rehearsal's checkpoint holds only its one rank's entries: the merge asks for no tensor
    whole, and trainer_state.json records the rehearsal, so that only the same one loads it."""

    @classmethod
    def of(cls, par: ParallelState) -> ShardRole:
        dims, rank = par.dims, par.rank
        return cls(
            rank=rank,
            world=dims.world_size,
            main=par.is_main,
            dense_replicas=dims.ranks(rank, "dp", "cp"),
            expert_replicas=dims.ranks(rank, "edp"),
            writes_for=tuple(range(dims.world_size)) if par.rehearsed else (rank,),
            rehearsal=Rehearsal(dims.world_size, rank) if par.rehearsed else None,
        )

    @classmethod
    def alone(cls) -> ShardRole:
        """For callers that know no layout (tools, tests): this rank writes everything it holds
        (the merge keeps one copy of identical chunks)."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return cls(rank, world, rank == 0, (rank,), (rank,), (rank,))

    def owners(self, state: dict[str, dict[str, Any]]) -> dict[tuple[str, str], int]:
        """(section, name) → the global rank that writes the entry."""
        out: dict[tuple[str, str], int] = {}
        by_group: dict[tuple[int, ...], list[tuple[int, str, tuple[str, str]]]] = {}
        for section, entries in state.items():
            for name, value in entries.items():
                if isinstance(value, FlatShard) and not value.replicated:
                    out[(section, name)] = self.rank  # a sharded range: this rank's alone
                    continue
                group = self.expert_replicas if "/" in name else self.dense_replicas
                nbytes = value.numel * value.dtype.itemsize if isinstance(value, FlatShard) else value.nbytes
                by_group.setdefault(group, []).append((nbytes, f"{section}.{name}", (section, name)))
        for group, items in by_group.items():
            loads = [(0, i) for i in range(len(group))]  # a heap of (bytes dealt, member)
            for nbytes, _, key in sorted(items, key=lambda item: (-item[0], item[1])):
                dealt, member = heapq.heappop(loads)
                out[key] = group[member]
                heapq.heappush(loads, (dealt + max(nbytes, 1), member))
        return out


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    trainer_state: dict[str, Any],
    extra_files: dict[str, Path | str] | None = None,
    keep_last: int = 0,
    role: ShardRole | None = None,
    async_write: bool = False,
    process_group=None,
) -> Path | PendingCheckpoint:
    """Write step-N atomically (every rank calls this); then keep the newest `keep_last`.
    `state` is what DCP writes (`TrainEngine.checkpoint_state()`, or `{"model":
    model_state_dict(m)}`), `trainer_state` goes to trainer_state.json, `role` says which entries
    this process writes (default `ShardRole.alone()`). The ranks then agree over `process_group`
    (CPU-capable; None: the default) that every write succeeded. With `async_write` the tensors
    are copied to host memory and written in the background; the returned `PendingCheckpoint`
    completes (and only then publishes) the checkpoint at `finish()`."""
    role = role or ShardRole.alone()
    recorded_state = dict(trainer_state)
    if role.rehearsal is not None:
        recorded_state["rehearsal"] = dataclasses.asdict(role.rehearsal)
    write = _CheckpointWrite(run_dir, step, role, process_group, recorded_state, extra_files or {}, keep_last)
    if role.main:  # a fresh, empty temporary directory; every rank waits for it
        shutil.rmtree(write.tmp, ignore_errors=True)
        write.tmp.mkdir(parents=True, exist_ok=True)
    _barrier(process_group)
    future, error = write.write_tensors(state, async_write)
    if future is not None and error is None:
        return PendingCheckpoint(step, future, write.complete)
    return write.complete(error)


@dataclasses.dataclass
class _CheckpointWrite:
    """One `save_checkpoint` on this rank: everything is written into the temporary directory
    `tmp` (`write_tensors`, then `complete`), which then replaces `final` in one rename."""

    run_dir: str | Path
    step: int
    role: ShardRole
    process_group: Any
    recorded_state: dict[str, Any]
    """trainer_state.json's contents."""
    extra_files: dict[str, Path | str]
    keep_last: int

    def __post_init__(self) -> None:
        self.final = checkpoints_dir(self.run_dir) / f"step-{self.step}"
        self.tmp = self.final.with_name(f".step-{self.step}.tmp")

    def write_tensors(self, state: dict[str, Any], async_write: bool) -> tuple[Any, BaseException | None]:
        """The DCP files of every rank this process writes for (`ShardRole.writes_for`) and this
        rank's RNG state: (the future of this rank's files with `async_write`, the error if any)."""
        role = self.role
        owners = role.owners(state)

        def part(rank: int) -> dict[str, dict[str, Any]]:
            return {
                section: {name: v for name, v in entries.items() if owners[(section, name)] == rank}
                for section, entries in state.items()
            }

        future = None
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                for rank in role.writes_for:
                    how = dict(storage_writer=ShardWriter(str(self.tmp), rank=rank), planner=ShardSavePlanner())
                    if async_write and rank == role.rank:
                        future = dcp.async_save(part(rank), async_stager=CpuStager(), no_dist=True, **how)
                    else:
                        dcp.save(part(rank), no_dist=True, **how)
            (self.tmp / f"rng-rank{role.rank}.json").write_text(json.dumps(rng_state()))  # the state at save time
        except (OSError, CheckpointException, KeyboardInterrupt) as e:
            return future, e
        return future, None

    def complete(self, error: BaseException | None) -> Path:
        """After the tensors are written (`error`: this rank's failed), on every rank: once all
        succeeded, the main process completes the directory, renames it to step-N and prunes."""
        if _any_rank(error is not None, self.process_group):
            raise self.failed(error)
        if self.role.main:
            tmp = self.tmp
            try:  # the merged index, trainer_state.json, the extra files, then COMPLETE; synced to disk
                merge_rank_indexes(tmp, self.role.world, whole=self.role.rehearsal is None)
                (tmp / "trainer_state.json").write_text(json.dumps(self.recorded_state))
                for name, src in self.extra_files.items():
                    if Path(src).is_file():
                        shutil.copyfile(src, tmp / name)
                (tmp / COMPLETE).write_text(f"step {self.step}\n")
                fsync_dir(tmp)
            except (OSError, CheckpointException) as e:
                raise self.failed(e) from None
            publish(tmp, self.final, self.keep_last)
        _barrier(self.process_group)
        return self.final

    def failed(self, e: BaseException | None) -> CheckpointError | KeyboardInterrupt:
        """The error for a failed write (`e`: this rank's; None: another rank's), the partial
        write dropped (earlier checkpoints are untouched); a second Ctrl-C, which DCP hands back
        wrapped, stays a KeyboardInterrupt."""
        if self.role.main:
            shutil.rmtree(self.tmp, ignore_errors=True)
        previous = list_checkpoints(self.run_dir)
        kept = (
            f"the newest complete checkpoint, {previous[-1][1]}, is intact"
            if previous
            else "no earlier checkpoint exists"
        )
        wrapped = [f[0] for f in (getattr(e, "failures", None) or {}).values()]
        if any(isinstance(x, KeyboardInterrupt) for x in (e, *wrapped)):
            return KeyboardInterrupt(f"checkpoint step-{self.step} was being written and is dropped; {kept}")
        why = (storage_reason(e) or _first_line(e)) if e is not None else "another rank could not write its part"
        return CheckpointError(
            f"Writing checkpoint step-{self.step} in '{self.final.parent}' failed ({why}); {kept}. Free space "
            "(or fix the directory) and continue with --resume."
        )


class PendingCheckpoint:
    """A checkpoint being written in the background: `finish()` waits for the write and completes
    it; until then `--resume` cannot see it (a crash leaves only the ignored temporary directory)."""

    def __init__(self, step: int, future, complete):
        self.step, self._future, self._complete = step, future, complete

    def finish(self) -> Path:
        error = None
        try:
            self._future.result()
        except (Exception, CheckpointException) as e:
            error = e
        return self._complete(error)


def load_checkpoint(
    path: Path, state: dict[str, Any], rank: int = 0, restore_rng: bool = False, rehearsal: Rehearsal | None = None
) -> dict[str, Any]:
    """Fill `state` (as `TrainEngine.checkpoint_state()` gives it, or whole tensors) in place from
    the checkpoint at `path`, whatever layout saved it, with no communication; with `restore_rng`,
    this rank's RNG state too. Returns the trainer state; the caller finishes the load
    (`TrainEngine.checkpoint_loaded`)."""
    check_loadable(path, state, rehearsal)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=ShardLoadPlanner(), no_dist=True)
    # DCP reports failures as CheckpointException, a BaseException that wraps per-rank errors.
    except (Exception, CheckpointException) as e:
        check_intact(path)  # a file that went missing since: say which
        raise CheckpointError(
            f"Checkpoint '{path}' could not be read: {_first_line(e)}. Its index and files look intact; if the "
            "problem stays, load an earlier checkpoint."
        ) from None
    rng_file = path / f"rng-rank{rank}.json"
    if restore_rng and rng_file.is_file():
        set_rng_state(json.loads(rng_file.read_text()))
    trainer_state_file = path / "trainer_state.json"
    return json.loads(trainer_state_file.read_text()) if trainer_state_file.is_file() else {}


def check_loadable(
    path: Path,
    state: dict[str, Any],
    rehearsal: Rehearsal | None = None,
    whole_model: dict[str, torch.Tensor] | None = None,
) -> None:
    """Refuse, before reading any tensor, a damaged checkpoint, another rehearsal's, or one that
    lacks an entry of `state` or holds it with another shape. Given `whole_model` (a resume: the
    whole model's `model_state_dict`, on the meta device), first one that does not hold exactly
    its entries: a verdict every rank reaches alike, whatever part of the model it holds."""
    metadata, damage = read_index(path)
    check_intact(path, damage)
    written_by = json.loads((path / "trainer_state.json").read_text()).get("rehearsal")
    if written_by is not None and written_by != (dataclasses.asdict(rehearsal) if rehearsal else None):
        raise CheckpointError(
            f"Checkpoint '{path}' was written by a rehearsal of rank {written_by['rank']} of {written_by['world']} "
            "(--rehearse): it holds only that rank's entries, so only the same rehearsal (--rehearse "
            f"{written_by['world']} --rank {written_by['rank']}) can load it."
        )
    mismatch = None
    if whole_model is not None and written_by is None:  # a rehearsal's holds one rank's entries
        mismatch = first_mismatch(metadata, {"model": whole_model}) or first_unexpected(metadata, whole_model)
    mismatch = mismatch or first_mismatch(metadata, state)
    if mismatch is not None:
        raise CheckpointError(
            f"Checkpoint '{path}' does not fit this model: {mismatch}; check its config.yaml against the current "
            "model config."
        )


def load_model(path: Path, model: nn.Module) -> None:
    """Load only the model's weights (and persistent buffers) from a checkpoint, in place."""
    load_checkpoint(path, {"model": _model_entries(model, lambda _, tensor: _local(tensor))})


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
    `model_state_dict` / `optimizer_state_dict` as the part of each this rank holds: views of live
    tensors, `FlatShard`s of shards and of the split fp32 `masters`. No copy, no communication."""

    def entry(name: str, tensor: torch.Tensor) -> torch.Tensor | FlatShard:
        assert name in masters or tensor.dtype == torch.float32 or not tensor.is_floating_point(), (
            f"{name} is {tensor.dtype}: its fp32 master must come from the optimizer"
        )
        return masters[name] if name in masters else _local(tensor)

    out: dict[str, dict[str, torch.Tensor | FlatShard]] = {"model": _model_entries(model, entry)}
    if optim_tensors is not None:
        local = {name: {key: _local(v) for key, v in entry.items()} for name, entry in optim_tensors.items()}
        out["optim"] = optimizer_state_dict(model, local)
    return out


def _local(t: torch.Tensor | FlatShard) -> torch.Tensor | FlatShard:
    """A DTensor (FSDP's dim-0 shard) as the `FlatShard` of its local rows; anything else as is."""
    if isinstance(t, FlatShard) or not is_sharded(t):
        return t
    start, values = local_flat_range(t)
    return FlatShard(tuple(t.shape), start, values=values)


def save_weights(out: Path, cfg, model: nn.Module, tokenizer: Path, origin: dict[str, str]) -> Path:
    """`model` as a weights-only checkpoint `out`/checkpoints/step-0, both it and `out` with its
    config.yaml and tokenizer.json (where `tokenizer` is a file), as a run directory has them;
    `origin` joins the step's metadata. The config's checkpoint.init_from is `out`, so
    `moetrain train out/config.yaml` starts from these weights."""
    out.mkdir(parents=True, exist_ok=True)
    cfg.checkpoint.init_from = str(out)
    (out / "config.yaml").write_text(cfg.to_yaml())
    beside = out / "tokenizer.json"
    if tokenizer.is_file() and not (beside.exists() and beside.samefile(tokenizer)):  # an import into its source
        shutil.copyfile(tokenizer, beside)
    extra = {"config.yaml": out / "config.yaml", "tokenizer.json": tokenizer}  # copied where it is a file
    return save_checkpoint(out, 0, {"model": model_state_dict(model)}, {"step": 0, **origin}, extra_files=extra)


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers by canonical name, experts split per global
    index, whole: views of the live tensors, or gathered temporaries of FSDP's shards (collective)."""
    return _model_entries(model, lambda _, tensor: full_tensor(tensor))


def _model_entries(model: nn.Module, value: Callable[[str, torch.Tensor], Any]) -> dict[str, Any]:
    """`value(canonical name, detached tensor)` of each state-dict entry, experts split (`_put`)."""
    reshard(model)  # FSDP's root keeps its parameters gathered after a no-grad forward (eval)
    offsets = _expert_offsets(model)
    out: dict[str, Any] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        name = canonical_name(name)
        _put(out, name, value(name, tensor.detach()), offsets.get(name))
    return out


def optimizer_state_dict(model: nn.Module, tensors: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """An optimizer's `checkpoint_tensors()` as flat entries "NAME.KEY", experts split per
    global index like the model's."""
    offsets = _expert_offsets(model)
    out: dict[str, torch.Tensor] = {}
    for name, entry in tensors.items():
        for key, value in entry.items():
            _put(out, f"{name}.{key}", value, offsets.get(name))
    return out


def _put(out: dict, key: str, tensor: torch.Tensor | FlatShard, expert_offset: int | None) -> None:
    """`tensor` as `out[key]`, or a stacked expert tensor as one entry per expert ("key/E"); of a
    `FlatShard` (one range of the tensor) only the parts its range reaches."""
    if expert_offset is None or len(tensor.shape) != 3:
        parts = {key: tensor}
    else:
        per = math.prod(tensor.shape[1:])
        parts = {
            f"{key}/{expert_offset + i}": (
                tensor.window(i * per, (i + 1) * per, tensor.shape[1:]) if isinstance(tensor, FlatShard) else tensor[i]
            )
            for i in range(tensor.shape[0])
        }
    out.update({k: v for k, v in parts.items() if not isinstance(v, FlatShard) or v.numel})


def _expert_offsets(model: nn.Module) -> dict[str, int]:
    """Canonical parameter name → global index of its first expert, for stacked expert tensors."""
    offsets = {}
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for pname, _ in module.named_parameters(recurse=False):
                offsets[f"{canonical_name(name)}.{pname}"] = module.expert_offset
    return offsets


def _barrier(group=None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _any_rank(flag: bool, group=None) -> bool:
    """Whether `flag` holds on any rank (an all-reduce of one CPU integer; alone: `flag`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


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


def _first_line(e: BaseException) -> str:
    """The informative line of a (possibly multi-rank, traceback-laden) DCP error."""
    text = str(e).strip()
    lines = [line.strip() for line in text.splitlines()]
    telling = [line for line in lines if any(k in line.lower() for k in ("mismatch", "missing key", "unexpected key"))]
    raised = [line for line in telling if re.match(r"^\w+(Error|Exception): ", line)]  # not a traceback's source line
    for line in raised + telling:
        return line.removeprefix("ValueError: ").removeprefix("RuntimeError: ")
    return lines[0] if text else type(e).__name__
