#!/usr/bin/env bash
# Open MPI (or MPICH / Intel MPI): each MPI process is one distvideo rank; MPI is used only to start
# processes, the collectives run over torch.distributed (NCCL on GPUs, gloo on CPU).
# mpirun has no rendezvous of its own for torch, so give the address of rank 0's host.
# Open MPI ends every process when one exits non-zero (its default).
set -euo pipefail
MODEL=${MODEL:-$HOME/models/Wan2.1-T2V-1.3B-Diffusers}
mpirun -np 4 -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 \
    distvideo generate --model "$MODEL" --prompt "a red fox running through snow" \
    --output outputs/ --dist-timeout 600
