#!/usr/bin/env bash
# sbatch examples/slurm_batch.sh prompts.txt — a prompt file over 2 nodes: 16 GPUs as 4 replicas of cfg 2 x sp 2.
# Each replica generates its share of the prompts (balanced by cost); each replica's first rank writes its videos
# into the shared output folder; world rank 0 writes manifest.jsonl. Submitting the same job again resumes it.
#SBATCH --job-name=distvideo-batch
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-task=1
#SBATCH --time=04:00:00
set -euo pipefail
MODEL=${MODEL:-/shared/models/Wan2.1-T2V-14B-Diffusers}
PROMPTS=${1:?usage: sbatch examples/slurm_batch.sh PROMPTS_FILE}
srun -K distvideo generate --model "$MODEL" --prompts "$PROMPTS" --output /shared/outputs/eval-run/ \
    --replicas 4 --sp-size 2 --cfg-parallel --dist-timeout 900
