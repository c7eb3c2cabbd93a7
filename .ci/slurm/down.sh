#!/usr/bin/env bash
# Stop the one-node test cluster started by up.sh: cancel all jobs, then stop
# slurmd, slurmctld and munged.  Safe to run when nothing is running.
# Pass --keep-munge to leave munged running.
set -uo pipefail

log() { printf '[slurm-down] %s\n' "$*" >&2; }

RUN_DIR=/run/slurm
keep_munge=0
[[ ${1:-} == --keep-munge ]] && keep_munge=1

# shellcheck source=.ci/slurm/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # alive, live_pids
pid_of() { [[ -f $1 ]] && cat "$1" 2>/dev/null; }

stop_pidfile() { # name pidfile
    local name=$1 pidfile=$2 pid
    pid=$(pid_of "$pidfile") || true
    if [[ -z ${pid:-} ]] || ! alive "$pid"; then
        # Fall back to an exact-name match (e.g. pid file lost).
        pid=$(live_pids "$name" | tr '\n' ' ')
    fi
    [[ -n ${pid// /} ]] || return 0
    log "stopping $name ($pid)"
    # shellcheck disable=SC2086
    kill -TERM $pid 2>/dev/null || true
    local p left
    for _ in $(seq 100); do
        left=""
        for p in $pid; do alive "$p" && left+="$p "; done
        [[ -z $left ]] && break
        sleep 0.1
    done
    pid=$left
    if [[ -n $pid ]]; then
        log "$name did not exit; sending KILL"
        # shellcheck disable=SC2086
        kill -KILL $pid 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q 'is UP'; then
    jobs=$(squeue -h -o '%F' 2>/dev/null | sort -u | tr '\n' ' ')
    if [[ -n ${jobs// /} ]]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null || true
        for _ in $(seq 150); do
            [[ -z $(squeue -h -o '%A' 2>/dev/null) ]] && break
            sleep 0.1
        done
    fi
fi

stop_pidfile slurmd "$RUN_DIR/slurmd.pid"
stop_pidfile slurmctld "$RUN_DIR/slurmctld.pid"
# Job steps survive slurmd under proctrack/linuxproc if cancellation was slow.
steps=$(live_pids slurmstepd | tr '\n' ' ')
if [[ -n ${steps// /} ]]; then
    log "killing leftover slurmstepd: $steps"
    # shellcheck disable=SC2086
    kill -KILL $steps 2>/dev/null || true
fi
if ((!keep_munge)); then
    stop_pidfile munged /run/munge/munged.pid
fi
log "stopped"
exit 0
