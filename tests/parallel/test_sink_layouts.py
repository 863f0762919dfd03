"""Attention sinks (model.attention_sinks) with local and global blocks and document masks under
data, expert, pipeline and context parallelism, on gloo CPU ranks: dp2·ep2, pp2 and cp2 reproduce
the single process over 5 steps, with the tolerances of tests/parallel/test_layouts.py."""

from support.distributed import run_distributed
from test_layouts import check, rank_layouts, single_run

SINKS = [
    "model.attention_sinks=true",
    "model.sliding_window=8",
    "model.attention_pattern=LG",
    "data.document_masking=true",
]
LAYOUTS = [("dp2ep2", ["parallel.ep=2"]), ("pp2", ["parallel.pp=2"]), ("cp2", ["parallel.cp=2"])]


def test_sink_layouts_match_single_process(real_text_dir, tmp_path):
    ref, params = single_run(real_text_dir, tmp_path / "single", *SINKS)
    layouts = [(name, [*SINKS, *extra]) for name, extra in LAYOUTS]
    results = run_distributed(rank_layouts, 2, real_text_dir, tmp_path / "ranks", layouts, params)
    for name, _ in LAYOUTS:
        check(results[0][name][0], ref)
        assert all(per_rank[name][1][0] <= 1.0 for per_rank in results), name
