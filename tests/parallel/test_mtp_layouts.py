"""Multi-token prediction (model.mtp_depth=2), with the normalized embedding (model.embedding_norm,
which the shifted embeddings go through too), under the layouts it supports, on gloo CPU ranks:
dp2·ep2, pp2 (the modules on the last stage, the shifted embeddings sent beside the hidden
state), pp2·dp2·ep2 with the sharded optimizer, and pp2 interleaved reproduce the single process
over 5 steps — losses (the logged multi-token one too), gradient norms and final parameters,
with the tolerances of tests/parallel/test_layouts.py."""

import pytest
from support.distributed import run_distributed
from test_layouts import check, rank_layouts, single_run

MTP = ["model.mtp_depth=2", "model.mtp_loss_weight=0.5", "model.embedding_norm=true"]
LAYOUTS = {
    2: [("dp2ep2", ["parallel.ep=2"]), ("pp2", ["parallel.pp=2"])],
    4: [
        ("pp2dp2ep2-sharded", ["parallel.pp=2", "parallel.ep=2", "parallel.shard_optimizer=true"]),
        ("pp2-interleaved", ["parallel.pp=2", "parallel.dp=2", "parallel.pp_schedule=interleaved-1f1b"]),
    ],
}


@pytest.fixture(scope="module")
def mtp_results(real_text_dir, tmp_path_factory):
    ref, params = single_run(real_text_dir, tmp_path_factory.mktemp("mtp-single"), *MTP)
    return ref, {
        world: run_distributed(
            rank_layouts,
            world,
            real_text_dir,
            tmp_path_factory.mktemp(f"mtp{world}"),
            [(name, [*MTP, *extra]) for name, extra in layouts],
            params,
        )
        for world, layouts in LAYOUTS.items()
    }


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_mtp_layouts_match_single_process(mtp_results, world):
    ref, results = mtp_results
    assert all("mtp_loss" in r for r in ref)
    for name, _ in LAYOUTS[world]:
        records = results[world][0][name][0]
        check(records, ref)
        for got, want in zip(records, ref):
            assert got["mtp_loss"] == pytest.approx(want["mtp_loss"], rel=1e-5), (name, got["step"])
        for rank, per_rank in enumerate(results[world]):
            assert per_rank[name][1][0] <= 1.0, (name, rank, per_rank[name][1])
