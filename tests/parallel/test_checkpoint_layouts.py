"""A checkpoint written by one layout loads into any other and training continues with the same
losses (fp32, gloo): dp2·ep2 with the sharded optimizer → dp4·ep4 (replicated optimizer),
dp4·ep2 (sharded) and a single process."""

import shutil

import pytest

from moetrain.testing.distributed import run_distributed
from test_layouts import layout_cfg


def train(data_dir, run_dir, steps, extra, resume=False):
    from moetrain.train.trainer import Trainer

    cfg = layout_cfg(data_dir, run_dir, f"train.steps={steps}", "train.save_every=3", *extra)
    trainer = Trainer(cfg, resume=resume, quiet=True)
    start = trainer.step
    trainer.fit()
    return start


def train_layouts(data_dir, runs):
    import torch.distributed as dist

    starts = []
    for run_dir, extra in runs:
        starts.append(train(data_dir, run_dir, 6, extra, resume=True))
        dist.barrier()
    return starts


def losses(run_dir):
    from moetrain.train.metrics import read_metrics

    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


def test_checkpoint_written_at_one_layout_resumes_at_others(real_text_dir, tmp_path):
    source = tmp_path / "dp2ep2"
    run_distributed(train_layouts, 2, real_text_dir, [(source, ["parallel.ep=2", "parallel.shard_optimizer=true"])])
    assert (source / "checkpoints" / "step-3" / "COMPLETE").is_file()

    targets = {name: tmp_path / name for name in ("dp4ep4", "dp4ep2", "single")}
    for target in targets.values():
        shutil.copytree(source, target)
        shutil.rmtree(target / "checkpoints" / "step-6")  # resume from step 3
    starts = run_distributed(train_layouts, 4, real_text_dir, [
        (targets["dp4ep4"], ["parallel.ep=4"]), (targets["dp4ep2"], ["parallel.ep=2", "parallel.shard_optimizer=true"]),
    ])
    assert starts[0] == [3, 3]
    assert train(real_text_dir, targets["single"], 6, [], resume=True) == 3

    want = losses(source)
    for name, target in targets.items():
        got = losses(target)
        assert sorted(got) == list(range(1, 7)), name
        for step in (4, 5, 6):
            for key in ("lm_loss", "grad_norm", "lb_loss"):
                assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (name, step, key)
