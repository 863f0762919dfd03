"""The pieces of checkpoints that never gather (src/moetrain/train/dcp_shards.py): flat ranges as
rectangular blocks, `FlatShard` windows, split masters joined and split exactly, and one-process
DCP round trips between shards and whole tensors. The multi-rank save/load paths are checked in
tests/parallel/test_checkpoint_layouts.py and, for their memory, tests/test_plan.py."""

import itertools
import math
import random

import pytest
import torch

from moetrain.errors import CheckpointError
from moetrain.optim.base import FlatShard
from moetrain.optim.split_master import join, split_fp32
from moetrain.train import dcp_shards
from moetrain.train.checkpoint_io import load_checkpoint, save_checkpoint
from moetrain.train.dcp_shards import flat_blocks
from moetrain.train.run_dir import resolve_checkpoint


def _row_major(shape, offsets, sizes):
    index = []
    for pos in itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes))):
        index.append(sum(p * math.prod(shape[d + 1 :]) for d, p in enumerate(pos)))
    return index


def test_a_flat_range_is_the_union_of_at_most_2_ndim_minus_1_contiguous_blocks():
    rng = random.Random(0)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        start = rng.randint(0, math.prod(shape))
        stop = rng.randint(start, math.prod(shape))
        blocks = flat_blocks(shape, start, stop)
        covered = []
        for first, offsets, sizes in blocks:
            elements = _row_major(shape, offsets, sizes)
            assert elements == list(range(first, first + math.prod(sizes))), (shape, start, stop, blocks)
            covered += elements
        assert covered == list(range(start, stop)), (shape, start, stop, blocks)
        assert len(blocks) <= max(1, 2 * len(shape) - 1)


def test_a_window_is_the_part_of_a_shard_inside_one_expert():
    values = torch.arange(10.0)
    shard = FlatShard((4, 2, 3), 7, values=values)  # elements 7..16 of four 2×3 experts
    first, second, third = (shard.window(i * 6, (i + 1) * 6, (2, 3)) for i in (1, 2, 3))
    assert (first.start, first.values.tolist()) == (1, [0.0, 1.0, 2.0, 3.0, 4.0])
    assert (second.start, second.values.tolist()) == (0, [5.0, 6.0, 7.0, 8.0, 9.0])
    assert third.numel == 0
    assert shard.window(0, 6, (2, 3)).numel == 0


def test_joins_and_splits_in_pieces_are_exact(monkeypatch):
    monkeypatch.setattr(dcp_shards, "PIECE", 7)  # many pieces, one partial
    x = torch.randn(5, 13) * torch.logspace(-30, 30, 13)
    hi, lo = split_fp32(x)
    out = dcp_shards.joined(hi.flatten(), lo.flatten(), "cpu")
    assert torch.equal(out.view(5, 13).view(torch.int32), x.view(torch.int32))
    hi2, lo2 = torch.zeros_like(hi), torch.zeros_like(lo)
    box = (slice(1, 4), slice(2, 11))  # strided views, as a read into part of a block
    dcp_shards.split_into(hi2[box], lo2[box], x[box].contiguous())
    assert torch.equal(join(hi2[box], lo2[box]), x[box])
    assert not hi2[0].any() and not lo2[:, :2].any()


def _save(path, state):
    save_checkpoint(path, 1, state, {"step": 1})
    return resolve_checkpoint(path)


def test_shards_and_whole_tensors_load_into_each_other(tmp_path):
    """Whole tensors saved load into a split master and a values shard of the same entries, and
    back, bit for bit (the entries stay whole tensors of their global shape)."""
    w = torch.randn(6, 5)
    m = torch.randn(3, 4).to(torch.bfloat16)
    path = _save(tmp_path / "a", {"model": {"w": w.clone(), "m": m.clone()}})

    hi, lo = torch.zeros(30, dtype=torch.bfloat16), torch.zeros(30, dtype=torch.int16)
    values = torch.zeros(12)
    load_checkpoint(path, {"model": {"w": FlatShard((6, 5), 0, hi=hi, lo=lo), "m": FlatShard((3, 4), 0, values)}})
    assert torch.equal(join(hi, lo).view(6, 5), w) and torch.equal(values.view(3, 4), m.float())

    path = _save(
        tmp_path / "b", {"model": {"w": FlatShard((6, 5), 0, hi=hi, lo=lo), "m": FlatShard((3, 4), 0, values)}}
    )
    back = {"w": torch.zeros(6, 5), "m": torch.zeros(3, 4)}
    load_checkpoint(path, {"model": back})
    assert torch.equal(back["w"], w) and torch.equal(back["m"], m.float())


def test_a_shard_of_another_shape_or_a_missing_entry_is_a_clear_error(tmp_path):
    path = _save(tmp_path / "a", {"model": {"w": torch.randn(6, 5)}})
    with pytest.raises(CheckpointError, match="different model shape") as e:
        load_checkpoint(path, {"model": {"w": FlatShard((5, 6), 0, values=torch.zeros(30))}})
    assert "mismatch" in str(e.value) and "Traceback" not in str(e.value)
    with pytest.raises(CheckpointError, match="(?i)missing key"):
        load_checkpoint(path, {"model": {"v": FlatShard((6, 5), 0, values=torch.zeros(30))}})


def test_a_rank_writes_files_of_at_most_file_bytes_so_its_host_copies_stay_one_file_worth(tmp_path, monkeypatch):
    """DCP keeps the host copy of every tensor it writes until that tensor's file is complete:
    a rank's entries go to files of at most `FILE_BYTES` (a larger entry alone; a split master
    joined on the CPU a file each), and load back bit for bit."""
    monkeypatch.setattr(dcp_shards, "FILE_BYTES", 400)
    entries = {f"t{i}": torch.randn(n) for i, n in enumerate([30, 40, 50, 200, 10, 10])}  # fp32: 4 bytes each
    w = torch.randn(6, 5)
    hi, lo = split_fp32(w.flatten())
    state = {k: v.clone() for k, v in entries.items()} | {"w": FlatShard((6, 5), 0, hi=hi, lo=lo)}
    path = _save(tmp_path / "a", {"model": state})
    files = sorted(p.name for p in path.glob("*.distcp"))
    assert files == ["__0_0.distcp", "__0_m0_0.distcp", "__0_p1_0.distcp", "__0_p2_0.distcp", "__0_p3_0.distcp"]
    by_file = {}
    for fqn, (name, nbytes) in _stored(path).items():
        by_file.setdefault(name, []).append((fqn, nbytes))
    assert sorted(by_file) == files
    for name, items in by_file.items():
        assert len(items) == 1 or sum(n for _, n in items) <= 400, (name, items)
    assert by_file["__0_p2_0.distcp"] == [("model.t3", 800)] and by_file["__0_m0_0.distcp"] == [("model.w", 120)]
    back = {k: torch.zeros_like(v) for k, v in entries.items()} | {"w": torch.zeros(6, 5)}
    load_checkpoint(path, {"model": back})
    assert all(torch.equal(back[k], v) for k, v in entries.items()) and torch.equal(back["w"], w)


def _stored(path) -> dict[str, tuple[str, int]]:
    """fqn → (data file, tensor bytes) from the merged index."""
    import pickle

    metadata = pickle.loads((path / ".metadata").read_bytes())
    out = {}
    for index, where in metadata.storage_data.items():
        md = metadata.state_dict_metadata[index.fqn]
        nbytes = math.prod(md.size) * md.properties.dtype.itemsize
        out[index.fqn] = (where.relative_path, nbytes)
    return out
