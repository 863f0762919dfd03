"""benchmarks/probes/micro_batch_graph_probe.py's module is the engine's micro-batch (it reaches
into `TrainEngine`'s helpers, so a change there must show here before a GPU run does): the same
loss and gradient norm as `lm_loss` times the backward scale, on CPU."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_probes_micro_batch_module_is_the_engines_micro_batch(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "benchmarks/probes"))
    from micro_batch_graph_probe import MicroBatchLoss, _one

    from moetrain.bench import BENCH_OVERRIDES
    from moetrain.presets import resolve_config
    from moetrain.train.trainer import Trainer

    cfg = resolve_config("tiny", BENCH_OVERRIDES + [f"train.run_dir={tmp_path}", "train.device=cpu"])
    trainer = Trainer(cfg, quiet=True)
    engine = trainer.engine
    engine.model.train()
    inputs_BT, targets_BT = trainer.next_batches()[0]
    probe = _one(engine, MicroBatchLoss(engine), inputs_BT, targets_BT)
    plain = _one(engine, lambda x, y: engine.lm_loss(x, y) * engine.model.runtime.backward_scale, inputs_BT, targets_BT)
    assert probe == plain and probe[1] > 0
