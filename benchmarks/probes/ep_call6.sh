# Issue 53 call 6: the GPU tests the suite's time ran out before (the two Muon rehearsals each in
# a process of their own, with a traceback dump if one stalls; then the rest of tests/gpu), then
# bench-tiny64e-l6 at the same tokens per GPU as one GPU's (ep2, ep4) and sweep-8l-128's busiest
# rank with one chunk.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
start=$(date +%s)
for id in "sharded-muon:parallel.ep=2,parallel.shard_optimizer=true,optim.name=muon:1" "fsdp-muon:parallel.stack=fsdp,optim.name=muon:2"; do
  IFS=: read name ov rank <<< "$id"
  timeout 170 python - "$ov" "$rank" > $OUT/$name.txt 2>&1 <<'PY'
import faulthandler, sys, tempfile, time
faulthandler.dump_traceback_later(150, exit=True)
from moetrain.bench import run_bench
t = time.time()
r = run_bench("tiny", ["train.device=cuda", "model.vocab_size=512", *sys.argv[1].split(",")], warmup=2, steps=3,
              routings=["random"], run_dir=tempfile.mkdtemp(), rehearse=4, rank=int(sys.argv[2]), progress=True)
print("DONE", round(time.time() - t, 1), "s", r[0]["rehearsal"]["compute_s"], r[0]["sync_free"])
PY
  echo "$name rc $? at $(( $(date +%s) - start )) s"; grep -E "DONE|Thread|File" $OUT/$name.txt | head -40
done
timeout 170 python -m pytest -v tests/gpu -p no:cacheprovider -k "context_parallel_attention_on_cuda or muon_compiled_element_wise or fused_row_gathers or two_gpus" > $OUT/gpu-rest.txt 2>&1
echo "pytest rc $? at $(( $(date +%s) - start )) s"; grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" $OUT/gpu-rest.txt | tail -8
L="--warmup 1 --steps 2"
S="--optim.grad_dtype=bf16 --optim.moments_dtype=bf16 --train.compile=true"
for row in "tiny-ep2=bench-tiny64e-l6 $L --train.micro_batch_size=4 --train.global_batch_size=4 --parallel.ep=2 --rehearse 2 --rank 0 --no-checkpoint" \
           "tiny-ep4=bench-tiny64e-l6 $L --train.micro_batch_size=8 --train.global_batch_size=8 --parallel.ep=4 --rehearse 4 --rank 0 --no-checkpoint" \
           "ep8-S-128-c1=sweep-8l-128 --model.n_layers=4 $L $S --train.micro_batch_size=32 --parallel.overlap_chunks=1 --parallel.ep=8 --rehearse 8 --no-checkpoint"; do
  left=$((575 - $(date +%s) + start)); [ $left -lt 45 ] && { echo "no time for ${row%%=*}"; continue; }
  ROW_TIMEOUT=$left python benchmarks/ep_parity.py $OUT "$row" >> $OUT/summary.txt 2>&1
done
grep -E "^== |^-- |kinds ms" $OUT/summary.txt | head -30
