# Issue 54 item 1 and issue 53, one device call (~330 s):
# 1. Newton–Schulz alone over bench-8e's and bench-tiny64e-l6's matrices (muon_step_probe.py
#    --ns-only, with the triangle where Muon runs it): the planner's `ns_eff`;
# 2. one GPU's bench-tiny64e-l6 with AdamW and Muon (the table muon-step);
# 3. the gather-GEMM probe over its eight launches (benchmarks/probes/gather_gemm_probe.py).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for p in bench-8e bench-tiny64e-l6; do
  timeout 90 python benchmarks/probes/muon_step_probe.py --preset $p --reps 5 --ns-only | tee -a $OUT/muon_probe.jsonl
done
show="import json,sys; [print(sys.argv[1], r.get('timed'), r.get('step_time_s'), r.get('share_of_training_step'), r.get('tokens_per_sec'), r.get('peak_mem_gib'), r['optimizer']['state_bytes_per_param']) for r in map(json.loads, sys.stdin)]"
for opt in adamw muon; do
  timeout 120 python -m moetrain bench bench-tiny64e-l6 --device cuda --routing learned --warmup 5 --steps 10 \
    --also-optimizer-step --optim.name=$opt 2> $OUT/tiny-$opt.err | tee -a $OUT/muon-tiny64e.jsonl | python -c "$show" tiny-$opt
  tail -2 $OUT/tiny-$opt.err
done
timeout 200 python benchmarks/probes/gather_gemm_probe.py --reps 10 | tee $OUT/gather_gemm.jsonl \
  | python -c "import json,sys; [print(r['product'], r['chunks'], r['ms'], r['fused_ms'], r['torch_tflops'], r['fused_over_gather_torch']) for r in map(json.loads, sys.stdin)]"
