"""A rehearsed rank (src/moetrain/parallel/rehearsal.py: one process, its peers stand-ins) is the real
rank: rank r of dp2·ep2, of pp2·dp2·ep2 interleaved with the sharded optimizer, of the fsdp
stack (dp4) and of cp2·dp2·ep2 (context parallel, document-masked), rehearsed alone, against
rank r of a real 4-process gloo run of the same layout — the same operators with the same output
shapes and dtypes from the trainer's construction through two training steps (every allocation
and kernel: parameters, optimizer shards, gradient buckets, the dispatcher's buffers), the same
collectives with the same payloads (the buckets' reductions, the all-to-alls' send buffers), the
same parameter and optimizer-shard shapes, and the same checkpoint shard file (its entries, their
places and sizes)."""

import json

import pytest
import torch
from support.distributed import run_alone, run_distributed
from test_layouts import layout_cfg

LAYOUTS = {
    "dp2·ep2": (["parallel.ep=2"], 3),
    "pp2·dp2·ep2 interleaved, sharded optimizer": (
        ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.ep=2", "parallel.shard_optimizer=true"],
        2,
    ),
    "fsdp4": (["parallel.stack=fsdp"], 1),
    "cp2·dp2·ep2, document masking": (["parallel.cp=2", "parallel.ep=2", "data.document_masking=true"], 1),
}


def rank_fingerprint(data_dir, run_dir, extra, rehearse_rank=None):
    """What this rank ran and holds (see the module docstring); `rehearse_rank`: rehearse that
    rank of 4 alone."""
    import torch.distributed as dist
    from support.op_trace import RankTrace

    from moetrain.parallel.fsdp import is_sharded
    from moetrain.parallel.rehearsal import Rehearsal
    from moetrain.train.checkpoint_index import SafeFileSystemReader
    from moetrain.train.trainer import Trainer

    rehearsal = None if rehearse_rank is None else Rehearsal(world=4, rank=rehearse_rank)
    cfg = layout_cfg(data_dir, run_dir, "train.steps=2", *extra)
    with RankTrace() as trace:
        trainer = Trainer(cfg, quiet=True, rehearsal=rehearsal)
        for _ in range(2):
            trainer.train_step()
    rank = trainer.par.rank
    params = [
        (name, tuple(p.to_local().shape if is_sharded(p) else p.shape), str(p.dtype))
        for name, p in trainer.engine.model.named_parameters()
    ]
    opt = trainer.engine.optimizer

    def described(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype))
        return ("shard", value.shape, value.start, value.numel, str(value.dtype), value.replicated)

    shards = {name: {key: described(v) for key, v in entry.items()} for name, entry in opt.checkpoint_tensors().items()}
    masters = {name: described(v) for name, v in opt.checkpoint_masters().items()}
    path = trainer.save()
    if dist.is_initialized() and not trainer.par.rehearsed:
        dist.barrier()
    metadata = SafeFileSystemReader(str(path)).read_metadata()
    mine = sorted(
        (index.fqn, tuple(index.offset), info.relative_path, info.offset, info.length)
        for index, info in metadata.storage_data.items()
        if info.relative_path.startswith(f"__{rank}_")
    )
    files = sorted((p.name, p.stat().st_size) for p in path.glob(f"__{rank}_*.distcp"))
    return {
        "rank": rank,
        "ops": trace.ops,
        "collectives": trace.collectives,
        "params": params,
        "optimizer": (shards, masters, opt.memory_bytes(), opt.grad_bytes()),
        "shard_file": (mine, files),
        "trainer_state": json.loads((path / "trainer_state.json").read_text()),
    }


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"at {i}: real {x} / rehearsed {y}"
    return f"lengths {len(a)} / {len(b)}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_rehearsed_rank_is_the_real_rank(real_text_dir, tmp_path, layout):
    extra, r = LAYOUTS[layout]
    ranks = run_distributed(rank_fingerprint, 4, real_text_dir, tmp_path / "real", extra)
    real = ranks[r]
    if "pp2" in layout:  # the trace tells ranks apart: pipeline rank 0 holds other stages than rank 1
        assert ranks[0]["ops"] != ranks[r]["ops"] and ranks[0]["params"] != ranks[r]["params"]
    alone = run_alone(rank_fingerprint, real_text_dir, tmp_path / "rehearsed", extra, r)
    assert alone["rank"] == real["rank"] == r
    assert len(real["ops"]) > 1000 and any("mm" in op for op, _ in real["ops"])  # the trace saw the work
    assert alone["ops"] == real["ops"], _first_difference(real["ops"], alone["ops"])
    assert real["collectives"] and alone["collectives"] == real["collectives"], _first_difference(
        real["collectives"], alone["collectives"]
    )
    assert alone["params"] == real["params"]
    assert alone["optimizer"] == real["optimizer"]
    assert real["shard_file"][0] and alone["shard_file"] == real["shard_file"]
    assert alone["trainer_state"].pop("rehearsal") == {"world": 4, "rank": r}
    assert "rehearsal" not in real["trainer_state"]


def _rehearse_then_resume(data_dir, run_dir):
    from moetrain.parallel.rehearsal import Rehearsal
    from moetrain.train.trainer import Trainer

    cfg = layout_cfg(data_dir, run_dir, "train.steps=2", "parallel.ep=2", "checkpoint.save_final=true")
    Trainer(cfg, quiet=True, rehearsal=Rehearsal(world=4, rank=1)).fit()
    cfg = layout_cfg(data_dir, run_dir, "train.steps=3", "parallel.ep=2")
    return Trainer(cfg, resume=True, quiet=True, rehearsal=Rehearsal(world=4, rank=1)).step


def test_a_rehearsal_resumes_from_its_own_checkpoint(real_text_dir, tmp_path):
    """It holds one rank's entries: not the whole model a plain resume must find."""
    assert run_alone(_rehearse_then_resume, real_text_dir, tmp_path / "run") == 2
