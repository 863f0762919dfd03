# Issue 53 call 1: one GPU against rank 0 of dp8·ep8 (sweep-8l-8 cut to 4 layers), with the
# documented switches (S) and bare, before (.baseline/src: HEAD's code) and after (src).
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="--optim.grad_dtype=bf16 --optim.moments_dtype=bf16 --train.compile=true"
L="--model.n_layers=4 --warmup 1 --steps 2"
R8="--parallel.ep=8 --rehearse 8 --rank 0 --no-checkpoint"
for side in before after; do
  if [ $side = before ]; then export PYTHONPATH=$PWD/.baseline/src; else export PYTHONPATH=$PWD/src; fi
  rows=("ep8-S-$side=sweep-8l-8 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 $R8"
        "one-bare-$side=sweep-8l-8 $L --train.micro_batch_size=1 --train.global_batch_size=8"
        "ep8-bare-$side=sweep-8l-8 $L $R8")
  [ $side = before ] && rows+=("one-S=sweep-8l-8 $L $S --train.micro_batch_size=4 --train.global_batch_size=8")
  ROW_TIMEOUT=170 python benchmarks/ep_parity.py $OUT "${rows[@]}" 2>&1 | tee -a $OUT/summary.txt
done
