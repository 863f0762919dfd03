#!/usr/bin/env bash
# ref-ultra-128e on $NODES nodes of 8 × B300 — Olmo-core's layout on 512 B300s: dp64·ep8·pp8, per-layer recompute
# Check the layout first: bash scripts/launch/ref-ultra-128e.sh plan   (moetrain plan: per-GPU memory, fits, step time)
# Rehearse its busiest rank on this machine's one GPU: bash scripts/launch/ref-ultra-128e.sh rehearse --device cuda   (communication not measured)
# Train (on every node; see common.sh):  NODE_RANK=… MASTER_ADDR=… bash scripts/launch/ref-ultra-128e.sh [--key=value …]
NODES=${NODES:-64}
GPU=b300
PRESET=ref-ultra-128e
PP=8 EP=8 ROWS=1 RECOMPUTE=full DISPATCHER=alltoall
set -eu
source "$(dirname "$0")/common.sh"
