"""A checkpoint written by one layout loads into any other and training continues with the same
losses (fp32, gloo): dp2·ep2 with the sharded optimizer → dp4·ep4 (replicated optimizer),
dp4·ep2 (sharded) and a single process; and across stacks: fsdp2 → ddp dp2·ep2 → fsdp2, fsdp2 →
a single process; and across pipeline layouts: dp4·ep4 → pp2·dp2·ep2 → pp2 interleaved and one
process. Each rank writes and reads only its own parts of the entries; a dp4·ep2 sharded run with
bf16 weights loads bit for bit into replicated, sharded, fsdp, pipeline and one-process layouts,
with fp32 weights or bf16 ones."""

import shutil

import pytest
import torch
from conftest import tiny_overrides
from support.distributed import run_distributed
from test_layouts import layout_cfg


def train(data_dir, run_dir, steps, extra, resume=False):
    from moetrain.train.trainer import Trainer

    cfg = layout_cfg(data_dir, run_dir, f"train.steps={steps}", "checkpoint.save_every=3", *extra)
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
    starts = run_distributed(
        train_layouts,
        4,
        real_text_dir,
        [
            (targets["dp4ep4"], ["parallel.ep=4"]),
            (targets["dp4ep2"], ["parallel.ep=2", "parallel.shard_optimizer=true"]),
        ],
    )
    assert starts[0] == [3, 3]
    assert train(real_text_dir, targets["single"], 6, [], resume=True) == 3

    want = losses(source)
    for name, target in targets.items():
        got = losses(target)
        assert sorted(got) == list(range(1, 7)), name
        for step in (4, 5, 6):
            for key in ("lm_loss", "grad_norm", "lb_loss"):
                assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (name, step, key)


FSDP = "parallel.stack=fsdp"
# Evaluation too: FSDP's root keeps its parameters gathered after a no-grad forward, and a save
# follows it.
EVERY_2 = ["checkpoint.save_every=2", "train.eval_every=2", "train.eval_tokens=256"]  # 8 sequences of 32


def _fork(source, target, keep_through):
    """Copy a run directory, keeping only its checkpoints up to step `keep_through`."""
    shutil.copytree(source, target)
    for step_dir in (target / "checkpoints").iterdir():
        if int(step_dir.name.removeprefix("step-")) > keep_through:
            shutil.rmtree(step_dir)


def _ddp_then_fsdp(data_dir, ddp_dir, fsdp_dir):
    """fsdp checkpoint → ddp (dp2·ep2) run; that run's checkpoint → fsdp run."""
    import torch.distributed as dist

    starts = [train(data_dir, ddp_dir, 6, ["parallel.ep=2", *EVERY_2], resume=True)]
    dist.barrier()
    if dist.get_rank() == 0:
        _fork(ddp_dir, fsdp_dir, keep_through=4)
    dist.barrier()
    starts.append(train(data_dir, fsdp_dir, 6, [FSDP, *EVERY_2], resume=True))
    return starts


def _fsdp_then_ddp_then_fsdp(data_dir, source, ddp_dir, fsdp_dir, single_dir):
    """The fsdp2 source run; its step-2 checkpoint forked for the ddp run and the single process;
    then `_ddp_then_fsdp` (one spawned group for all three runs)."""
    import torch.distributed as dist

    source_start = train_layouts(data_dir, [(source, [FSDP, *EVERY_2])])
    complete = (source / "checkpoints" / "step-2" / "COMPLETE").is_file()
    if dist.get_rank() == 0:
        _fork(source, ddp_dir, keep_through=2)
        _fork(source, single_dir, keep_through=2)
    dist.barrier()
    return source_start, complete, _ddp_then_fsdp(data_dir, ddp_dir, fsdp_dir)


def test_checkpoints_cross_the_fsdp_and_ddp_stacks(real_text_dir, tmp_path):
    """Checkpoint keys do not depend on the stack: an fsdp2 checkpoint resumes in the ddp stack
    and in one process, and a ddp checkpoint resumes in the fsdp stack, with the same losses."""
    source = tmp_path / "fsdp2"
    ddp, back, single = tmp_path / "ddp", tmp_path / "fsdp-from-ddp", tmp_path / "single"
    source_start, complete, starts = run_distributed(
        _fsdp_then_ddp_then_fsdp, 2, real_text_dir, source, ddp, back, single
    )[0]
    assert source_start == [0] and complete  # the source run was fresh and its step-2 checkpoint is whole
    assert starts == [2, 4]
    assert train(real_text_dir, single, 6, EVERY_2, resume=True) == 2

    assert_continues(source, [(ddp, 3), (single, 3), (back, 5)])


