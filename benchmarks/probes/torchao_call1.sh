python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src || exit;
# Issue 54 item 3, call 1: torchao 0.18.0's float8 training (row-wise Float8Linear on the block linears,
# its FP8 row-wise grouped GEMM on the experts) against moetrain's row-wise FP8 (all, auto, with and
# without the LM head) and BF16 on bench-8e and bench-tiny64e-l6: one GPU, random routing, each variant
# a child process, all within BUDGET seconds (the last variants skipped when short; JSON lines and each
# child's stderr under $OUT). A subset: PRESETS="bench-8e" VARIANTS="ao-auto,mt-auto-nohead" bash THIS.
export PYTHONUNBUFFERED=1 OUT=${OUT:-$PWD/out} TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1  # no C++ kernel of torchao's on this path
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, torchao, triton; print('torch', torch.__version__, 'torchao', torchao.__version__, 'triton', triton.__version__)" 2>&1 | grep -v "Enum subclass"
python benchmarks/probes/torchao_fp8_probe.py ${PRESETS:-bench-8e bench-tiny64e-l6} --budget "${BUDGET:-540}" \
  --warmup "${WARMUP:-3}" --steps "${STEPS:-8}" ${VARIANTS:+--variants "$VARIANTS"} --out "$OUT" 2>&1 \
  | grep -v '^{\|Enum subclass'
