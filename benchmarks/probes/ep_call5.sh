# Issue 53 call 5: sweep-8l-8 cut to 4 layers, one GPU against rank 0 of dp8·ep8, with the
# documented switches (S) and bare; sweep-8l-128's busiest rank with S and 4 chunks; then S's
# rank on the tree before the fold of the shared expert's add (.baseline), while time is left.
export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="--optim.grad_dtype=bf16 --optim.moments_dtype=bf16 --train.compile=true"
L="--model.n_layers=4 --warmup 1 --steps 2"
R8="--parallel.ep=8 --rehearse 8 --no-checkpoint"
rows=("one-S=sweep-8l-8 $L $S --train.micro_batch_size=4 --train.global_batch_size=8"
      "ep8-S=sweep-8l-8 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 $R8 --rank 0"
      "one-bare=sweep-8l-8 $L --train.micro_batch_size=1 --train.global_batch_size=8"
      "ep8-bare=sweep-8l-8 $L $R8 --rank 0"
      "ep8-S-128=sweep-8l-128 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=4 $R8"
      "ep8-S-before=sweep-8l-8 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 $R8 --rank 0")
for row in "${rows[@]}"; do
  if [ "${row%%=*}" = ep8-S-before ]; then export PYTHONPATH=$PWD/.baseline/src; else export PYTHONPATH=$PWD/src; fi
  left=$((570 - $(date +%s) + start)); [ $left -lt 45 ] && { echo "no time for ${row%%=*}"; continue; }
  ROW_TIMEOUT=$left python benchmarks/ep_parity.py $OUT "$row" >> $OUT/summary.txt 2>&1
done
grep -E "^== |^-- |kinds ms" $OUT/summary.txt | head -40
