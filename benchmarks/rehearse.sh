#!/usr/bin/env bash
# One rank of an N-GPU layout, rehearsed on this one GPU (moetrain bench --rehearse: its compute,
# device time by kernel kind, peak memory while training, saving and loading its checkpoint
# shard; communication modelled by the planner) — one JSON line per row in $OUT/rehearse.jsonl
# and a table at the end (benchmarks/rehearse_table.py).
#
#   ROWS="sweep-8l-8|--parallel.ep=8 sweep-8l-128|--parallel.ep=8" WORLD=8 bash benchmarks/rehearse.sh
#
# A row is PRESET|FLAGS (flags joined by commas, e.g. "sweep-8l-8|--parallel.ep=8,--optim.grad_dtype=bf16").
# CKPT (default: /tmp/moetrain-rehearse; /dev/shm on a machine whose disk is small) is where each row's
# checkpoint is written; it is removed after the row (its profile's kinds.json and, with
# --train.profile=true, ops.txt are kept as $OUT/rowN-*).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
WORLD=${WORLD:-8}
CKPT=${CKPT:-/tmp/moetrain-rehearse}
source "$(dirname "$0")/rehearse_row.sh"
n=0
for row in $ROWS; do
  n=$((n + 1))
  preset=${row%%|*}; flags=${row#*|}; [ "$flags" = "$row" ] && flags=""
  flags=${flags//,/ }
  echo "== row $n: $preset $flags" >&2
  rehearse_row "row$n" python -m moetrain bench "$preset" --rehearse "$WORLD" ${RANK:+--rank $RANK} --device cuda \
      --warmup ${WARMUP:-2} --steps ${STEPS:-5} --routing ${ROUTING:-random} --run-dir "$CKPT/run" $flags
done
python benchmarks/rehearse_table.py "$OUT/rehearse.jsonl"
