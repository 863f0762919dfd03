"""`GraphTables`' arena (src/moetrain/optim/triton_kernels.py): the device tables first needed
inside a CUDA graph capture are cut from memory set aside before the capture, never from the
graph's own pool, where a later allocation of the captured step could share their block."""

import pytest
import torch
from support.steps import run_in_triton_interpreter


def test_tables_cut_from_the_arena_are_aligned_apart_and_filled_after_the_capture():
    from moetrain.optim.triton_kernels import TABLE_ALIGN, GraphTables

    tables = GraphTables(torch.device("cpu"), arena_bytes=1024)
    values = [torch.arange(5, dtype=torch.int64) * 1000, torch.tensor([0, 3, 9], dtype=torch.int32)]
    cut = [tables.take(v) for v in values]
    for table, v in zip(cut, values):
        assert table.dtype == v.dtype and table.shape == v.shape
        assert table.untyped_storage().data_ptr() == tables.arena.untyped_storage().data_ptr()
        assert (table.data_ptr() - tables.arena.data_ptr()) % TABLE_ALIGN == 0
    assert cut[1].data_ptr() - cut[0].data_ptr() >= 5 * 8  # apart
    tables.upload_pending()
    assert all(torch.equal(t, v) for t, v in zip(cut, values)) and tables.pending == []


def test_a_table_that_does_not_fit_the_arena_fails_the_capture_naming_the_setting():
    from moetrain.optim.triton_kernels import GraphTables

    tables = GraphTables(torch.device("cpu"), arena_bytes=128)
    tables.take(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="TABLE_ARENA_BYTES"):
        tables.take(torch.zeros(16, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="TABLE_ARENA_BYTES"):
        GraphTables().take(torch.zeros(1, dtype=torch.int64))  # no arena: no table may be made


ARENA_KERNELS = r"""
import torch
import moetrain.optim.triton_kernels as tk
from moetrain.optim.split_master import split_fp32

torch.manual_seed(0)
grads = [torch.randn(n) for n in (5000, 37, 16384)] + [torch.randn(300).bfloat16()]
want = tk.sum_squares(grads)
tables = tk.GraphTables(torch.device("cpu"))

def from_arena(t, device):  # what a capture does, filled at once: the interpreter runs each launch now
    table = tables.take(t)
    tables.upload_pending()
    return table

tk._upload = from_arena
tk._int64_table_cached.cache_clear()
tk._first_blocks_cached.cache_clear()
got = tk.sum_squares(grads)
assert tables.used > 0 and torch.equal(got, want), (got, want)
print("ok")
"""


def test_the_table_kernels_read_tables_cut_from_the_arena_in_the_interpreter():
    """The norm's address-table kernel over bf16 and fp32 gradients gives the same bits with its
    tables (addresses, sizes, first blocks, int64 and int32) cut from the arena."""
    pytest.importorskip("triton")
    result = run_in_triton_interpreter(ARENA_KERNELS)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
