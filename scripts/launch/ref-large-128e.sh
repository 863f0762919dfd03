#!/usr/bin/env bash
# ref-large-128e on $NODES nodes of 8 × B300 — Olmo-core ran it on 512 GPUs
# Check the layout first: bash scripts/launch/ref-large-128e.sh plan   (moetrain plan: per-GPU memory, fits, step time)
# Rehearse its busiest rank on this machine's one GPU: bash scripts/launch/ref-large-128e.sh rehearse --device cuda   (communication not measured)
# Train (on every node; see common.sh):  NODE_RANK=… MASTER_ADDR=… bash scripts/launch/ref-large-128e.sh [--key=value …]
NODES=${NODES:-64}
GPU=b300
PRESET=ref-large-128e
PP=16 EP=8 ROWS=1 RECOMPUTE=none DISPATCHER=alltoall
set -eu
source "$(dirname "$0")/common.sh"
