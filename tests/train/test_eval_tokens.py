"""train.eval_tokens: validation evaluates one fixed set of sequences, per token, whatever the
micro-batch, data-parallel or pipeline layout (the validation loss used to change with
train.micro_batch_size: 9.0209 at 24 sequences, 9.0251 at 12, same weights).

Tolerance: rel 1e-6. Batched differently, the same token losses are summed in another order and
grouping (each micro-batch's fp32 mean, rows of another height through the matrix products; the
batch means are then summed in float64): a few fp32 roundings, measured at ≤ 1e-7 relative. A
different set of sequences moves the loss by ~1e-4 relative or more (checked below), so the
tolerance tells them apart with room on both sides.
"""

import pytest
import torch
from conftest import tiny_overrides
from support.distributed import run_distributed

from moetrain.presets import resolve_config
from moetrain.train.callbacks import Evaluator
from moetrain.train.trainer import Trainer

REL = 1e-6
SEQ = 64  # data.seq_len of tiny_overrides
EVAL = [f"train.eval_tokens={11 * SEQ}"]  # 11 sequences: 8 + 3 at micro 8, 4 + 4 + 3 at 4, 5 × 2 + 1 at 2


def _cfg(data_dir, run_dir, *extra):
    return resolve_config("tiny", tiny_overrides(data_dir, run_dir, *EVAL, *extra))


def _val(trainer, data_dir, tmp_path, micro):
    """The validation loss of `trainer`'s current weights, batched by `micro` sequences."""
    cfg = _cfg(data_dir, tmp_path / "unused", f"train.micro_batch_size={micro}")
    return Evaluator(cfg, trainer.par.index("dp"), trainer.par.dims.dp)(trainer.engine)


def test_same_weights_same_validation_loss_whatever_the_micro_batch(real_text_dir, tmp_path):
    trainer = Trainer(_cfg(real_text_dir, tmp_path / "run"), quiet=True)
    for _ in range(3):
        trainer.train_step()
    losses = {micro: _val(trainer, real_text_dir, tmp_path, micro) for micro in (8, 4, 2, 1)}
    for loss in losses.values():
        assert loss == pytest.approx(losses[8], rel=REL), losses

    # Exactly the first 11 validation windows, each counted by its tokens: the mean of their
    # one-sequence losses.
    from moetrain.data.tokens import open_source

    val = open_source(trainer.cfg.data.val_path(), "val", seq_len=SEQ)
    per_sequence = []
    with torch.no_grad():
        trainer.engine.model.eval()
        for j in range(11):
            window_T1 = torch.from_numpy(val.window(j, SEQ).astype("int64"))[None]
            per_sequence.append(trainer.engine.lm_loss(window_T1[:, :-1], window_T1[:, 1:]).item())
        trainer.engine.model.train()
    assert losses[4] == pytest.approx(sum(per_sequence) / 11, rel=REL)

    # Another set of sequences is told apart at this tolerance.
    other = Evaluator(_cfg(real_text_dir, tmp_path / "unused", f"train.eval_tokens={8 * SEQ}"), 0, 1)(trainer.engine)
    assert other != pytest.approx(losses[4], rel=100 * REL)


def _rank_val_losses(data_dir, tmp_path, layouts):
    import torch.distributed as dist

    out = {}
    for name, extra in layouts:
        trainer = Trainer(_cfg(data_dir, tmp_path / name, "train.device=cpu", *extra), quiet=True)
        out[name] = {micro: _val(trainer, data_dir, tmp_path, micro) for micro in (4, 2)}
        dist.barrier()
    return out


def test_layouts_give_the_single_process_validation_loss(real_text_dir, tmp_path):
    """The same initial weights on 2 gloo ranks: dp 2 (11 sequences = full micro-batches + one
    row per rank + a last sequence beside a stand-in row), dp 2 with experts split over both
    (the exchange needs equal rows on both ranks), and two pipeline stages."""
    single = Trainer(_cfg(real_text_dir, tmp_path / "single"), quiet=True)
    reference = _val(single, real_text_dir, tmp_path, 4)
    layouts = [
        ("dp2", []),
        ("dp2ep2", ["parallel.ep=2", "parallel.capacity_factor=null"]),
        ("pp2", ["parallel.pp=2"]),
    ]
    results = run_distributed(_rank_val_losses, 2, real_text_dir, tmp_path, layouts)
    for rank_result in results:  # every rank returns the same mean
        for name, by_micro in rank_result.items():
            for micro, loss in by_micro.items():
                assert loss == pytest.approx(reference, rel=REL), (name, micro, loss, reference)


def test_an_earlier_runs_config_with_eval_batches_still_loads(capsys):
    """config.yaml of runs made before train.eval_tokens (eval, generate, export-hf read it)."""
    from moetrain.train.config import RunConfig

    cfg = RunConfig.from_dict({"train": {"eval_batches": 4, "steps": 7}})
    assert cfg.train.steps == 7 and cfg.train.eval_tokens == RunConfig().train.eval_tokens
    assert "train.eval_batches" in capsys.readouterr().err
