"""Which op makes a training step wait on the host?

Runs two `tiny` steps (compilation, allocation), then one under CUDA's sync debug mode "error"
with anomaly mode on (NaN checks off: they read values on the host themselves), so a sync in
backward is reported with the forward traceback of the node that made it.

Usage (on a GPU machine): python benchmarks/probes/sync_probe.py [key=value …], e.g. train.compile=true
"""

import sys
import traceback

import torch

from moetrain.presets import resolve_config
from moetrain.train.trainer import Trainer

overrides = sys.argv[1:]
cfg = resolve_config(
    "tiny",
    [
        "train.device=cuda",
        "train.run_dir=/tmp/sync-probe",
        "train.tensorboard=false",
        "train.plot=false",
        "data.synthetic=true",
        *overrides,
    ],
)
trainer = Trainer(cfg, quiet=True)
for _ in range(2):
    trainer.train_step()
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
try:
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        trainer.train_step()
    print(f"SYNC-FREE training step ({overrides})")
except RuntimeError as e:
    print(f"SYNC in the step ({overrides}): {str(e)[:300]}")
    traceback.print_exc()
finally:
    torch.cuda.set_sync_debug_mode(0)
