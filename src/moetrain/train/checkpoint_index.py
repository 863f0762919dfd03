"""A checkpoint's DCP index (`.metadata`): merged from the ranks' own when written
(`merge_rank_indexes`), read without running code (`SafeFileSystemReader`), and checked against
the files (`diagnose`) and the model (`first_mismatch`) before anything is loaded.

A checkpoint marked COMPLETE can still be damaged later (a file deleted or cut short, an
interrupted copy), and DCP would then fail half-way through a load from deep inside. `diagnose`
checks what the index promises, reading only the index and the files' sizes:

    .metadata              exists and parses (with the allow-list: nothing it names runs)
    every storage file     the index references exists and is at least as long as the largest
                           offset + length the index reads from it
    trainer_state.json     exists and parses; rng-rank*.json parse
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from moetrain.errors import CheckpointError
from moetrain.optim.base import FlatShard
from moetrain.optim.config import OptimizerName

INDEX = ".metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its index, and loading a pickle can run any code it names: this unpickler
    resolves only the classes an index holds (DCP's metadata records, torch.Size, dtypes, layout
    helpers, paths), so a tampered checkpoint cannot execute code when it is loaded."""

    _MODULES = {
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.filesystem",
        "torch.distributed.checkpoint.planner",
    }
    _NAMES = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        *(("pathlib", p) for p in ("PosixPath", "PurePosixPath", "Path", "WindowsPath", "PureWindowsPath")),
        *(("builtins", b) for b in ("set", "frozenset", "slice")),
    }

    def find_class(self, module: str, name: str):
        value = getattr(torch, name, None) if module == "torch" else None
        if (
            (module in self._MODULES and not name.startswith("__"))
            or (module, name) in self._NAMES
            or isinstance(value, torch.dtype | torch.memory_format | torch.layout)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which a checkpoint index never holds")


class _SafePickle:
    """Stands in for the `pickle` module inside DCP's filesystem reader while it reads metadata."""

    def __getattr__(self, name):
        return getattr(pickle, name)

    @staticmethod
    def load(file, **kwargs):
        return _MetadataUnpickler(file).load()


def merge_rank_indexes(step_dir: Path, world: int, whole: bool = True) -> None:
    """Merge the ranks' indexes (`__R.metadata`, R < `world`) into `.metadata` and remove them.
    Identical chunks are kept once; with `whole` every tensor must be covered by its chunks."""
    entries: dict[str, Any] = {}
    storage: dict = {}
    planner_data: dict = {}
    first = None
    seen: set[tuple] = set()  # (name, offsets, sizes) of the chunks kept
    for rank in range(world):
        path = step_dir / f"__{rank}{INDEX}"
        if not path.is_file():
            raise CheckpointError(f"rank {rank} wrote no index ({path} is missing)")
        with path.open("rb") as f:
            md = _MetadataUnpickler(f).load()
        first = first or md
        for fqn, meta in md.state_dict_metadata.items():
            if not isinstance(meta, TensorStorageMetadata):
                entries.setdefault(fqn, meta)
                continue
            entries.setdefault(fqn, TensorStorageMetadata(properties=meta.properties, size=meta.size, chunks=[]))
            for chunk in meta.chunks:
                if (key := (fqn, tuple(chunk.offsets), tuple(chunk.sizes))) not in seen:
                    seen.add(key)
                    entries[fqn].chunks.append(chunk)
        storage.update({index: info for index, info in md.storage_data.items() if index not in storage})
        planner_data.update(md.planner_data or {})
    for fqn, meta in entries.items():
        if whole and isinstance(meta, TensorStorageMetadata):
            held = sum(math.prod(c.sizes) for c in meta.chunks)
            if held != math.prod(meta.size):
                raise CheckpointError(
                    f"entry {fqn} was stored incompletely ({held} of {math.prod(meta.size)} elements): no rank wrote "
                    "the rest"
                )
    merged = dataclasses.replace(first, state_dict_metadata=entries, storage_data=storage, planner_data=planner_data)
    write_index(step_dir / INDEX, merged)
    for rank in range(world):
        (step_dir / f"__{rank}{INDEX}").unlink()


def write_index(path: Path, metadata: Metadata) -> None:
    """`metadata` pickled to `path` through a temporary file, synced, then renamed into place."""
    tmp = path.with_name(f"{path.name}.tmp")
    with tmp.open("wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class SafeFileSystemReader(dcp.FileSystemReader):
    """`dcp.FileSystemReader` reading its metadata with `_MetadataUnpickler` (the tensor data
    with torch.load(weights_only=True) already)."""

    def read_metadata(self, *args, **kwargs):
        import torch.distributed.checkpoint.filesystem as fs_module

        real = fs_module.pickle
        fs_module.pickle = _SafePickle()
        try:
            return super().read_metadata(*args, **kwargs)
        finally:
            fs_module.pickle = real


def read_index(path: str | Path) -> tuple[Metadata | None, str | None]:
    """(the index, None), or (None, why it cannot be read)."""
    index = Path(path) / INDEX
    if not index.is_file():
        return None, f"its index {index} is missing"
    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata()
    except pickle.UnpicklingError as e:
        if "a checkpoint index never holds" in str(e):
            named = str(e).split("checkpoint metadata names ")[1].split(",")[0]
            return None, (
                f"its index {index} was refused: it names code to run ({named}), which a checkpoint never "
                "needs. The file was tampered with or is not a moetrain checkpoint; nothing was executed"
            )
        return None, f"its index {index} does not parse ({e})"
    except Exception as e:  # noqa: BLE001 (truncated or garbage: any failure to parse is the same damage)
        return None, f"its index {index} does not parse ({type(e).__name__}: {e})"
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        return None, f"its index {index} does not parse (it is not a DCP index with storage records)"
    return metadata, None


def diagnose(path: str | Path) -> str | None:
    """None when the checkpoint `path` is intact as far as its index tells, else what is damaged."""
    path = Path(path)
    metadata, damage = read_index(path)
    if damage is not None:
        return damage
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{file} is missing (its index {INDEX} references it)"
        size = file.stat().st_size
        if size < end:
            return f"{file} is truncated: {size} bytes, but its index {INDEX} reads up to byte {end}"
    state = path / "trainer_state.json"
    if not state.is_file():
        return f"{state} is missing"
    for file in [state, *sorted(path.glob("rng-rank*.json"))]:
        try:
            json.loads(file.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            return f"{file} does not parse as JSON ({e})"
    return None


def _rule_of(keys: Iterable[str]) -> OptimizerName | None:
    """The update rule whose state the optimizer entries among `keys` ("optim.NAME.STATE", "/E"
    after it for expert E) hold: the last in `OptimizerName`'s order whose tensors they all name
    (Muon's state holds AdamW's too, for the parameters Muon does not take)."""
    held = {key.partition("/")[0].rpartition(".")[2] for key in keys if key.startswith("optim.")}
    found = [name for name in OptimizerName if set(name.state) - {"step"} <= held]
    return found[-1] if found else None


def _other_optimizer(wanted: Iterable[str], stored: dict[str, Any]) -> str | None:
    """The sentence saying the checkpoint holds another update rule's state than `wanted`'s."""
    mine, theirs = _rule_of(wanted), _rule_of(stored)
    if mine is None or theirs is None or mine == theirs:
        return None
    return (
        f"it holds optim.name={theirs}'s state ({', '.join(theirs.state)}) and this run has optim.name={mine}, "
        f"which keeps {', '.join(mine.state)}: resume with --optim.name={theirs}, or start a new run from its "
        "weights with --checkpoint.init_from"
    )


def first_mismatch(metadata: Metadata, state: dict[str, dict[str, Any]]) -> str | None:
    """The first entry of `state` that the checkpoint does not hold with the same global shape,
    as a sentence; None when all fit."""
    stored = metadata.state_dict_metadata
    for section, entries in state.items():
        for name, value in entries.items():
            key = f"{section}.{name}"
            md = stored.get(key)
            if not isinstance(value, torch.Tensor | FlatShard):
                continue
            want = tuple(value.shape)
            if md is None:
                if section == "optim" and not any(k.startswith("optim.") for k in stored):
                    return (
                        "it holds model weights only, no optimizer state (an import-hf or weights-only "
                        "checkpoint): start from it with --checkpoint.init_from instead of --resume"
                    )
                return _other_optimizer([f"optim.{n}" for n in state.get("optim", {})], stored) or (
                    f"it has no tensor {key} (a missing key), which this model has: it was saved from a different model"
                )
            if not isinstance(md, TensorStorageMetadata):
                return f"its entry {key} is not a tensor: it was saved from a different model"
            if tuple(md.size) != want:
                return (
                    f"tensor {key} has shape {tuple(md.size)} in the checkpoint but {want} in this model "
                    "(a shape mismatch): it was saved from a different model shape"
                )
    return None


def unexpected(metadata: Metadata, names: Iterable[str]) -> list[str]:
    """The checkpoint's model entries outside `names` (a whole model's)."""
    names = set(names)
    return [k for k in metadata.state_dict_metadata if k.startswith("model.") and k[len("model.") :] not in names]


def first_unexpected(metadata: Metadata, names: Iterable[str]) -> str | None:
    """`unexpected` as a resume's refusal; None when the checkpoint holds none."""
    extra = unexpected(metadata, names)
    if not extra:
        return None
    more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
    return (
        f"it holds tensor {extra[0]}{more}, which this model lacks (an unexpected key): it was saved from a different "
        "model (more layers, or a part this config leaves out), and resuming would drop them. To train this model "
        "from the weights both hold, start a new run with --checkpoint.init_from"
    )
