#!/usr/bin/env bash
# Throughput and peak memory of bench-8e under each activation-recompute mode, and a profile of
# the plain step (docs/benchmarks.md). Usage: bash benchmarks/recompute.sh
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
for r in none selective full; do
  extra=""; [ "$r" = none ] && extra="--train.profile=true --train.profile_steps=2"
  timeout 130 python -m moetrain bench bench-8e --device cuda --warmup 3 --steps 6 --routing learned \
      --train.recompute=$r $extra --run-dir /tmp/b-$r 2>"$OUT/r-$r.err" | tee -a "$OUT/recompute.jsonl" \
    | python -c "import json,sys; [print('8e recompute=$r', round(r['tokens_per_sec_per_device']), round(100*r['mfu'],1), round(r['peak_mem_gib'],1), r['host_syncs_per_step']) for r in map(json.loads, sys.stdin)]"
done
cp /tmp/b-none/profile-learned/ops.txt "$OUT/ops-8e.txt" 2>/dev/null && head -30 "$OUT/ops-8e.txt" | cut -c1-150
