# Issue 53 call 9: chunks by tokens for a rank with one expert (sweep-8l-8 at dp8·ep8, cut to 4
# layers): rank 0's compute with 1, 2 and 4 chunks against one GPU's step of the same tokens,
# S and bare (bare also with 2 chunks: whether the defaults should overlap).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="--optim.grad_dtype=bf16 --optim.moments_dtype=bf16 --train.compile=true"
L="--model.n_layers=4 --warmup 1 --steps 2"
R8="--parallel.ep=8 --rehearse 8 --no-checkpoint --rank 0"
rows=("one-S=sweep-8l-8 $L $S --train.micro_batch_size=4 --train.global_batch_size=8"
      "ep8-S-c1=sweep-8l-8 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 $R8"
      "ep8-S-c2=sweep-8l-8 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=2 $R8"
      "ep8-S-c4=sweep-8l-8 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=4 $R8"
      "one-bare=sweep-8l-8 $L --train.micro_batch_size=1 --train.global_batch_size=8"
      "ep8-bare=sweep-8l-8 $L $R8"
      "ep8-bare-c2=sweep-8l-8 $L --parallel.overlap_chunks=2 $R8")
for row in "${rows[@]}"; do
  left=$((${BUDGET:-560} - $(date +%s) + start)); [ $left -lt 40 ] && { echo "no time for ${row%%=*}"; continue; }
  ROW_TIMEOUT=$left python benchmarks/ep_parity.py $OUT "$row" >> $OUT/summary.txt 2>&1
done
grep -E "^== |^-- |kinds ms|tokens/s" $OUT/summary.txt | head -60
