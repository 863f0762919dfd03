#!/usr/bin/env bash
# CUDA graphs on one GPU (train.cuda_graphs): the GPU tests of the step graph, the
# step graph's probe (the captured step beside the eager run, and with its address tables from the
# graph's pool as when its replays faulted), then each preset's training step eager and replayed
# from the step graph, one process each, pairs in one call (calls differ by up to 4%), learned
# routing. SWEEP=1 adds bench-sweep-8 and bench-sweep-64 (random routing, forward+backward too) eager,
# with the step graph, and with the step graph and the deferred expert weight gradients.
# PROFILE=1 adds each preset's profile with the step graph (benchmarks/profile_shapes.sh). AUTO=1
# adds each preset with train.cuda_graphs=auto: what it chose (captured or eager) and the times why.
# Usage: [PRESETS="bench-small32e bench-8e"] [FP8=1] [SWEEP=1] [PROFILE=1] [AUTO=1] [CHECKS=0] bash benchmarks/cuda_graphs.sh
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
if [ "${CHECKS:-1}" = 1 ]; then  # CHECKS=0: the timings alone
  timeout 300 python -m pytest -q -p no:cacheprovider tests/gpu/test_cuda.py -k "graph or replayed" 2>&1 | tail -4
  timeout 300 python benchmarks/probes/step_graph_probe.py --variants eager,full,pool_tables | tee "$OUT/step_graph_probe.jsonl" | cut -c1-300
fi
bench() {  # bench PRESET ROUTING LABEL [overrides]
  local p=$1 routing=$2 label=$3; shift 3
  timeout ${BT:-200} python -m moetrain bench "$p" --device cuda --warmup ${WARMUP:-5} --steps ${STEPS:-15} --routing "$routing" \
      "$@" 2>"$OUT/graphs-$p-$label.err" | tee -a "$OUT/cuda_graphs.jsonl" \
    | python -c "import json,sys; [print('$p $label', r['timed'], round(r['tokens_per_sec_per_device']), round(1000*r['step_time_s'],2), 'ms', round(r['peak_mem_gib'],2), 'GiB syncs', r['host_syncs_per_step'], r['cuda_graph_counts'], r['cuda_graphs'], r['cuda_graphs_why'] or '') for r in map(json.loads, sys.stdin)]"
  grep -m3 -i "error\|Traceback" "$OUT/graphs-$p-$label.err"
}
for p in ${PRESETS-bench-small32e bench-tiny64e-l6 bench-8e}; do  # PRESETS= (empty): none
  bench "$p" learned off --train.cuda_graphs=off
  bench "$p" learned step --train.cuda_graphs=step
  if [ "${AUTO:-0}" = 1 ]; then bench "$p" learned auto --train.cuda_graphs=auto; fi
done
if [ "${FP8:-0}" = 1 ]; then
  bench bench-8e learned fp8-off --train.fp8=rowwise --train.cuda_graphs=off
  bench bench-8e learned fp8-step --train.fp8=rowwise --train.cuda_graphs=step
fi
if [ "${SWEEP:-0}" = 1 ]; then
  for p in bench-sweep-8 bench-sweep-64; do
    WARMUP=2 STEPS=6 BT=300 bench "$p" random off --also-forward-backward --train.cuda_graphs=off
    WARMUP=2 STEPS=6 BT=300 bench "$p" random step --also-forward-backward --train.cuda_graphs=step
    WARMUP=2 STEPS=6 BT=300 bench "$p" random step-deferred --also-forward-backward --train.cuda_graphs=step \
      --train.defer_expert_weight_grad=true
  done
fi
if [ "${PROFILE:-0}" = 1 ]; then
  PRESETS="${PRESETS:-bench-small32e bench-tiny64e-l6 bench-8e}" EXTRA="--train.cuda_graphs=step" bash benchmarks/profile_shapes.sh
fi
