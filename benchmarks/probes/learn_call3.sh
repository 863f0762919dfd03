# Issue 55 call 3: two of moetrain's runs of the learning comparison (benchmarks/learning, the
# settings of call 1's Olmo-core side), one after the other in one device call, each under its own
# budget: RUNS="name:overrides;name:overrides" (overrides separated by spaces), written to $OUT/name/.
#   RUNS="olmolike:--model.init_output_std=0.01 --model.embedding_norm=true;fp8:... --train.fp8=rowwise" \
#     bash benchmarks/probes/learn_call3.sh
export PYTHONUNBUFFERED=1
ROOT=$OUT
IFS=';' read -ra ITEMS <<< "$RUNS"
for item in "${ITEMS[@]}"; do
  name=${item%%:*}; extra=${item#*:}
  mkdir -p "$ROOT/$name"
  OUT=$ROOT/$name SKIP_INSTALL=1 SIDES=moetrain PARALLEL=0 BUDGET_S=${EACH_S:-280} MT_EXTRA="$extra" \
    bash benchmarks/learning/learn_call.sh 2>&1 | grep -v "^\[env\]\|olmo_core\|ModuleNotFoundError\|Traceback\|File \"" | tail -6
  rm -f "$ROOT/$name/moetrain-run/config.yaml"
  grep -h '"val_loss"' "$ROOT/$name/moetrain-run/metrics.jsonl" 2>/dev/null | python3 -c "
import sys, json
print('$name', [(r['step'], round(r['val_loss'], 3)) for r in map(json.loads, sys.stdin)])"
done
