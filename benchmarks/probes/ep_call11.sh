# Issue 53 call 11: sweep-8l-128's busiest rank of dp8·ep8 (cut to 4 layers) with the documented
# switches (S), 1 and 4 chunks, with the exchanges routed together (one plan and one receive sort
# for all chunks) and, where .old/ holds the two dispatcher files of c35ba73's design (one plan
# per chunk; carry [".old"]), with those, interleaved; one GPU's sweep-8l-8 (4 layers) in the same call.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
S="--optim.grad_dtype=bf16 --optim.moments_dtype=bf16 --train.compile=true"
L="--model.n_layers=4 --warmup 1 --steps 2"
R8="--parallel.ep=8 --rehearse 8 --no-checkpoint"
if ls .old/*.py >/dev/null 2>&1; then
  rm -rf /tmp/src_old && cp -r src /tmp/src_old && cp .old/*.py /tmp/src_old/moetrain/parallel/
fi
rows=("new:one-S=sweep-8l-8 $L $S --train.micro_batch_size=4 --train.global_batch_size=8"
      "new:ep8-S-128-c4=sweep-8l-128 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=4 $R8"
      "old:ep8-S-128-c4-old=sweep-8l-128 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=4 $R8"
      "new:ep8-S-128-c1=sweep-8l-128 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 $R8"
      "old:ep8-S-128-c1-old=sweep-8l-128 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 $R8")
for row in "${rows[@]}"; do
  src=${row%%:*}; row=${row#*:}
  [ $src = old ] && [ ! -d /tmp/src_old ] && continue
  left=$((${BUDGET:-560} - $(date +%s) + start)); [ $left -lt 40 ] && { echo "no time for ${row%%=*}"; continue; }
  path=$PWD/src; [ $src = old ] && path=/tmp/src_old
  PYTHONPATH=$path ROW_TIMEOUT=$left python benchmarks/ep_parity.py $OUT "$row" >> $OUT/summary.txt 2>&1
done
grep -E "^== |^-- |kinds ms|tokens/s" $OUT/summary.txt | head -60
