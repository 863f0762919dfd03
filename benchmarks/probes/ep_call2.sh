# Issue 53 call 2: the GPU suite, then one GPU against rank 0 of dp8·ep8 (sweep-8l-8) and the
# busiest rank of sweep-8l-128 (4 layers), with the documented switches (S), this tree.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 330 python -m pytest -q tests/gpu -x -p no:cacheprovider 2>&1 | tail -15
S="--optim.grad_dtype=bf16 --optim.moments_dtype=bf16 --train.compile=true"
L="--model.n_layers=4 --warmup 1 --steps 2"
R8="--parallel.ep=8 --rehearse 8 --no-checkpoint"
ROW_TIMEOUT=150 python benchmarks/ep_parity.py $OUT \
  "one-S=sweep-8l-8 $L $S --train.micro_batch_size=4 --train.global_batch_size=8" \
  "ep8-S=sweep-8l-8 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 $R8 --rank 0" \
  "ep8-S-128=sweep-8l-128 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=4 $R8" 2>&1 | tee -a $OUT/summary.txt
