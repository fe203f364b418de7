#!/usr/bin/env bash
# Start a private two-node Slurm on this machine for the launcher tests (srun -N 2 on CPU).
#
# Two emulated nodes, distvideo-n1 and distvideo-n2, both on this host: one slurmctld, one slurmd per node
# (`slurmd -N NAME`, each on its own port: Debian's slurm-wlm 22.05 runs several slurmd on one host this way)
# and a munged of its own (its own key and socket, so stopping it never touches another Slurm on the machine).
# The node names must resolve for ranks that derive MASTER_ADDR from the node list: when they do not, a line
# "127.0.0.1 distvideo-n1 distvideo-n2" is appended to /etc/hosts.
#
# Needs root (slurmctld and slurmd run as root, SlurmUser=root) and Debian's slurm-wlm + munge
# (scripts/install_system_deps.sh installs them).
#
# Everything lives in $DISTVIDEO_SLURM_DIR; when unset, a new private directory is created with mktemp. When the
# directory holds a running cluster of ours that answers `srun true`, the script returns at once (idempotent).
#   etc/slurm.conf   the configuration; every Slurm command needs SLURM_CONF=<that path>
#   log/             slurmctld.log, slurmd-<node>.log, munged.log (+ .stderr of each daemon start)
#   munge/           munge.key, munge.sock, munged.pid
#   env              "SLURM_CONF=..." line, for `source`
# Ports: DISTVIDEO_SLURM_CTLD_PORT and DISTVIDEO_SLURM_D_PORTS ("P1,P2"); by default free ports are chosen (bound
# to port 0 and released), and a start that finds one taken meanwhile is retried with new ones. The first job id
# is random (FirstJobId), so two such clusters on one machine rarely derive the same MASTER_PORT from a job id.
# On success stdout ends with "DISTVIDEO_SLURM_DIR=<dir>" and "SLURM_CONF=<path>"; on failure the daemon logs go to
# stderr and the exit status is non-zero. scripts/slurm/stop_local_slurm.sh stops the daemons of one directory.
# DISTVIDEO_SLURM_TIMEOUT: seconds to wait for the nodes (30).
set -euo pipefail

TIMEOUT=${DISTVIDEO_SLURM_TIMEOUT:-30}
NODES=(distvideo-n1 distvideo-n2)
NODELIST="distvideo-n[1-2]"
# Environment of an enclosing job would confuse our srun/sinfo.
unset SLURM_JOB_ID SLURM_JOBID SLURM_STEP_ID SLURM_STEPID SLURM_NODELIST SLURM_JOB_NODELIST SLURM_CONF_SERVER 2>/dev/null || true

log() { echo "[start_local_slurm] $*" >&2; }

if [ -n "${DISTVIDEO_SLURM_DIR:-}" ]; then
    DIR=$DISTVIDEO_SLURM_DIR
    if [ ! -e "$DIR" ]; then
        mkdir -m 755 -p "$DIR"
    fi
else
    DIR=$(mktemp -d "${TMPDIR:-/tmp}/distvideo-slurm.XXXXXXXX")
    chmod 755 "$DIR" # the daemons run as root; srun users must reach etc/ and the munge socket
fi
# a directory someone else planted (or a symlink to one) must not be used as root
if [ -L "$DIR" ] || [ ! -d "$DIR" ] || [ ! -O "$DIR" ]; then
    log "ERROR: $DIR is not a directory owned by $(id -un) (or is a symlink)"
    exit 1
fi
DIR=$(cd "$DIR" && pwd -P)
CONF=$DIR/etc/slurm.conf
LOG=$DIR/log
MUNGE=$DIR/munge
export SLURM_CONF=$CONF

