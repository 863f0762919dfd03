#!/usr/bin/env bash
# Where the step's time goes, per shape: `moetrain bench` with the profiler on for 2 steps after
# the timed window; the op table (sorted by device time) of each lands in $OUT/ops-PRESET.txt, the
# device ms per step by kernel kind in $OUT/kinds-PRESET.json (printed), the idle time and the host
# operators it waited for in $OUT/idle-PRESET.txt (printed; benchmarks/trace_overlap.py --gaps).
# Usage: PRESETS="bench-tiny64e-l6 bench-small32e" bash benchmarks/profile_shapes.sh
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
for p in ${PRESETS:-bench-tiny64e-l6 bench-small32e bench-sweep-8 bench-sweep-64}; do
  timeout ${BT:-200} python -m moetrain bench "$p" --device cuda --warmup 3 --steps 5 --routing ${ROUTING:-learned} \
      --train.profile=true --train.profile_steps=2 --run-dir "/tmp/prof-$p" ${EXTRA:-} 2>"/tmp/prof-$p.err" \
    | python -c "import json,sys; [print('$p', r['routing'], round(r['tokens_per_sec_per_device']), round(100*r['mfu'],1), round(r['peak_mem_gib'],1)) for r in map(json.loads, sys.stdin)]"
  grep -m3 -i "error" "/tmp/prof-$p.err"
  cp "/tmp/prof-$p/profile-${ROUTING:-learned}/ops.txt" "$OUT/ops-$p.txt" 2>/dev/null && head -25 "$OUT/ops-$p.txt" | cut -c1-160
  cp "/tmp/prof-$p/profile-${ROUTING:-learned}/kinds.json" "$OUT/kinds-$p.json" 2>/dev/null && echo "$p kinds (ms/step) $(cat "$OUT/kinds-$p.json")"
  # the idle time between kernels, and the host operators whose kernels it waited for
  python benchmarks/trace_overlap.py "/tmp/prof-$p/profile-${ROUTING:-learned}/trace.json" --steps 2 --gaps 12 \
    | tee "$OUT/idle-$p.txt"
done
