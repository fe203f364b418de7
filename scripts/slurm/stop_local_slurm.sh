#!/usr/bin/env bash
# Stop the private Slurm that scripts/slurm/start_local_slurm.sh started in one directory: its slurmd of each node,
# slurmctld and munged. Only the pids in that directory's pid files are signalled, and only while they still are
# those daemons. Safe to run when nothing is running.
#
# usage: stop_local_slurm.sh [--remove] DIR        (or DISTVIDEO_SLURM_DIR=DIR stop_local_slurm.sh [--remove])
#   --remove   also delete DIR afterwards
set -uo pipefail

remove=0
if [ "${1:-}" = "--remove" ]; then
    remove=1
    shift
fi
DIR=${1:-${DISTVIDEO_SLURM_DIR:-}}
if [ -z "$DIR" ]; then
    echo "usage: $0 [--remove] DIR (the directory start_local_slurm.sh printed as DISTVIDEO_SLURM_DIR)" >&2
    exit 2
fi
[ -d "$DIR" ] || exit 0

log() { echo "[stop_local_slurm] $*" >&2; }

proc_running() { # pid; a zombie (not yet reaped) counts as gone
    local st
    st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

stop_pid() { # pidfile name
    local pid
    [ -s "$1" ] || return 0
    pid=$(cat "$1" 2>/dev/null || true)
    if [[ $pid =~ ^[0-9]+$ ]] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]; then
        log "stopping $2 (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do
            proc_running "$pid" || break
            sleep 0.1
        done
        if proc_running "$pid"; then
            log "$2 (pid $pid) ignored SIGTERM, sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$1"
}

for pidfile in "$DIR"/slurmd-*.pid; do
    [ -e "$pidfile" ] && stop_pid "$pidfile" slurmd
done
stop_pid "$DIR/slurmctld.pid" slurmctld
stop_pid "$DIR/munge/munged.pid" munged
if [ "$remove" = 1 ]; then
    rm -rf "$DIR"
fi
exit 0
