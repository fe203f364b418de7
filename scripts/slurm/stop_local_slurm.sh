#!/usr/bin/env bash
# Stop the single-node Slurm started by scripts/slurm/start_local_slurm.sh (slurmd, slurmctld and,
# when that script started it, munged). Only the pids in our pid files are signalled.
# Pass --keep-munge to leave munged running. Safe to run when nothing is running.
set -uo pipefail

DIR=${DISTVIDEO_SLURM_DIR:-/tmp/distvideo-slurm}
keep_munge=0
[ "${1:-}" = "--keep-munge" ] && keep_munge=1

log() { echo "[stop_local_slurm] $*" >&2; }

proc_running() { # pid; a zombie (not yet reaped by pid 1) counts as gone
    local st
    st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

stop_pid() { # pidfile name
    local pid i
    [ -s "$1" ] || return 0
    pid=$(cat "$1" 2>/dev/null || true)
    # Only signal the pid when it still is that daemon (pids get reused after a reboot or crash).
    if [[ $pid =~ ^[0-9]+$ ]] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]; then
        log "stopping $2 (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 1 50); do
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

stop_pid "$DIR/slurmd.pid" slurmd
stop_pid "$DIR/slurmctld.pid" slurmctld
if [ "$keep_munge" = 0 ] && [ -f "$DIR/munged.started-by-us" ]; then
    stop_pid /run/munge/munged.pid munged
    rm -f "$DIR/munged.started-by-us"
fi
exit 0
