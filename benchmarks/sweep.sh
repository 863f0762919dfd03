#!/usr/bin/env bash
# Expert-count sweep at constant active parameters (bench-sweep-{8,16,32,64}: 8 micro-batches of
# 8192 tokens per step), full training steps and forward+backward alone (one process per preset:
# the two windows share the compiled model). Usage: PRESETS="bench-sweep-8 bench-sweep-16"
# ROUTING=random [EXTRA="--train.defer_expert_weight_grad=true"] bash benchmarks/sweep.sh
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
for p in ${PRESETS:-bench-sweep-8 bench-sweep-16 bench-sweep-32 bench-sweep-64}; do
  timeout 240 python -m moetrain bench "$p" --device cuda --warmup ${WARMUP:-2} --steps ${STEPS:-6} --routing ${ROUTING:-random} \
      --also-forward-backward ${EXTRA:-} 2>"$OUT/$p.err" | tee -a "$OUT/sweep.jsonl" \
    | python -c "import json,sys; [print('$p ${EXTRA:-}', r['timed'], r['routing'], round(r['tokens_per_sec_per_device']), round(100*r['mfu'],1), round(r['peak_mem_gib'],1), 'syncs', r['host_syncs_per_step']) for r in map(json.loads, sys.stdin)]"
  grep -m3 -i "error\|Traceback" "$OUT/$p.err"
done
