"""Peak memory of `moetrain export-hf`: how much a process grows while exporting a checkpoint,
against the checkpoint's size and against loading the model once (`load_for_inference`).

    python benchmarks/export_memory.py --dir /tmp/export-memory --max-shard-size 5GB 1GB 200MB

writes a checkpoint of a random GLM-shaped model (sigmoid top-4, one shared expert, × k, the
first block dense; d_model 1024, 64 experts of 1024, 4 layers: 0.66B parameters, 2.6 GB fp32),
then runs each export (bf16) and the reference in a fresh process, and prints one JSON line
each. The growth is VmHWM − VmRSS after the imports (/proc/self/status: the process's own peak,
which ru_maxrss is not in a child).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from moetrain.model.config import Gating
from moetrain.presets import preset
from moetrain.train.checkpoint_io import model_state_dict, save_checkpoint
from moetrain.train.config import RunConfig
from moetrain.train.run_dir import resolve_checkpoint

PROBE = """
import json, re, sys
def grown(before=None):
    status = open("/proc/self/status").read()
    rss, peak = (int(re.search(k + r":\\s+(\\d+) kB", status).group(1)) * 1024 for k in ("VmRSS", "VmHWM"))
    return rss if before is None else peak - before
if sys.argv[1] == "export":
    from moetrain.hf import export_hf
    before = grown()
    summary = export_hf(sys.argv[2], sys.argv[3], max_shard_size=sys.argv[4])
    print(json.dumps({"files": len(summary["files"]), "exported_bytes": summary["bytes"], "grew_bytes": grown(before)}))
else:
    from moetrain.inference import load_for_inference
    before = grown()
    load_for_inference(sys.argv[2])
    print(json.dumps({"grew_bytes": grown(before)}))
"""


def write_checkpoint(run: Path, args) -> int:
    base = preset("tiny").model
    m = dataclasses.replace(
        base,
        vocab_size=8192,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.d_model // 128,
        n_kv_heads=max(1, args.d_model // 512),
        moe=dataclasses.replace(
            base.moe,
            num_experts=args.experts,
            expert_hidden=args.expert_hidden,
            shared_hidden=args.expert_hidden,
            gating=Gating.sigmoid,
            restore_weight_scale=True,
        ),
    )
    cfg = RunConfig(model=m)
    model = m.build(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for buf in model.buffers():
            buf.zero_()
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    tokenizer = run / "tokenizer.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(tokenizer))
    extra = {"config.yaml": run / "config.yaml", "tokenizer.json": tokenizer}
    save_checkpoint(run, 0, {"model": model_state_dict(model)}, {"step": 0}, extra_files=extra)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/export-memory"))
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--expert-hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-shard-size", nargs="+", default=["5GB", "1GB", "200MB"])
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    run = args.dir / "run"
    parameters = write_checkpoint(run, args)
    stored = sum(f.stat().st_size for f in resolve_checkpoint(run).glob("*.distcp"))
    print(json.dumps({"parameters": parameters, "checkpoint_bytes": stored}))
    for size in args.max_shard_size:
        start = time.time()
        command = [sys.executable, "-c", PROBE, "export", str(run), str(args.dir / f"hf-{size}"), size]
        out = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        print(json.dumps({"max_shard_size": size, **out, "seconds": round(time.time() - start, 1)}))
    command = [sys.executable, "-c", PROBE, "load", str(run)]
    out = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    print(json.dumps({"load_for_inference": True, **out}))


if __name__ == "__main__":
    main()