def assert_continues(source, resumed):
    """Each resumed run logged steps 1-6 and, from its first resumed step on, the source run's
    losses, gradient norms and (on evaluation steps, every 2nd) validation losses."""
    want = losses(source)
    for target, first in resumed:
        got = losses(target)
        assert sorted(got) == list(range(1, 7)), target.name
        for step in range(first, 7):
            for key in ("lm_loss", "grad_norm", "lb_loss") + (("val_loss",) if step % 2 == 0 else ()):
                assert got[step][key] == pytest.approx(want[step][key], rel=1e-5), (target.name, step, key)


PP = "parallel.pp=2"


def _dp4ep4_then_pipeline(data_dir, source, pp_dir):
    """dp4·ep4 run (checkpoints at 2, 4, 6); its step-2 checkpoint → pp2·dp2·ep2 (sharded)."""
    import torch.distributed as dist

    train(data_dir, source, 6, ["parallel.ep=4", *EVERY_2], resume=True)
    dist.barrier()
    if dist.get_rank() == 0:
        _fork(source, pp_dir, keep_through=2)
    dist.barrier()
    return train(data_dir, pp_dir, 6, [PP, "parallel.ep=2", "parallel.shard_optimizer=true", *EVERY_2], resume=True)


def test_checkpoints_cross_pipeline_layouts(real_text_dir, tmp_path):
    """dp4·ep4 → pp2·dp2·ep2 → pp2 interleaved (two stages per rank) and → one process: each
    resumes where the last left off, with the same training and validation losses (a pipeline
    rank writes and reads only its stages' entries; evaluation runs through the stages)."""
    source, pp_dir = tmp_path / "dp4ep4", tmp_path / "pp2dp2ep2"
    starts = run_distributed(_dp4ep4_then_pipeline, 4, real_text_dir, source, pp_dir)
    assert starts == [2, 2, 2, 2]
    interleaved, single = tmp_path / "pp2-interleaved", tmp_path / "single"
    _fork(pp_dir, interleaved, keep_through=4)
    _fork(pp_dir, single, keep_through=4)
    starts = run_distributed(
        train_layouts,
        2,
        real_text_dir,
        [
            (interleaved, [PP, "parallel.pp_schedule=interleaved-1f1b", *EVERY_2]),
        ],
    )
    assert starts[0] == [4]
    assert train(real_text_dir, single, 6, EVERY_2, resume=True) == 4

    # The pipeline ranks' final checkpoint is a whole model: `eval`/`generate` load it in one
    # process, equal to the single-process run's.
    from moetrain.inference import load_for_inference

    from_pp, _, _ = load_for_inference(interleaved)
    from_single, _, _ = load_for_inference(single)
    got, ref = from_pp.state_dict(), from_single.state_dict()
    assert got.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-5, msg=key)

    assert_continues(source, [(pp_dir, 3), (interleaved, 5), (single, 5)])


def _pipeline_then_deeper(data_dir, run_dir, new_dir):
    """pp2 for 2 steps, then a resume and a checkpoint.init_from of 6 layers: what each rank
    says of each (both stages hold 3)."""
    from moetrain.errors import CheckpointError
    from moetrain.train.trainer import Trainer

    train(data_dir, run_dir, 2, [PP, "checkpoint.save_final=true"])
    said = []
    for where, resume, extra in ((run_dir, True, []), (new_dir, False, [f"checkpoint.init_from={run_dir}"])):
        try:
            Trainer(
                layout_cfg(data_dir, where, PP, "train.steps=4", "model.n_layers=6", *extra), resume=resume, quiet=True
            )
            said.append("loaded")
        except CheckpointError as e:
            said.append(str(e))
    return said


def test_a_pipeline_load_into_more_layers_is_refused_on_every_rank(real_text_dir, tmp_path):
    """Stage 0 holds blocks the checkpoint has: it must refuse as stage 1 does, not go on
    alone (it would then write the run's config.yaml and wait on its stopped peer)."""
    said = run_distributed(_pipeline_then_deeper, 2, real_text_dir, tmp_path / "pp2", tmp_path / "new")
    assert all("has no tensor model.blocks.4." in message for rank in said for message in rank), said
    assert "n_layers: 4" in (tmp_path / "pp2" / "config.yaml").read_text()
    assert not (tmp_path / "new").exists()


