"""Muon and Lion (optim.name=muon, lion) under every optimizer layout, on gloo CPU ranks:

- each reproduces the single process over 5 steps with the tolerances of
  tests/parallel/test_layouts.py: the replicated optimizer at dp2, dp2·ep2 and pp2; the sharded
  optimizer at dp2, dp2·ep2 and (Muon) dp4·ep2 (its matrices straddle shards); FSDP at dp2 and
  (Muon) dp4;
- a checkpoint of the sharded optimizer at dp2·ep2 resumes on one process and on FSDP;
- one rule's checkpoint does not resume another's run, and says why.
"""

import shutil

import pytest
from support.distributed import run_distributed

SHARD = "parallel.shard_optimizer=true"
FSDP = "parallel.stack=fsdp"
WORLD2 = [
    ("dp2", []),
    ("dp2ep2", ["parallel.ep=2"]),
    ("pp2", ["parallel.pp=2"]),
    ("dp2-sharded", [SHARD]),
    ("dp2ep2-sharded", ["parallel.ep=2", SHARD]),
    ("fsdp2", [FSDP]),
]
LAYOUTS = {
    ("muon", 2): WORLD2,
    ("muon", 4): [("dp4ep2-sharded", ["parallel.ep=2", SHARD]), ("fsdp4", [FSDP])],
    ("lion", 2): WORLD2,
}
"""(rule, world) → the layouts run on that many ranks."""


@pytest.fixture(scope="module")
def rule_results(real_text_dir, tmp_path_factory):
    """(rule, world) → (the single process's records, each rank's results of LAYOUTS[rule, world])."""
    from test_layouts import rank_layouts, single_run

    singles = {}

    def results(rule, world):
        if rule not in singles:
            singles[rule] = single_run(real_text_dir, tmp_path_factory.mktemp(f"{rule}-single"), f"optim.name={rule}")
        ref_records, params = singles[rule]
        tmp = tmp_path_factory.mktemp(f"{rule}-world{world}")
        layouts = [(name, [f"optim.name={rule}", *extra]) for name, extra in LAYOUTS[rule, world]]
        return ref_records, run_distributed(rank_layouts, world, real_text_dir, tmp, layouts, params)

    return results


@pytest.mark.parametrize("rule, world", sorted(LAYOUTS))
def test_every_optimizer_layout_steps_the_rule_as_one_process(rule_results, rule, world):
    from test_layouts import check

    ref_records, results = rule_results(rule, world)
    for name, _ in LAYOUTS[rule, world]:
        check(results[0][name][0], ref_records)
        for rank, per_rank in enumerate(results):
            assert per_rank[name][1][0] <= 1.0, (name, rank, per_rank[name][1])
    # the run moved: the rule's losses are not AdamW's (same data, same start)
    assert ref_records[-1]["lm_loss"] < ref_records[0]["lm_loss"]


def _resume(data_dir, run_dir, rule, extra, steps):
    import torch.distributed as dist
    from test_layouts import layout_cfg

    from moetrain.train.trainer import Trainer

    cfg = layout_cfg(data_dir, run_dir, f"optim.name={rule}", f"train.steps={steps}", "checkpoint.save_every=2", *extra)
    Trainer(cfg, resume=True, quiet=True).fit()
    if dist.is_initialized():
        dist.barrier()


@pytest.mark.parametrize("rule", ["muon", "lion"])
def test_a_checkpoint_of_the_sharded_optimizer_resumes_on_one_process_and_on_fsdp(real_text_dir, tmp_path, rule):
    from moetrain.train.metrics import read_metrics

    source = tmp_path / "sharded"
    run_distributed(_resume, 2, real_text_dir, source, rule, ["parallel.ep=2", SHARD], 4)
    want = {r["step"]: r["lm_loss"] for r in read_metrics(source / "metrics.jsonl")}
    for name, world, extra in (("single", 1, []), ("fsdp2", 2, [FSDP])):
        target = tmp_path / name
        shutil.copytree(source, target)
        shutil.rmtree(target / "checkpoints" / "step-4")  # resume from step 2
        run_distributed(_resume, world, real_text_dir, target, rule, extra, 4)
        got = {r["step"]: r["lm_loss"] for r in read_metrics(target / "metrics.jsonl")}
        for step in (3, 4):
            assert got[step] == pytest.approx(want[step], rel=1e-5), (name, step)


@pytest.mark.parametrize("saved, resumed", [("adamw", "muon"), ("muon", "adamw"), ("adamw", "lion"), ("lion", "muon")])
def test_one_optimizers_checkpoint_does_not_resume_the_other(real_text_dir, tmp_path, saved, resumed):
    from test_layouts import layout_cfg

    from moetrain.errors import CheckpointError
    from moetrain.train.trainer import Trainer

    run = tmp_path / "run"
    Trainer(
        layout_cfg(real_text_dir, run, f"optim.name={saved}", "train.steps=2", "checkpoint.save_every=2"), quiet=True
    ).fit()
    with pytest.raises(CheckpointError) as e:
        Trainer(layout_cfg(real_text_dir, run, f"optim.name={resumed}", "train.steps=4"), resume=True, quiet=True).fit()
    text = str(e.value)
    assert f"optim.name={saved}'s state" in text and f"this run has optim.name={resumed}" in text, text
    assert f"--optim.name={saved}" in text and "--checkpoint.init_from" in text, text
