"""DCP planners for checkpoint entries a rank holds only part of (`FlatShard`, src/moetrain/optim/base.py).

A rank that holds elements [start, stop) of an entry in row-major order (a sharded optimizer's
bucket shard, FSDP's dim-0 shard) writes them as the few rectangular blocks that range is made of
(`flat_blocks`), at their offsets in the entry's global shape, and reads into the same blocks;
DCP's own planning then reshards (docs/architecture.md, "Checkpoints"):

    elements [5, 23) of a 4 × 8 tensor:   row 0: . . . . . # # #    block at (0, 5), size (1, 3)
                                           row 1: # # # # # # # #    block at (1, 0), size (1, 8)
                                           row 2: # # # # # # # .    block at (2, 0), size (1, 7)
                                           row 3: . . . . . . . .

Nothing is gathered: blocks are written from and read into views of the live state; a split fp32
master (optim.bf16_weights) is joined or split `PIECE` elements at a time.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.staging import AsyncStager
from torch.futures import Future

from moetrain.optim.base import FlatShard
from moetrain.optim.split_master import join, split_fp32
from moetrain.train.checkpoint_index import INDEX, write_index

PIECE = 1 << 16
"""Elements per join or split pass (their int32 intermediates: 256 KiB each)."""

Block = tuple[int, tuple[int, ...], tuple[int, ...]]
"""(first flat element, offsets, sizes): one rectangular block of a flat range."""


def flat_blocks(shape: tuple[int, ...], start: int, stop: int) -> list[Block]:
    """The rectangular blocks, in order, whose union is elements [start, stop) of a row-major
    tensor of `shape` (at most 2·ndim − 1 of them; each is contiguous in that order)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [(start, (start,) * len(shape), (stop - start,) * len(shape))]
    inner = math.prod(shape[1:])

    def in_row(row: int, a: int, b: int) -> list[Block]:
        return [(row * inner + f, (row, *o), (1, *s)) for f, o, s in flat_blocks(shape[1:], a, b)]

    first, last = start // inner, (stop - 1) // inner
    if first == last:
        return in_row(first, start - first * inner, stop - first * inner)
    full_from, full_to = -(-start // inner), stop // inner  # rows covered whole: [full_from, full_to)
    out = in_row(first, start % inner, inner) if start % inner else []
    if full_from < full_to:
        out.append((full_from * inner, (full_from,) + (0,) * (len(shape) - 1), (full_to - full_from, *shape[1:])))
    if stop % inner:
        out += in_row(full_to, 0, stop % inner)
    return out


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A `FlatShard` and its blocks, by offsets: (start within the shard, stop, sizes)."""

    shard: FlatShard
    blocks: dict[tuple[int, ...], tuple[int, int, tuple[int, ...]]]

    @classmethod
    def of(cls, shard: FlatShard) -> _Entry:
        blocks = flat_blocks(shard.shape, shard.start, shard.start + shard.numel)
        return cls(shard, {o: (f - shard.start, f - shard.start + math.prod(s), s) for f, o, s in blocks})

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, (_, _, s) in self.blocks.items()]

    def read(self, offsets) -> torch.Tensor:
        """The block at `offsets`: a view of the live values, or the split master joined."""
        a, b, sizes = self.blocks[tuple(offsets)]
        s = self.shard
        if s.values is not None:
            return s.values[a:b].view(sizes)
        return joined(s.hi[a:b], s.lo[a:b], s.hi.device).view(sizes)


def joined(hi_N: torch.Tensor, lo_N: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """The fp32 values of the split masters (hi, lo) in a new tensor on `device`, joined `PIECE`
    elements at a time."""
    out_N = torch.empty(hi_N.numel(), dtype=torch.float32, device=device)
    for a in range(0, out_N.numel(), PIECE):
        out_N[a : a + PIECE].copy_(join(hi_N[a : a + PIECE], lo_N[a : a + PIECE]))
    return out_N


def split_into(hi: torch.Tensor, lo: torch.Tensor, x: torch.Tensor) -> None:
    """Write fp32 `x` (a matrix's block, or part of one) into the halves `hi`, `lo` (views of x's
    shape, possibly strided), over slices of dim 0 of about `PIECE` elements."""
    rows = max(1, PIECE // max(1, math.prod(x.shape[1:])))
    for r in range(0, x.shape[0], rows):
        hi_part, lo_part = split_fp32(x[r : r + rows].to(device=hi.device, dtype=torch.float32))
        hi[r : r + rows].copy_(hi_part)
        lo[r : r + rows].copy_(lo_part)


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


def _take_shards(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, _Entry], dict]:
    """DCP's flattened state dict split into its plain entries and its `FlatShard`s (empty
    ones dropped), with DCP's mapping of flattened names back to the nested ones."""
    flat, mappings = flatten_state_dict(state_dict)
    shards = {k: _Entry.of(v) for k, v in flat.items() if isinstance(v, FlatShard) and v.numel}
    plain = {k: v for k, v in flat.items() if not isinstance(v, FlatShard)}
    return plain, shards, {k: v for k, v in mappings.items() if k in plain or k in shards}


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, and each `FlatShard` written as its blocks (offsets in the
    entry's global shape, so the stored entry is the same whatever the layout)."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        plain, self.shards, mappings = _take_shards(state_dict)
        super().set_up_planner(plain, storage_meta, is_coordinator)
        self.mappings = mappings  # the nested names, for the metadata (as DCP records them)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(chunk.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk, TensorProperties(dtype=entry.shard.dtype), torch.Size(entry.shard.shape)
                ),
            )
            for fqn, entry in self.shards.items()
            for chunk in entry.chunks()
        ]
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items], planner_data=self.mappings)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        entry = self.shards.get(index.fqn)
        return entry.read(index.offset) if entry is not None else super().lookup_object(index)

    def resolve_data(self, write_item: WriteItem):
        data = super().resolve_data(write_item)
        return _own_storage(data) if isinstance(data, torch.Tensor) else data


