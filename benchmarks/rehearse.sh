#!/usr/bin/env bash
# One rank of an N-GPU layout, rehearsed on this one GPU (moetrain bench --rehearse: its compute,
# device time by kernel kind, peak memory while training, saving and loading its checkpoint
# shard; communication modelled by the planner) — one JSON line per row in $OUT/rehearse.jsonl
# and a table at the end (benchmarks/rehearse_table.py).
#
#   ROWS="sweep-8l-8|--parallel.ep=8 sweep-8l-128|--parallel.ep=8" WORLD=8 bash benchmarks/rehearse.sh
#
# A row is PRESET|FLAGS (flags joined by commas, e.g. "sweep-8l-8|--parallel.ep=8,--optim.grad_dtype=bf16").
# CKPT (default: /dev/shm when it has room for the largest shard, else /tmp) is where each row's
# checkpoint is written; it is removed after the row.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
WORLD=${WORLD:-8}
CKPT=${CKPT:-/tmp/moetrain-rehearse}
for row in $ROWS; do
  preset=${row%%|*}; flags=${row#*|}; [ "$flags" = "$row" ] && flags=""
  flags=${flags//,/ }
  name="$preset${flags// /}"; name=${name//[^A-Za-z0-9._=-]/_}
  rm -rf "$CKPT"; mkdir -p "$CKPT"
  echo "== $preset $flags" >&2
  timeout ${ROW_TIMEOUT:-420} python -m moetrain bench "$preset" --rehearse "$WORLD" ${RANK:+--rank $RANK} --device cuda \
      --warmup ${WARMUP:-2} --steps ${STEPS:-5} --routing ${ROUTING:-random} --run-dir "$CKPT/run" $flags \
      2>"$OUT/$name.err" | tee -a "$OUT/rehearse.jsonl" >/dev/null
  tail -n 3 "$OUT/$name.err" | grep -i "error\|Traceback\|Killed" >&2
  rm -rf "$CKPT"
done
python benchmarks/rehearse_table.py "$OUT/rehearse.jsonl"
