# Issue 53 call 3: the GPU suite (log in $OUT/gpu.txt), then one GPU against rank 0 of dp8·ep8
# (sweep-8l-8 cut to 4 layers) with the documented switches, this tree.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 290 python -m pytest -q tests/gpu -p no:cacheprovider > $OUT/gpu.txt 2>&1; echo "pytest rc $?"
grep -E "passed|failed|FAILED|Error" $OUT/gpu.txt | tail -12
S="--optim.grad_dtype=bf16 --optim.moments_dtype=bf16 --train.compile=true"
L="--model.n_layers=4 --warmup 1 --steps 2"
ROW_TIMEOUT=100 python benchmarks/ep_parity.py $OUT \
  "one-S=sweep-8l-8 $L $S --train.micro_batch_size=4 --train.global_batch_size=8" \
  "ep8-S=sweep-8l-8 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 --parallel.ep=8 --rehearse 8 --no-checkpoint --rank 0" > $OUT/summary.txt 2>&1
grep -E "^-- |kinds ms|launched by" $OUT/summary.txt | head -30
