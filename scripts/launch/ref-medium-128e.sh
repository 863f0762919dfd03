#!/usr/bin/env bash
# ref-medium-128e on $NODES nodes of 8 × H200 — Olmo-core ran it on 128 GPUs; 39 blocks in 8 stages (5,5,5,5,5,5,5,4)
# Check the layout first: bash scripts/launch/ref-medium-128e.sh plan   (moetrain plan: per-GPU memory, fits, step time)
# Rehearse its busiest rank on this machine's one GPU: bash scripts/launch/ref-medium-128e.sh rehearse --device cuda   (communication not measured)
# Train (on every node; see common.sh):  NODE_RANK=… MASTER_ADDR=… bash scripts/launch/ref-medium-128e.sh [--key=value …]
NODES=${NODES:-16}
GPU=h200
PRESET=ref-medium-128e
PP=8 EP=8 ROWS=1 RECOMPUTE=none DISPATCHER=alltoall
set -eu
source "$(dirname "$0")/common.sh"
