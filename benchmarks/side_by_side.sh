#!/usr/bin/env bash
# Olmo-core 3.0.0 and moetrain on the same GPU, same shapes, in one call (docs/benchmarks.md).
# Set up once (shared/anchor/README.md): .anchor/ holds bench_olmocore.py, run_on_gpu.sh and whl/.
# Usage: CFGS="ddp-8e ddp-small32e" ABUDGET=330 PRESETS="bench-8e bench-small32e" bash benchmarks/side_by_side.sh
# Results: $OUT/olmocore.jsonl (the anchor) and $OUT/moetrain.jsonl (moetrain bench), tables on stdout.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
python -c "import torch; print('torch', torch.__version__)"
CONFIGS="$CFGS" BUDGET_S=${ABUDGET:-330} OUT=$OUT bash .anchor/run_on_gpu.sh 2>&1 | grep -v "^\[env\]" | tail -12
for p in $PRESETS; do
  timeout 200 python -m moetrain bench "$p" --device cuda --warmup 5 --steps 15 2>"$OUT/$p.err" | tee -a "$OUT/moetrain.jsonl" \
    | python -c "import json,sys; [print('moetrain', '$p', r['routing'], round(r['tokens_per_sec_per_device']), round(100*r['mfu'],1), round(r['peak_mem_gib'],1), 'syncs', r['host_syncs_per_step']) for r in map(json.loads, sys.stdin)]"
  grep -i "error\|Traceback" "$OUT/$p.err" | head -3
done
