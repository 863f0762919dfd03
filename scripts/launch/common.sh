# Shared by the ref-*.sh launch scripts: builds the layout flags from the variables the script
# set (NODES, GPU, PRESET, PP, EP, ROWS, RECOMPUTE, DISPATCHER), then checks the layout with
# `moetrain plan` (first argument "plan"), rehearses its busiest rank on this one GPU (first
# argument "rehearse") or starts this node's 8 ranks under torchrun.
# Multi-node: run the script on every node with NODE_RANK (0…NODES-1), MASTER_ADDR (node 0's
# address) and MASTER_PORT set; under SLURM, SLURM_NODEID and the first host of
# SLURM_JOB_NODELIST fill them in (README, "Run on a cluster").
# The checkout's virtualenv (`make train` / `make install` made it) when it exists, so the
# script works without `source .venv/bin/activate`; PYTHON=… overrides it.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# This checkout's package, whichever interpreter runs it and whether or not it was installed (a
# copy of the tree on a GPU machine is not).
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import moetrain, torch" 2>/dev/null; then
  echo "error: $PYTHON cannot import moetrain and torch. Run \`make install\` in $ROOT (it creates .venv)," \
       "or set PYTHON to an interpreter that has them." >&2
  exit 2
fi
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
GPUS=$((NODES * GPUS_PER_NODE))
DP=$((GPUS / PP))
# bf16 weights with their 16-bit remainders (optim.bf16_weights, exact fp32 masters): without
# them every micro-batch in flight in the pipeline keeps its own bf16 copy of the stage's weights
# until its backward (src/moetrain/plan/memory.py counts them; the rehearsals measured them).
LAYOUT=(--parallel.pp="$PP" --parallel.ep="$EP" --parallel.dispatcher="$DISPATCHER"
        --parallel.shard_optimizer=true --optim.bf16_weights=true --compute.recompute="$RECOMPUTE"
        --train.micro_batch_size=$((DP * ROWS)))
if [ "${1:-}" = plan ]; then
  shift
  exec "$PYTHON" -m moetrain plan "$PRESET" --gpus "$GPUS" --gpu "$GPU" "${LAYOUT[@]}" "$@"
fi
# "rehearse": one rank of this layout alone on this machine's GPU, its peers stood in for
# (moetrain bench --rehearse; communication not measured; docs/architecture.md, "Rehearsal").
if [ "${1:-}" = rehearse ]; then
  shift
  exec "$PYTHON" -m moetrain bench "$PRESET" --rehearse "$GPUS" "${LAYOUT[@]}" "$@"
fi
if [ -n "${SLURM_JOB_NODELIST:-}" ] && [ -z "${MASTER_ADDR:-}" ]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
exec "$PYTHON" -m torch.distributed.run --nnodes="$NODES" --nproc-per-node="$GPUS_PER_NODE" \
  --node-rank="${NODE_RANK:-${SLURM_NODEID:-0}}" \
  --master-addr="${MASTER_ADDR:-localhost}" --master-port="${MASTER_PORT:-29500}" \
  -m moetrain train "$PRESET" "${LAYOUT[@]}" --run-dir "${RUN_DIR:-runs/$PRESET}" --resume "$@"
