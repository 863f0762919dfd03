# Issue 53 call 10: sweep-8l-128's busiest rank of dp8·ep8 (cut to 4 layers) with the dispatcher
# of 9ffbe18 and chunks by tokens, bare and with the documented switches (S), against one GPU's
# sweep-8l-8 (4 layers) in the same call.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="--optim.grad_dtype=bf16 --optim.moments_dtype=bf16 --train.compile=true"
L="--model.n_layers=4 --warmup 1 --steps 2"
R8="--parallel.ep=8 --rehearse 8 --no-checkpoint"
rows=("one-S=sweep-8l-8 $L $S --train.micro_batch_size=4 --train.global_batch_size=8"
      "one-bare=sweep-8l-8 $L --train.micro_batch_size=1 --train.global_batch_size=8"
      "ep8-bare-128=sweep-8l-128 $L $R8"
      "ep8-bare-128-c2=sweep-8l-128 $L --parallel.overlap_chunks=2 $R8"
      "ep8-S-128-c1=sweep-8l-128 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 $R8"
      "ep8-S-128-c2=sweep-8l-128 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=2 $R8"
      "ep8-S-128-c4=sweep-8l-128 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=4 $R8")
for row in "${rows[@]}"; do
  left=$((${BUDGET:-560} - $(date +%s) + start)); [ $left -lt 40 ] && { echo "no time for ${row%%=*}"; continue; }
  ROW_TIMEOUT=$left python benchmarks/ep_parity.py $OUT "$row" >> $OUT/summary.txt 2>&1
done
grep -E "^== |^-- |kinds ms|tokens/s" $OUT/summary.txt | head -60
