#!/usr/bin/env bash
# FP8 (train.fp8=rowwise) on one GPU: the kernels against the CPU emulation and a sync-free step
# (tests/gpu), bench-8e throughput and memory FP8 vs BF16, and FP8 vs BF16 loss curves over 250
# steps on the embedded corpus (needs data/default: carry it). Usage: bash benchmarks/fp8.sh
# PAIRS="bench-sweep-16 bench-sweep-64" bash benchmarks/fp8.sh: only BF16 against FP8 (the defaults)
# on each preset named, learned routing, one process each (the sweep presets: 2 warm-up, 6 timed steps).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${PAIRS:-}" ]; then
  for p in $PAIRS; do
    case $p in bench-sweep-*) w=2; n=6 ;; *) w=5; n=15 ;; esac
    for fp8 in none rowwise; do
      timeout 240 python -m moetrain bench "$p" --device cuda --warmup $w --steps $n --routing learned --train.fp8=$fp8 \
          2>"$OUT/pair-$p-$fp8.err" | tee -a "$OUT/fp8-pairs.jsonl" \
        | python -c "import json,sys; [print('$p fp8=$fp8', round(r['tokens_per_sec_per_device']), round(r['peak_mem_gib'],2), r['host_syncs_per_step']) for r in map(json.loads, sys.stdin)]"
      grep -m3 -i "error\|Traceback" "$OUT/pair-$p-$fp8.err"
    done
  done
  exit 0
fi
timeout 150 python -m pytest -q -p no:cacheprovider tests/gpu -k fp8 2>&1 | tail -3
b8e() {  # b8e FP8 [extra overrides]
  timeout 150 python -m moetrain bench bench-8e --device cuda --warmup 5 --steps 15 --routing learned --train.fp8=$1 ${2:-} \
      2>"$OUT/b8e-fp8-$1.err" | tee -a "$OUT/fp8.jsonl" \
    | python -c "import json,sys; [print('8e fp8=$1 ${2:-}', round(r['tokens_per_sec_per_device']), round(100*r['mfu'],1), round(r['peak_mem_gib'],1), r['host_syncs_per_step']) for r in map(json.loads, sys.stdin)]"
  grep -m3 -i "error" "$OUT/b8e-fp8-$1.err"
}
b8e none
b8e rowwise
if ! grep -q fp8 "$OUT/fp8.jsonl" 2>/dev/null; then  # compiled FP8 failed: compare both eager
  echo "compiled FP8 failed; eager pair:"; b8e none --train.compile=false; b8e rowwise --train.compile=false
fi
# Loss curves: bench-small32e's architecture on real text (8k vocabulary), 250 steps of 8 × 2048 tokens,
# every block product in FP8 (at this size train.fp8_select=auto would take only the LM head): BF16, FP8
# with fast accumulation in backward, FP8 with the LM head in FP8 (each the one feature added).
curve() {  # curve LABEL [overrides]
  local label=$1; shift
  timeout 300 python -m moetrain train bench-small32e --device cuda --data.sources='[data/default]' --model.vocab_size=8192 \
      --data.seq_len=2048 --train.global_batch_size=8 --train.micro_batch_size=8 --steps 250 --eval-every 50 \
      --train.save_final=false --schedule.warmup_steps=25 "$@" --run-dir "$OUT/curve-$label" 2>&1 | tail -1
}
F="--train.fp8=rowwise --train.fp8_select=all"
curve bf16 &
curve fp8-fast-backward $F --train.fp8_lm_head=false --train.fp8_fast_accum_backward=true &
curve fp8-head $F --train.fp8_lm_head=true --train.fp8_fast_accum_backward=false &
wait  # three at a time fit one H200 (36 GiB each)
curve fp8-defaults $F  # the head and fast backward (unset: on)
python -m moetrain plot "$OUT/curve-bf16" "$OUT/curve-fp8-fast-backward" "$OUT/curve-fp8-head" \
  "$OUT/curve-fp8-defaults" --out "$OUT/fp8-vs-bf16.png"
