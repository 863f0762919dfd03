# Issue 53 call 8 (one GPU): the GPU tests of the step graph and the sync-free steps after the
# optimizer graph's removal, then the overlapped exchange's one-GPU proxy on this tree
# (benchmarks/overlap_probe.py, the command of docs/measurements.md
# "The overlapped exchange on one H200"), at the plain capacity and at --capacity 0.7 (buffers
# equal to the plain exchange's).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 240 python -m pytest -v tests/gpu/test_cuda.py -p no:cacheprovider -k "graph or replayed or sync_free" > $OUT/gpu-graphs.txt 2>&1
echo "pytest rc $? at $(( $(date +%s) - start )) s"; grep -E "FAILED|ERROR|passed|failed" $OUT/gpu-graphs.txt | tail -8
timeout 150 python benchmarks/overlap_probe.py --iters 15 --bf16-weights > $OUT/overlap.jsonl 2> $OUT/overlap.err
echo "probe rc $? at $(( $(date +%s) - start )) s"; cut -c1-400 $OUT/overlap.jsonl; tail -3 $OUT/overlap.err
timeout 120 python benchmarks/overlap_probe.py --iters 15 --bf16-weights --capacity 0.7 > $OUT/overlap-c07.jsonl 2> $OUT/overlap-c07.err
echo "probe rc $? at $(( $(date +%s) - start )) s"; cut -c1-400 $OUT/overlap-c07.jsonl; tail -3 $OUT/overlap-c07.err
