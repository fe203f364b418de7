#!/usr/bin/env bash
# System packages the tests need: Slurm (srun, with munge) and Open MPI (mpirun) for the launcher tests; Chromium and
# its WebDriver for the web page test of `distvideo serve` (Debian's packages; no browser is downloaded at run time).
# Installs them with apt-get when missing and running as root; otherwise says what to run.
set -euo pipefail
need=()
command -v srun >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages: ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
else
    echo "missing system packages for the tests: ${need[*]}" >&2
    echo "install them with: sudo apt-get install -y ${need[*]}" >&2
fi
