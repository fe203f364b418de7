#!/usr/bin/env bash
# sbatch examples/slurm_sbatch.sh — srun starts one task per GPU; each task is one distvideo rank.
# distvideo reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and takes the first host of the step's
# node list as MASTER_ADDR and a port derived from the job id, so nothing needs exporting.
#SBATCH --job-name=distvideo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-task=1
#SBATCH --time=00:30:00
set -euo pipefail
MODEL=${MODEL:-/shared/models/Wan2.1-T2V-14B-Diffusers}
# -K (--kill-on-bad-exit=1): if one task fails, Slurm ends the others at once instead of letting them
# wait for --dist-timeout seconds in a collective.
srun -K distvideo generate --model "$MODEL" --prompt "a red fox running through snow" \
    --output /shared/outputs/ --dist-timeout 900
