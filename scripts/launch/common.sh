# Shared by the ref-*.sh launch scripts: builds the layout flags from the variables the script
# set (NODES, GPU, PRESET, PP, EP, ROWS, RECOMPUTE, DISPATCHER), then either checks the layout
# with `moetrain plan` (first argument "plan") or starts this node's 8 ranks under torchrun.
# Multi-node: run the script on every node with NODE_RANK (0…NODES-1), MASTER_ADDR (node 0's
# address) and MASTER_PORT set; under SLURM, SLURM_NODEID and the first host of
# SLURM_JOB_NODELIST fill them in (README, "Run on a cluster").
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
GPUS=$((NODES * GPUS_PER_NODE))
DP=$((GPUS / PP))
LAYOUT=(--parallel.pp="$PP" --parallel.ep="$EP" --parallel.dispatcher="$DISPATCHER"
        --parallel.shard_optimizer=true --train.recompute="$RECOMPUTE"
        --train.micro_batch_size=$((DP * ROWS)))
if [ "${1:-}" = plan ]; then
  shift
  exec python -m moetrain plan "$PRESET" --gpus "$GPUS" --gpu "$GPU" "${LAYOUT[@]}" "$@"
fi
if [ -n "${SLURM_JOB_NODELIST:-}" ] && [ -z "${MASTER_ADDR:-}" ]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
exec torchrun --nnodes="$NODES" --nproc-per-node="$GPUS_PER_NODE" \
  --node-rank="${NODE_RANK:-${SLURM_NODEID:-0}}" \
  --master-addr="${MASTER_ADDR:-localhost}" --master-port="${MASTER_PORT:-29500}" \
  -m moetrain train "$PRESET" "${LAYOUT[@]}" --run-dir "${RUN_DIR:-runs/$PRESET}" --resume "$@"