def _by_size(items: list[WriteItem], limit: int) -> list[list[WriteItem]]:
    """`items` in runs of at most `limit` tensor bytes (a larger item alone); at least one run, so
    a rank's first file exists even when it owns nothing."""
    groups: list[list[WriteItem]] = [[]]
    size = 0
    for item in items:
        data = item.tensor_data
        nbytes = 0 if data is None else math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU view into a larger storage as a tensor over just its own bytes: DCP's
    writer would clone it, and keep the clones until the rank's file is complete."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.ndim == 0 or t.untyped_storage().nbytes() == t.nbytes:
        return t
    alias = torch.from_numpy(t.detach().reshape(-1).view(torch.uint8).numpy())  # keeps `t` alive
    return alias.view(t.dtype).view(t.shape)


FILE_BYTES = 1 << 30
"""The most tensor bytes in one data file of a rank (a larger entry has a file of its own): DCP's
writer keeps its host copies until the file is complete, so saving takes one file's worth."""


class ShardWriter(FileSystemWriter):
    """DCP's file writer for the files of one rank, written without coordination: data files
    `__R_0.distcp`, `__R_pN_0.distcp`, … (at most `FILE_BYTES` each; a split master joined on the
    CPU, `__R_mN_0.distcp`, one per entry) and its own index `__R.metadata` (`merge_rank_indexes`)."""

    def __init__(self, path: str, rank: int):
        super().__init__(path)
        self.shard_rank = rank

    def prepare_local_plan(self, plan):
        self.fs.mkdir(self.path)
        return dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.shard_rank}_"))

    def prepare_global_plan(self, plans):
        return plans  # each keeps its rank's file prefix

    def write_data(self, plan, planner):
        shards = planner.shards if isinstance(planner, ShardSavePlanner) else {}

        def joined_on_cpu(item: WriteItem) -> bool:
            entry = shards.get(item.index.fqn)
            return entry is not None and entry.shard.values is None and entry.shard.hi.device.type == "cpu"

        base = plan.storage_data.prefix
        rest = _by_size([item for item in plan.items if not joined_on_cpu(item)], FILE_BYTES)
        joined = [[item] for item in plan.items if joined_on_cpu(item)]
        prefixes = [base if n == 0 else f"{base}p{n}_" for n in range(len(rest))]
        prefixes += [f"{base}m{n}_" for n in range(len(joined))]
        results = []
        for prefix, items in zip(prefixes, [*rest, *joined]):
            part = dataclasses.replace(plan, items=items, storage_data=_StoragePrefix(prefix))
            results += super().write_data(part, planner).wait()
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata, results) -> None:
        """This rank's index: the plan's metadata and where each item went."""
        storage = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata = dataclasses.replace(metadata, storage_data=storage, storage_meta=self.storage_meta())
        write_index(Path(self.path) / f"__{self.shard_rank}{INDEX}", metadata)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, and each `FlatShard` read block by block: into the live values
    in place, or for a split master through a temporary of one read's size, split at once."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        plain, self.shards, _ = _take_shards(state_dict)
        super().set_up_planner(plain, metadata, is_coordinator)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items: list[ReadItem] = []
        for fqn, entry in self.shards.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                raise RuntimeError(f"Missing key in checkpoint state_dict: {fqn}.")
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != entry.shard.shape:
                saved = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "no tensor"
                raise ValueError(f"Size mismatch between saved {saved} and current: {entry.shard.shape} for {fqn}")
            items += create_read_items_for_chunk_list(fqn, md, entry.chunks())
        return dataclasses.replace(plan, items=[*plan.items, *items])

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        entry = self.shards.get(read_item.dest_index.fqn)
        if entry is None:
            return super().resolve_tensor(read_item)
        if entry.shard.values is not None:
            return _narrow(entry.read(read_item.dest_index.offset), read_item.dest_offsets, read_item.lengths)
        return torch.empty(tuple(read_item.lengths), dtype=torch.float32, device=entry.shard.hi.device)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        entry = self.shards.get(read_item.dest_index.fqn)
        if entry is None or entry.shard.values is not None:
            return super().commit_tensor(read_item, tensor)
        a, b, sizes = entry.blocks[tuple(read_item.dest_index.offset)]
        hi, lo = (
            _narrow(half[a:b].view(sizes), read_item.dest_offsets, read_item.lengths)
            for half in (entry.shard.hi, entry.shard.lo)
        )
        split_into(hi, lo, tensor)


class CpuStager(AsyncStager):
    """Staging for `dcp.async_save`: a host copy of every entry (split masters joined), so
    training may change the live state while the copy is written."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return _to_cpu(state_dict)


def _to_cpu(value):
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, FlatShard):
        if value.values is not None:
            return dataclasses.replace(value, values=value.values.to("cpu", copy=True))
        out = joined(value.hi, value.lo, "cpu")
        return FlatShard(value.shape, value.start, values=out, replicated=value.replicated)
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value
