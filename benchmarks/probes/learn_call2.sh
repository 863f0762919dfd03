# Issue 55 call 2: moetrain's side of the learning comparison (benchmarks/learning, the settings of
# call 1's Olmo-core side), then `moetrain check-layout` as one process on the GPU (the reference
# against itself: the GPU's run-to-run floor under the bf16 tolerances).
export PYTHONUNBUFFERED=1
SKIP_INSTALL=1 SIDES=moetrain PARALLEL=0 BUDGET_S=${BUDGET_S:-500} bash benchmarks/learning/learn_call.sh 2>&1 \
  | grep -v "^\[env\]\|olmo_core\|ModuleNotFoundError\|Traceback\|File \"" | tail -12
rm -f "$OUT/moetrain-run/config.yaml"
timeout 80 env PYTHONPATH=$PWD/src python3 -m moetrain check-layout tiny --device cuda --steps 5 --json \
  > "$OUT/check-layout-gpu.json" 2> "$OUT/check-layout-gpu.err"
echo "check-layout rc=$?"; tail -c 600 "$OUT/check-layout-gpu.err"
python3 -c "
import json; r = json.load(open('$OUT/check-layout-gpu.json'))
print(r['ok'], r['precision'], {k: (v['first_step_rel_diff'], v['later_max_rel_diff']) for k, v in r['quantities'].items()})
" 2>&1 | tail -3