BF16_SHARDED = ["parallel.shard_optimizer=true", "precision.dtype=bf16", "optim.bf16_weights=true"]
# Loaded from a dp4·ep2 sharded run with bf16 weights, on the same four ranks.
RESHARD_TARGETS = {
    "dp4 replicated, fp32 weights": [],
    "dp4·ep4 sharded, fp32 weights": ["parallel.ep=4", "parallel.shard_optimizer=true"],
    "fsdp4": [FSDP],
    "pp2·dp2·ep2 sharded, bf16 weights": [PP, "parallel.ep=2", *BF16_SHARDED],
}


def _whole_state(engine, run_dir) -> dict:
    """Every entry of `engine`'s state, whole, as its checkpoint under `run_dir` holds it (all
    ranks save and read it back: `saved_state`), as (dtype, shape, bytes)."""
    from support.steps import saved_state

    return {f"{s}/{k}": _bits(v) for s, entries in saved_state(engine, run_dir).items() for k, v in entries.items()}


def _bits(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    return str(t.dtype), tuple(t.shape), t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _save_sharded_then_load_everywhere(data_dir, run_dir):
    import torch.distributed as dist
    from support.steps import synthetic_batches

    from moetrain.presets import resolve_config
    from moetrain.train.checkpoint_io import load_checkpoint, save_checkpoint
    from moetrain.train.engine import TrainEngine
    from moetrain.train.runtime import setup_runtime

    def engine(*extra):
        cfg = resolve_config("tiny", tiny_overrides(data_dir, run_dir, "train.device=cpu", *extra))
        return cfg, TrainEngine(cfg, setup_runtime(cfg).par, torch.device("cpu"))

    rank = dist.get_rank()
    cfg, source = engine("parallel.ep=2", *BF16_SHARDED)
    for step in range(2):
        source.train_step(synthetic_batches(cfg, step, rank, rows=1), step)
    path = save_checkpoint(run_dir, 2, source.checkpoint_state(), {"step": 2})
    out = {"source": _whole_state(source, run_dir / "whole" / "source")}
    for name, extra in RESHARD_TARGETS.items():
        _, target = engine(*extra)
        load_checkpoint(path, target.checkpoint_state())
        target.checkpoint_loaded()
        out[name] = _whole_state(target, run_dir / "whole" / name)
    return out


def test_a_sharded_bf16_weights_checkpoint_loads_bit_for_bit_into_every_layout(real_text_dir, tmp_path):
    """dp4·ep2, sharded optimizer, bf16 weights: each rank saves its ranges of the fp32 masters
    (joined from the bf16 weights and its remainders) and of the moments. A second save of the
    run stores the same entries; and dp4 with fp32 weights, dp4·ep4 sharded, fsdp4, pp2·dp2·ep2
    with bf16 weights and one process with bf16 weights each load exactly those values (what each
    saves in turn is the stored checkpoint, bit for bit)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from moetrain.parallel.dims import ParallelDims, ParallelState
    from moetrain.presets import resolve_config
    from moetrain.train.checkpoint_io import load_checkpoint
    from moetrain.train.engine import TrainEngine
    from moetrain.train.run_dir import resolve_checkpoint

    run_dir = tmp_path / "run"
    results = run_distributed(_save_sharded_then_load_everywhere, 4, real_text_dir, run_dir)
    path = resolve_checkpoint(run_dir)
    dcp_to_torch_save(str(path), str(tmp_path / "saved.pt"))
    saved = {
        f"{s}/{k}": _bits(v) for s, entries in torch.load(tmp_path / "saved.pt").items() for k, v in entries.items()
    }

    cfg = resolve_config("tiny", tiny_overrides(real_text_dir, tmp_path / "one", "train.device=cpu", *BF16_SHARDED[1:]))
    one = TrainEngine(cfg, ParallelState(ParallelDims(world_size=1, dp=1, ep=1)), torch.device("cpu"))
    load_checkpoint(path, one.checkpoint_state())
    one.checkpoint_loaded()
    layouts = {name: [by_rank[name] for by_rank in results] for name in ["source", *RESHARD_TARGETS]}
    layouts["one process, bf16 weights"] = [_whole_state(one, tmp_path / "one" / "whole")]
    for name, ranks in layouts.items():
        held = {}
        for entries in ranks:
            held.update(entries)
        assert held.keys() == saved.keys(), (name, sorted(held.keys() ^ saved.keys())[:5])
        for key, value in held.items():
            assert value == saved[key], (name, key)
