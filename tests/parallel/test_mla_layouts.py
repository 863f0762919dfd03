"""Multi-head latent attention (model.attention=mla, both latents, values narrower than the query
and key heads) in a DeepSeek-V3-like block (sigmoid routing with the aux-free bias, a shared
expert) under data, expert, pipeline and context parallelism, on gloo CPU ranks: dp2, dp2·ep2,
pp2, cp2 and cp2·dp2·ep2 reproduce the single process over 5 steps — losses, gradient norms and
final parameters, with the tolerances of tests/parallel/test_layouts.py; so does dp2·ep2 with
DeepSeek-V3's group-limited routing and routed scale."""

import pytest
from support.distributed import run_distributed
from test_layouts import check, rank_layouts, single_run

MLA = [
    "model.attention=mla",
    "model.q_lora_rank=32",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=16",
    "model.qk_rope_head_dim=8",
    "model.v_head_dim=12",
    "model.qk_norm=false",
    "model.moe.gating=sigmoid",
    "model.moe.shared_hidden=32",
]
LAYOUTS = {
    2: [
        ("dp2", ["parallel.ep=1"]),
        ("dp2ep2", ["parallel.ep=2"]),
        ("pp2", ["parallel.pp=2"]),
        ("cp2", ["parallel.cp=2"]),
    ],
    4: [("cp2dp2ep2", ["parallel.cp=2", "parallel.ep=2"])],
}
GROUPED = [*MLA, "model.moe.n_groups=4", "model.moe.topk_groups=3", "model.moe.routed_scale=2.5"]
"""Each token's 4 experts from its best 3 of 4 groups of 2 (a group lies on one expert-parallel rank)."""


@pytest.fixture(scope="module")
def mla_results(real_text_dir, tmp_path_factory):
    ref, params = single_run(real_text_dir, tmp_path_factory.mktemp("mla-single"), *MLA)
    return ref, {
        world: run_distributed(
            rank_layouts,
            world,
            real_text_dir,
            tmp_path_factory.mktemp(f"mla{world}"),
            [(name, [*MLA, *extra]) for name, extra in layouts],
            params,
        )
        for world, layouts in LAYOUTS.items()
    }


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_mla_layouts_match_single_process(mla_results, world):
    ref, results = mla_results
    for name, _ in LAYOUTS[world]:
        check(results[world][0][name][0], ref)
        for rank, per_rank in enumerate(results[world]):
            assert per_rank[name][1][0] <= 1.0, (name, rank, per_rank[name][1])


def test_grouped_routing_under_dp2_ep2_matches_single_process(real_text_dir, tmp_path):
    ref, params = single_run(real_text_dir, tmp_path / "single", *GROUPED)
    layouts = [("dp2ep2", [*GROUPED, "parallel.ep=2"])]
    results = run_distributed(rank_layouts, 2, real_text_dir, tmp_path / "ranks", layouts, params)
    check(results[0]["dp2ep2"][0], ref)
    assert all(per_rank["dp2ep2"][1][0] <= 1.0 for per_rank in results)
