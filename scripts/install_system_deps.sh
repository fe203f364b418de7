#!/usr/bin/env bash
# System packages the launcher tests need: Slurm (srun, with munge) and Open MPI (mpirun).
# Installs them with apt-get when missing and running as root; otherwise says what to run.
set -euo pipefail
need=()
command -v srun >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
    echo "missing system packages for launcher tests: ${need[*]}" >&2
    echo "install them with: sudo apt-get install -y ${need[*]}" >&2
fi
