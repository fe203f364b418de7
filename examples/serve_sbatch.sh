#!/usr/bin/env bash
# sbatch examples/serve_sbatch.sh — serve the video API from a Slurm allocation (docs/serving.md).
# srun starts one task per GPU; world rank 0 runs the HTTP server, the other ranks run each job with it.
#SBATCH --job-name=distvideo-serve
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-task=1
#SBATCH --time=08:00:00
#SBATCH --signal=TERM@60
set -euo pipefail
MODEL=${MODEL:-/shared/models/Wan2.1-T2V-14B-Diffusers}
# --signal=TERM@60: every task gets SIGTERM 60 s before the time limit; the server stops admission, lets the running
# job finish within --shutdown-grace (keep it below Slurm's KillWait, 30 s by default) and every rank exits 0.
# -K: if a task dies, Slurm ends the others; the server exits nonzero so the job can be requeued.
# --host 0.0.0.0: clients are on other machines, so require an API key (read from the environment).
export DISTVIDEO_API_KEY=${DISTVIDEO_API_KEY:?set DISTVIDEO_API_KEY}
srun -K distvideo serve --model "$MODEL" --host 0.0.0.0 --port 8000 --output /shared/distvideo-serve/ \
    --shutdown-grace 20
