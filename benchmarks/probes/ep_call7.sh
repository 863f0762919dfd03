# Issue 53 call 7: the GPU tests call 4's suite had no time for (the Muon rehearsals, the fused
# gathers), then every parity row of one tree in one call: sweep-8l-8 cut to 4 layers on one GPU
# against rank 0 of dp8·ep8 (S and bare), sweep-8l-128's busiest rank (S with 1 and 4 chunks,
# bare), bench-tiny64e-l6 on one GPU against ep2 and ep4 ranks at the same tokens per GPU.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python -m pytest -v tests/gpu -p no:cacheprovider -k "muon-muon or sharded-muon or fsdp-muon or fused_row_gathers" > $OUT/gpu-rest.txt 2>&1
echo "pytest rc $? at $(( $(date +%s) - start )) s"; grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" $OUT/gpu-rest.txt | tail -6
S="--optim.grad_dtype=bf16 --optim.moments_dtype=bf16 --train.compile=true"
L="--model.n_layers=4 --warmup 1 --steps 2"
R8="--parallel.ep=8 --rehearse 8 --no-checkpoint"
T="--warmup 1 --steps 2 --no-checkpoint"
rows=("one-S=sweep-8l-8 $L $S --train.micro_batch_size=4 --train.global_batch_size=8"
      "ep8-S=sweep-8l-8 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 $R8 --rank 0"
      "ep8-S-128-c1=sweep-8l-128 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 $R8"
      "one-bare=sweep-8l-8 $L --train.micro_batch_size=1 --train.global_batch_size=8"
      "ep8-bare=sweep-8l-8 $L $R8 --rank 0"
      "ep8-bare-128=sweep-8l-128 $L $R8"
      "tiny-one=bench-tiny64e-l6 --warmup 1 --steps 2"
      "tiny-ep2=bench-tiny64e-l6 $T --train.micro_batch_size=4 --train.global_batch_size=4 --parallel.ep=2 --rehearse 2 --rank 0"
      "tiny-ep4=bench-tiny64e-l6 $T --train.micro_batch_size=8 --train.global_batch_size=8 --parallel.ep=4 --rehearse 4 --rank 0"
      "ep8-S-128=sweep-8l-128 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=4 $R8")
for row in "${rows[@]}"; do
  left=$((540 - $(date +%s) + start)); [ $left -lt 40 ] && { echo "no time for ${row%%=*}"; continue; }
  ROW_TIMEOUT=$left python benchmarks/ep_parity.py $OUT "$row" >> $OUT/summary.txt 2>&1
done
grep -E "^== |^-- |kinds ms" $OUT/summary.txt | head -40
