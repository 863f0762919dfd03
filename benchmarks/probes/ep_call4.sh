# Issue 53 call 4: the whole GPU suite (log in $OUT/gpu.txt), then bench-tiny64e-l6 on one GPU
# against rank 0 of dp2·ep2 and dp4·ep4 (the preset's switches), while the call has time.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 420 python -m pytest -q tests/gpu -p no:cacheprovider --durations=12 > $OUT/gpu.txt 2>&1; echo "pytest rc $?"
grep -E "passed|failed|FAILED|Error|s call" $OUT/gpu.txt | tail -30
for row in "tiny-one=bench-tiny64e-l6 --warmup 1 --steps 2" \
           "tiny-ep2=bench-tiny64e-l6 --warmup 1 --steps 2 --parallel.ep=2 --rehearse 2 --rank 0 --no-checkpoint" \
           "tiny-ep4=bench-tiny64e-l6 --warmup 1 --steps 2 --parallel.ep=4 --rehearse 4 --rank 0 --no-checkpoint"; do
  left=$((560 - $(date +%s) + start)); [ $left -lt 40 ] && { echo "no time for ${row%%=*}"; continue; }
  ROW_TIMEOUT=$left python benchmarks/ep_parity.py $OUT "$row" >> $OUT/summary.txt 2>&1
done
grep -E "^== |^-- |kinds ms|tokens/s" $OUT/summary.txt | head -30
