#!/usr/bin/env bash
# The busiest rank of each scripts/launch/ref-*.sh layout, rehearsed on this one GPU
# (`bash scripts/launch/NAME.sh rehearse`): one JSON line per layout in $OUT/rehearse.jsonl, each
# row's stderr, kinds.json and ops.txt beside it, and the table (benchmarks/rehearse_table.py).
#
#   REFS="ref-tiny-64e ref-large-128e:16" bash benchmarks/rehearse_refs.sh
#
# NAME:L rehearses the layout with the model cut to L blocks (--model.n_layers=L), for the layouts
# whose busiest rank does not fit this GPU whole. CKPT (default /tmp/moetrain-rehearse) holds each
# row's run directory and checkpoint until the row ends; WARMUP, STEPS, PROFILE_STEPS as below.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
CKPT=${CKPT:-/tmp/moetrain-rehearse}
source "$(dirname "$0")/rehearse_row.sh"
ROW_TIMEOUT=${ROW_TIMEOUT:-540}
for ref in $REFS; do
  name=${ref%%:*}; layers=${ref#*:}; [ "$layers" = "$ref" ] && layers=""
  echo "== $name${layers:+ with $layers blocks}" >&2
  rehearse_row "$name${layers:+-l$layers}" bash "scripts/launch/$name.sh" rehearse --device cuda --warmup ${WARMUP:-1} \
      --steps ${STEPS:-3} --routing ${ROUTING:-random} --run-dir "$CKPT/run" \
      --train.profile_steps=${PROFILE_STEPS:-1} ${layers:+--model.n_layers=$layers}
done
python benchmarks/rehearse_table.py "$OUT/rehearse.jsonl"
