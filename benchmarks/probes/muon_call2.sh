# Issues 54 item 1 and 55: Muon on one GPU, one device call (~520 s; carry ["data/default"]):
# 1. Newton–Schulz with its symmetric products one triangle at a time against today's iteration
#    (benchmarks/probes/ns_symmetric_probe.py: bench-small32e's expert matrices, a dp8·ep8
#    bench-8e rank's), JSON lines in $OUT/ns_symmetric.jsonl;
# 2. the 1,000-step Muon curve of the learning comparison (bench-small32e as shipped, the same
#    tokens and settings as its AdamW row), under EACH_S seconds, in $OUT/muon/.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${NS_S:-150} python benchmarks/probes/ns_symmetric_probe.py --reps 5 | tee $OUT/ns_symmetric.jsonl \
  | python -c "import json,sys; [print(r['k'], r['S'], r['L'], 'today', round(r['today_ms'], 2), 'ms', round(r['today_tflops']), 'TFLOP/s; triangle', round(r['best_sym_ms'], 2), 'ms', r['best_config'], 'x%.3f' % r['speedup'], 'diff %.1e' % r['rel_diff']) for r in map(json.loads, sys.stdin)]"
EACH_S=${EACH_S:-345} RUNS="muon:--optim.name=muon" bash benchmarks/probes/learn_call3.sh
