#!/usr/bin/env bash
# The multi-GPU checks on one host with N GPUs (N=2 on nvidia-h200-x2; any N that divides the shapes):
#   correct — NCCL layouts beside one GPU, 20 steps on real text (benchmarks/compare_losses.py);
#   stacks  — `moetrain bench` of one shape: ddp (expert parallel, nosync and alltoall
#             dispatchers; replicated experts) and the FSDP baseline, same batch;
#   pp      — pipeline pp=N beside pure data parallel on bench-small32e;
#   scale   — sweep-8l-E with ep=N (random routing, seq 4096, the preset's 8 sequences per GPU
#             per step in micro-batches of one) beside one GPU, profiled: exposed NCCL per step.
# Usage: PARTS="correct stacks" bash benchmarks/multigpu.sh   (carry "data" for `correct`)
# NVLink multicast stays off (the device tool's KINDS.md says why).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
N=${N:-2}
DEV=${DEV:-cuda}
RUN="torchrun --standalone --nproc-per-node=$N -m moetrain"
ONE="python -m moetrain"
[ "$DEV" = cuda ] && ONE="env CUDA_VISIBLE_DEVICES=0 python -m moetrain"
summ='import json,sys
for r in map(json.loads, sys.stdin):
    L=r["layout"]; print(sys.argv[1], r["routing"], r["timed"], "tok/s/dev", round(r["tokens_per_sec_per_device"]), "step_s", round(r["step_time_s"],4),
          "mfu", round(100*r["mfu"],1) if r["mfu"] else None, "GiB", round(r["peak_mem_gib"],1), "dropped", round(r["dropped_token_frac"],5),
          "ep_load", round(r["ep_load_max_over_mean"],3), "syncs", r["host_syncs_per_step"], flush=True)'
bench() {  # bench NAME NPROC ARGS...: one JSON line per routing into $OUT/multigpu.jsonl
  local name=$1 n=$2; shift 2
  local cmd=$ONE; [ "$n" -gt 1 ] && cmd="torchrun --standalone --nproc-per-node=$n -m moetrain"
  timeout ${BT:-240} $cmd bench "$@" --device $DEV 2>"$OUT/$name.err" \
    | python -c "import json,sys; [print(json.dumps(dict(json.loads(l), name='$name'))) for l in sys.stdin]" \
    | tee -a "$OUT/multigpu.jsonl" | python -c "$summ" "$name"
  grep -m3 -i "error\|Traceback" "$OUT/$name.err"
}
for part in ${PARTS:-correct stacks pp scale}; do
case $part in
correct)
  # bench-small32e's blocks (4 of them) on the embedded corpus, 8k vocabulary, 8 × 2048 tokens a
  # step in 2 micro-batches, bf16, 20 steps, every step logged.
  C=(bench-small32e --data.sources='[data/default]' --model.vocab_size=8192 --model.n_layers=4
     --data.seq_len=2048 --train.global_batch_size=8 --train.micro_batch_size=4 --steps ${CSTEPS:-20}
     --train.log_every=1 --train.eval_every=0 --train.save_final=false --train.plot=false
     --train.compile=false --schedule.warmup_steps=5 --device $DEV ${CX:-})
  timeout 120 $ONE train "${C[@]}" --run-dir "$OUT/c-single" 2>&1 | tail -1
  for L in "dp$N:" "dp${N}ep$N-nosync:--parallel.ep=$N" "dp${N}ep$N-alltoall:--parallel.ep=$N --parallel.dispatcher=alltoall" \
           "dp${N}ep$N-sharded:--parallel.ep=$N --parallel.shard_optimizer=true" "pp$N:--parallel.pp=$N" \
           "fsdp$N:--parallel.stack=fsdp"; do
    name=${L%%:*}; extra=${L#*:}
    timeout 150 $RUN train "${C[@]}" $extra --run-dir "$OUT/c-$name" > "$OUT/log-c-$name.txt" 2>&1 || tail -3 "$OUT/log-c-$name.txt"
  done
  python benchmarks/compare_losses.py "$OUT/c-single" "$OUT"/c-dp* "$OUT"/c-pp* "$OUT"/c-fsdp* --rtol ${RTOL:-0.02} | tee "$OUT/correct.jsonl"
  ;;
stacks)
  # One shape, one batch (micro-batch S sequences per GPU), all layouts; learned and random routing.
  S=${STACK_SHAPE:-bench-tiny64e-l6}; MB=${MB:-2}
  B=("$S" --warmup 4 --steps 10 --train.global_batch_size=$((MB*N)) --train.micro_batch_size=$((MB*N)) ${SX:-})
  for L in ${STACK_LAYOUTS:-nosync alltoall fsdp ep1 cf1.25}; do
    case $L in
      nosync)   bench "st-ddp-ep$N-nosync" $N "${B[@]}" --parallel.ep=$N ;;
      alltoall) bench "st-ddp-ep$N-alltoall" $N "${B[@]}" --parallel.ep=$N --parallel.dispatcher=alltoall ;;
      cf1.25)   bench "st-ddp-ep$N-nosync-cf1.25" $N "${B[@]}" --parallel.ep=$N --parallel.capacity_factor=1.25 ;;
      ep1)      bench "st-ddp-ep1" $N "${B[@]}" ;;
      fsdp)     bench "st-fsdp$N" $N "${B[@]}" --parallel.stack=fsdp ;;
    esac
  done
  ;;
pp)
  # pp=N 1F1B with 8 micro-batches of 2 sequences beside dp=N on the same global batch.
  P=(bench-small32e --warmup 3 --steps 6 --routing random --train.global_batch_size=16 --train.micro_batch_size=2 ${PX:-})
  bench "pp-one-gpu" 1 bench-small32e --warmup 3 --steps 6 --routing random --train.global_batch_size=$((16/N)) --train.micro_batch_size=2 ${PX:-}
  bench "pp-pp$N-1f1b" $N "${P[@]}" --parallel.pp=$N
  bench "pp-dp$N" $N "${P[@]}" --train.micro_batch_size=$((2*N))
  ;;
scale)
  # The capacity sweep's shape (d_model 4096, 8 layers, seq 4096), random routing, the preset's
  # per-GPU batch: 8 sequences per GPU per step, one per micro-batch; experts per GPU = E / N.
  # One profiled step each: benchmarks/trace_overlap.py splits it into compute, exposed NCCL, idle.
  SCX=${SCX:---train.compile=true}
  P=(--warmup 2 --steps 5 --routing random --train.profile=true --train.profile_steps=1 ${SCX:-})
  for E in ${SCALE_E:-8 16}; do
    bench "sc-sweep-8l-$E-ep$N" $N sweep-8l-$E "${P[@]}" --parallel.ep=$N --train.global_batch_size=$((8*N)) \
        --train.micro_batch_size=$N --run-dir "/tmp/sc-sweep-8l-$E-ep$N"
    python benchmarks/trace_overlap.py /tmp/sc-sweep-8l-$E-ep$N/profile-random/rank0/trace.json --steps 1
  done
  bench "sc-sweep-8l-8-one-gpu" 1 sweep-8l-8 "${P[@]}" --train.global_batch_size=8 --train.micro_batch_size=1 \
      --run-dir /tmp/sc-sweep-8l-8-one-gpu
  python benchmarks/trace_overlap.py /tmp/sc-sweep-8l-8-one-gpu/profile-random/trace.json --steps 1
  ;;
esac
done
