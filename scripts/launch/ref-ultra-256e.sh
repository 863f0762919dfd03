#!/usr/bin/env bash
# ref-ultra-256e on $NODES nodes of 8 × B300 — Olmo-core ran it on 512 GPUs (a 9-step reachability run)
# Check the layout first: bash scripts/launch/ref-ultra-256e.sh plan   (moetrain plan: per-GPU memory, fits, step time)
# Rehearse its busiest rank on this machine's one GPU: bash scripts/launch/ref-ultra-256e.sh rehearse --device cuda   (communication not measured)
# Train (on every node; see common.sh):  NODE_RANK=… MASTER_ADDR=… bash scripts/launch/ref-ultra-256e.sh [--key=value …]
NODES=${NODES:-64}
GPU=b300
PRESET=ref-ultra-256e
PP=16 EP=32 ROWS=1 RECOMPUTE=full DISPATCHER=alltoall
set -eu
source "$(dirname "$0")/common.sh"
