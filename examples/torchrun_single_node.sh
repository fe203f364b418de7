#!/usr/bin/env bash
# 4 ranks on one node. torchrun kills every rank when one fails (its default).
# Rank 0 writes the video and prints its path; the other ranks print nothing.
set -euo pipefail
MODEL=${MODEL:-$HOME/models/Wan2.1-T2V-1.3B-Diffusers}
torchrun --nproc-per-node 4 -m distvideo generate \
    --model "$MODEL" --prompt "a red fox running through snow" \
    --output outputs/fox.mp4 --dist-timeout 600
