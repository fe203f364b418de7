#!/usr/bin/env bash
# 2 nodes x 8 GPUs. Run this on every node with NODE_RANK=0 and NODE_RANK=1; MASTER_ADDR is node 0.
# Only global rank 0 (on node 0) writes the video.
set -euo pipefail
MODEL=${MODEL:-/shared/models/Wan2.1-T2V-14B-Diffusers}
torchrun --nnodes 2 --node-rank "${NODE_RANK:?set NODE_RANK}" --nproc-per-node 8 \
    --master-addr "${MASTER_ADDR:?set MASTER_ADDR to node 0}" --master-port 29500 \
    -m distvideo generate --model "$MODEL" --prompt "a red fox running through snow" \
    --output /shared/outputs/ --dist-timeout 900