dump_logs() {
    local f
    for f in "$LOG"/*.stderr "$LOG"/munged.log "$LOG"/slurmctld.log "$LOG"/slurmd-*.log; do
        if [ -s "$f" ]; then
            echo "----- $f (last 40 lines) -----" >&2
            tail -n 40 "$f" >&2 || true
        fi
    done
    echo "----- sinfo -----" >&2
    timeout 10 sinfo -N -l >&2 2>&1 || true
}

die() {
    log "ERROR: $*"
    dump_logs
    exit 1
}

proc_running() { # pid; a zombie (not yet reaped) counts as gone
    local st
    st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1) || return 1
    [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

pid_alive() { # pidfile
    local pid
    [ -s "$1" ] || return 1
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && proc_running "$pid"
}

stop_pid() { # pidfile name: signal the pid only while it still is that daemon (pids get reused)
    local pid
    [ -s "$1" ] || return 0
    pid=$(cat "$1" 2>/dev/null || true)
    if [[ $pid =~ ^[0-9]+$ ]] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do
            proc_running "$pid" || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}

stop_daemons() {
    local node
    for node in "${NODES[@]}"; do stop_pid "$DIR/slurmd-$node.pid" slurmd; done
    stop_pid "$DIR/slurmctld.pid" slurmctld
    stop_pid "$MUNGE/munged.pid" munged
}

for bin in srun sinfo scontrol munge mungekey; do
    command -v "$bin" >/dev/null 2>&1 || die "$bin not found; install with: apt-get install -y slurm-wlm munge"
done
SLURMCTLD=$(command -v slurmctld || echo /usr/sbin/slurmctld)
SLURMD=$(command -v slurmd || echo /usr/sbin/slurmd)
MUNGED=$(command -v munged || echo /usr/sbin/munged)
for bin in "$SLURMCTLD" "$SLURMD" "$MUNGED"; do
    [ -x "$bin" ] || die "$bin not found; install with: apt-get install -y slurm-wlm munge"
done

HOST=$(hostname -s 2>/dev/null || hostname)
[[ $HOST =~ ^[A-Za-z][A-Za-z0-9-]*$ ]] || HOST=localhost
CPUS=$(nproc)

healthy() {
    [ -f "$CONF" ] && pid_alive "$DIR/slurmctld.pid" && pid_alive "$MUNGE/munged.pid" || return 1
    local node
    for node in "${NODES[@]}"; do pid_alive "$DIR/slurmd-$node.pid" || return 1; done
    timeout 60 srun -N 2 -n 2 --overcommit -t 1 true >/dev/null 2>&1
}

mkdir -p "$DIR/etc" "$LOG" "$MUNGE"
# Serialise starts of this directory (the daemons must not inherit fd 9, hence the 9>&- below).
exec 9>"$DIR/.lock"
flock -w 120 9 || die "could not take $DIR/.lock"

if healthy; then
    log "already running ($CONF)"
    echo "DISTVIDEO_SLURM_DIR=$DIR"
    echo "SLURM_CONF=$CONF"
    exit 0
fi
[ "$(id -u)" = 0 ] || die "starting the local Slurm needs root (SlurmUser=root): sudo bash $0"

# The node names resolve to this host (ranks derive MASTER_ADDR from the node list).
missing_names=()
for node in "${NODES[@]}"; do getent hosts "$node" >/dev/null 2>&1 || missing_names+=("$node"); done
if [ ${#missing_names[@]} -gt 0 ]; then
    (
        flock -w 30 8 || exit 1
        for node in "${missing_names[@]}"; do
            getent hosts "$node" >/dev/null 2>&1 || echo "127.0.0.1 $node  # distvideo's local test Slurm" >>/etc/hosts
        done
    ) 8>>/etc/hosts.distvideo.lock || die "could not add ${missing_names[*]} to /etc/hosts"
    for node in "${NODES[@]}"; do getent hosts "$node" >/dev/null 2>&1 || die "$node does not resolve"; done
fi

free_ports() { # N: N distinct TCP ports that were free a moment ago
    local py
    py=$(command -v python3 || command -v python) || die "python3 is needed to pick free ports"
    "$py" - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

start_munge() {
    stop_pid "$MUNGE/munged.pid" munged
    chmod 755 "$MUNGE"
    if [ ! -s "$MUNGE/munge.key" ]; then
        mungekey --create --keyfile="$MUNGE/munge.key" --force >/dev/null
        chmod 0400 "$MUNGE/munge.key"
    fi
    rm -f "$MUNGE/munge.sock" "$MUNGE/munge.sock.lock"
    "$MUNGED" --force --socket="$MUNGE/munge.sock" --key-file="$MUNGE/munge.key" --pid-file="$MUNGE/munged.pid" \
        --log-file="$LOG/munged.log" --seed-file="$MUNGE/munged.seed" >"$LOG/munged.stderr" </dev/null 2>&1 9>&- ||
        die "munged failed to start"
    for _ in $(seq 1 50); do
        if timeout 5 munge -n -S "$MUNGE/munge.sock" </dev/null 2>/dev/null |
            timeout 5 unmunge -S "$MUNGE/munge.sock" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.2
    done
    die "munged did not come up"
}

write_conf() { # ctld_port d_port1 d_port2 first_job_id
    : >"$DIR/etc/plugstack.conf"
    cat >"$CONF.tmp" <<EOF
# Generated by scripts/slurm/start_local_slurm.sh: a private two-node Slurm for distvideo's launcher tests.
ClusterName=distvideo
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$1
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE/munge.sock
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
PlugStackConfig=$DIR/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=30
KillWait=5
Waittime=0
MessageTimeout=10
FirstJobId=$4
NodeName=${NODES[0]} NodeAddr=127.0.0.1 NodeHostname=$HOST Port=$2 CPUs=$CPUS RealMemory=1024 State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=127.0.0.1 NodeHostname=$HOST Port=$3 CPUs=$CPUS RealMemory=1024 State=UNKNOWN
PartitionName=debug Nodes=$NODELIST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    mv -f "$CONF.tmp" "$CONF"
    echo "SLURM_CONF=$CONF" >"$DIR/env"
}

port_taken() { grep -qsi "address already in use" "$LOG"/*.log "$LOG"/*.stderr; }

# Returns 0 when up, 2 when a port was taken (retry with new ones); dies otherwise.
start_cluster() { # ctld_port d_port1 d_port2
    local node state states deadline
    stop_daemons
    start_munge
    rm -rf "$DIR/state" "$DIR"/spool-*
    mkdir -p "$DIR/state"
    : >"$LOG/slurmctld.log"
    for node in "${NODES[@]}"; do : >"$LOG/slurmd-$node.log"; done
    write_conf "$1" "$2" "$3" $((RANDOM * 32 + RANDOM % 32 + 1000))
    "$SLURMCTLD" -i -f "$CONF" >"$LOG/slurmctld.stderr" </dev/null 2>&1 9>&- || die "slurmctld failed to start"
    for _ in $(seq 1 50); do
        timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP' && break
        if [ -s "$DIR/slurmctld.pid" ] && ! pid_alive "$DIR/slurmctld.pid"; then break; fi
        sleep 0.2
    done
    if ! timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; then
        port_taken && return 2
        die "slurmctld does not answer scontrol ping"
    fi
    for node in "${NODES[@]}"; do
        "$SLURMD" -N "$node" -f "$CONF" >"$LOG/slurmd-$node.stderr" </dev/null 2>&1 9>&- || die "slurmd -N $node failed"
    done
    deadline=$((SECONDS + TIMEOUT))
    while [ $SECONDS -lt $deadline ]; do
        for node in "${NODES[@]}"; do
            if [ -s "$DIR/slurmd-$node.pid" ] && ! pid_alive "$DIR/slurmd-$node.pid"; then
                port_taken && return 2
                die "slurmd -N $node exited"
            fi
        done
        pid_alive "$DIR/slurmctld.pid" || die "slurmctld exited"
        states=$(timeout 5 sinfo -h -N -o '%t' 2>/dev/null | sort -u | tr '\n' ' ' || true)
        case "$states" in
            "idle " | "mix " | "alloc ") return 0 ;;
        esac
        for node in "${NODES[@]}"; do
            state=$(timeout 5 sinfo -h -n "$node" -o '%t' 2>/dev/null | head -n 1 || true)
            case "$state" in
                down* | drain* | fail*) timeout 5 scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;;
            esac
        done
        sleep 0.3
    done
    die "nodes not idle after ${TIMEOUT}s (states: ${states:-none})"
}

up=0
for attempt in 1 2 3; do
    if [ -n "${DISTVIDEO_SLURM_CTLD_PORT:-}" ] && [ -n "${DISTVIDEO_SLURM_D_PORTS:-}" ]; then
        read -r ctld_port d_port1 d_port2 <<<"$DISTVIDEO_SLURM_CTLD_PORT ${DISTVIDEO_SLURM_D_PORTS/,/ }"
    else
        read -r ctld_port d_port1 d_port2 <<<"$(free_ports 3)"
    fi
    rc=0
    start_cluster "$ctld_port" "$d_port1" "$d_port2" || rc=$?
    if [ $rc = 0 ]; then
        up=1
        break
    fi
    log "a port was taken meanwhile (attempt $attempt); retrying with new ports"
done
[ $up = 1 ] || die "could not bind the Slurm ports after 3 attempts"

out=$(timeout 60 srun -N 2 -n 2 --overcommit -t 1 true 2>&1) || die "srun -N 2 -n 2 true failed: $out"

log "local Slurm up: nodes ${NODES[*]} ($CPUS CPUs each), ports $ctld_port/$d_port1/$d_port2, conf $CONF"
echo "DISTVIDEO_SLURM_DIR=$DIR"
echo "SLURM_CONF=$CONF"
