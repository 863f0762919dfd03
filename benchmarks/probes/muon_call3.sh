# Issue 54 item 1: Muon's step with Newton–Schulz one triangle at a time (`symmetric_product`,
# from 1,024 rows on CUDA), one device call (~420 s):
# 1. Muon's parts timed apart (benchmarks/probes/muon_step_probe.py) over bench-8e's and
#    bench-tiny64e-l6's matrices: Newton–Schulz's rate, from which the planner's `ns_eff`;
# 2. rank 0 of a rehearsed dp8·ep8 bench-8e with AdamW and Muon (the table muon-rehearsed);
# 3. one GPU's bench-8e with AdamW and Muon (the table muon-step).
# Between 1 and 2, issue 53's gather-GEMM probe (benchmarks/probes/gather_gemm_probe.py).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
start=$(date +%s)
left() { echo $((${BUDGET:-560} - $(date +%s) + start)); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for p in bench-8e bench-tiny64e-l6; do
  timeout 90 python benchmarks/probes/muon_step_probe.py --preset $p --reps 5 | tee -a $OUT/muon_probe.jsonl
done
timeout 120 python benchmarks/probes/gather_gemm_probe.py --reps 10 | tee $OUT/gather_gemm.jsonl \
  | python -c "import json,sys; [print(r['product'], r['chunks'], r['ms'], r['fused_ms'], r['torch_tflops'], r['fused_over_gather_torch']) for r in map(json.loads, sys.stdin)]"
R="--rehearse 8 --rank 0 --no-checkpoint --device cuda --parallel.ep=8 --train.micro_batch_size=8 --train.global_batch_size=8"
show="import json,sys; [print(sys.argv[1], r.get('timed'), r.get('step_time_s'), r.get('share_of_training_step'), r.get('tokens_per_sec'), r.get('peak_mem_gib')) for r in map(json.loads, sys.stdin)]"
for opt in adamw muon; do
  timeout $(( $(left) < 150 ? $(left) : 150 )) python -m moetrain bench bench-8e $R --routing learned --warmup 3 --steps 5 \
    --also-optimizer-step --optim.name=$opt 2> $OUT/rank-$opt.err | tee -a $OUT/muon-rank.jsonl | python -c "$show" rank-$opt
  tail -2 $OUT/rank-$opt.err
done
for opt in adamw muon; do
  timeout $(( $(left) < 120 ? $(left) : 120 )) python -m moetrain bench bench-8e --device cuda --routing learned --warmup 5 --steps 10 \
    --also-optimizer-step --optim.name=$opt 2> $OUT/one-$opt.err | tee -a $OUT/muon-one.jsonl | python -c "$show" one-$opt
  tail -2 $OUT/one-$opt.err
done
