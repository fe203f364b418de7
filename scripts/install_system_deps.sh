#!/usr/bin/env bash
# System packages the test suite needs: Slurm (srun, with munge), Open MPI (mpirun), MPICH beside it
# (mpiexec.mpich; Debian keeps `mpirun` pointing at Open MPI, priority 50 against MPICH's 40), bindfs
# (a FUSE filesystem without O_TMPFILE, for the atomic video writer's fallback path), and Chromium with its WebDriver
# for the web page test of `distvideo serve` (Debian's packages; no browser is downloaded at run time).
# Installs what is missing with apt-get when running as root; otherwise exits 1 naming what to install:
# `make test` must not go on to skip or fail those tests one by one.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ]; }
need=()
have srun || need+=(slurm-wlm)
have slurmctld || need+=(slurmctld)
have slurmd || need+=(slurmd)
have munged || need+=(munge)
have mpirun.openmpi || need+=(openmpi-bin)
have mpiexec.mpich || need+=(mpich)
have bindfs || need+=(bindfs)
have chromium || need+=(chromium)
have chromedriver || need+=(chromium-driver)
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "missing system packages for the test suite: ${need[*]}" >&2
    echo "install them with: sudo apt-get install -y --no-install-recommends ${need[*]}" >&2
    exit 1
fi
echo "installing system packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
for tool in srun slurmctld slurmd munged mpirun.openmpi mpiexec.mpich bindfs chromium chromedriver; do
    have "$tool" || { echo "apt-get installed ${need[*]} but $tool is still missing" >&2; exit 1; }
done
