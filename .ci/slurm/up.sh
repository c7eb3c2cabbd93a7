#!/usr/bin/env bash
# Bring up a one-node Slurm cluster (slurmctld + slurmd + munged) on localhost
# for integration tests.  Idempotent: re-running it on a healthy cluster is a
# no-op that returns in well under a second.
#
# Debian 12 (bookworm) ships Slurm 22.05.  Must run as root.  No systemd
# required: the daemons are started by hand and detach themselves.
#
# Environment knobs (all optional):
#   SLURM_CI_CPUS        CPUs to advertise for the node (default: nproc).  If it
#                        exceeds the real count, SlurmdParameters=config_overrides
#                        is set so slurmd accepts it (lets more 1-CPU array tasks
#                        run concurrently on a small CI box).
#   SLURM_CI_DEFMEM      DefMemPerCPU in MB for jobs that do not ask for --mem
#                        (default 1024).  Memory is not enforced (no cgroups); this
#                        only drives scheduling.
#   SLURM_CI_TIMEOUT     seconds to wait for the node to become idle (default 60).
#   SLURM_CI_CLEAN=1     start slurmctld with -c (drop saved job state).
set -euo pipefail

log() { printf '[slurm-up] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $(id -u) -eq 0 ]] || die "must run as root"

# shellcheck source=.ci/slurm/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # alive, live_pids

T0=$(date +%s.%N)
elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }

PKGS=(slurmctld slurmd slurm-client munge)
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
CTLD_STATE=/var/spool/slurmctld
SLURMD_SPOOL=/var/spool/slurmd
RUN_DIR=/run/slurm
TIMEOUT=${SLURM_CI_TIMEOUT:-60}

# --------------------------------------------------------------------------
# 1. Packages
# --------------------------------------------------------------------------
missing=()
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
        missing+=("$p")
    fi
done
if ((${#missing[@]})); then
    log "installing: ${missing[*]}"
    t_inst=$(date +%s)
    # Keep postinst scripts from trying to start services (no init system here).
    created_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        created_policy=1
        trap '[[ $created_policy -eq 1 ]] && rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    export DEBIAN_FRONTEND=noninteractive
    ok=0
    for attempt in 1 2 3; do
        if apt-get update -qq &&
            apt-get install -y -qq --no-install-recommends \
                -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
                "${PKGS[@]}" >/tmp/slurm-ci-apt.log 2>&1; then
            ok=1
            break
        fi
        log "apt attempt $attempt failed; tail of /tmp/slurm-ci-apt.log:"
        tail -n 20 /tmp/slurm-ci-apt.log >&2 || true
        sleep $((attempt * 5))
    done
    if [[ $created_policy -eq 1 ]]; then
        rm -f /usr/sbin/policy-rc.d
        created_policy=0
    fi
    ((ok)) || die "apt-get install failed"
    log "packages installed in $(($(date +%s) - t_inst)) s"
fi

# --------------------------------------------------------------------------
# 2. Host name must resolve (slurmd/slurmctld look it up)
# --------------------------------------------------------------------------
HOST=$(hostname -s)
[[ -n $HOST ]] || die "hostname -s is empty"
if ! getent hosts "$HOST" >/dev/null; then
    log "adding $HOST to /etc/hosts"
    printf '127.0.0.1\t%s\n' "$HOST" >>/etc/hosts
fi

# --------------------------------------------------------------------------
# 3. Munge
# --------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge
install -d -o munge -g munge -m 0700 /var/lib/munge
install -d -o munge -g munge -m 0700 /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    if command -v mungekey >/dev/null; then
        mungekey --create --keyfile=/etc/munge/munge.key --force
    else
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
    # A stale pid/socket from an earlier (killed) munged blocks a restart.
    if [[ -z $(live_pids munged) ]]; then
        rm -f /run/munge/munged.pid /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
    fi
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged </dev/null >>/var/log/munge/munged.start.log 2>&1 ||
        die "munged failed to start: $(tail -n 5 /var/log/munge/munged.log 2>/dev/null)"
    for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
    munge_ok || die "munge -n | unmunge fails after starting munged"
fi

# --------------------------------------------------------------------------
# 4. slurm.conf
# --------------------------------------------------------------------------
install -d -m 0755 "$CONF_DIR" "$LOG_DIR" "$RUN_DIR"
install -d -m 0700 "$CTLD_STATE"
install -d -m 0755 "$SLURMD_SPOOL"

REAL_CPUS=$(nproc)
CPUS=${SLURM_CI_CPUS:-$REAL_CPUS}
# Memory as slurmd sees it, minus a small margin so the node is never drained
# for "Low RealMemory" if the kernel reports a few MB less on the next start.
MEM=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]\+\).*/\1/p' | head -n1)
[[ -n $MEM ]] || MEM=$(awk '/MemTotal/{print int($2/1024)}' /proc/meminfo)
MEM=$((MEM > 1024 ? MEM - 256 : MEM))
# Keep the value already in slurm.conf if it is still valid (<= what slurmd
# sees, and not far below), so tiny fluctuations don't rewrite the config and
# restart the daemons on every re-run.
OLD_MEM=$(sed -n "s/^NodeName=$HOST .*RealMemory=\([0-9]\+\).*/\1/p" "$CONF" 2>/dev/null | head -n1 || true)
if [[ -n $OLD_MEM ]] && ((OLD_MEM <= MEM + 256 && OLD_MEM >= MEM * 9 / 10)); then
    MEM=$OLD_MEM
fi
DEFMEM=${SLURM_CI_DEFMEM:-1024}
SLURMD_PARAMS=""
if ((CPUS > REAL_CPUS)); then
    SLURMD_PARAMS="SlurmdParameters=config_overrides"
fi

NEW_CONF=$(mktemp)
trap 'rm -f "$NEW_CONF"' EXIT
cat >"$NEW_CONF" <<EOF
# Generated by .ci/slurm/up.sh -- one-node test cluster on localhost.
ClusterName=mmenc-ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
# Credential lifetime; also how long a requeued job waits before it may start
# again (default 120 s, minimum 5).
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
SwitchType=switch/none

# No cgroups in a container: plain /proc based process tracking, no task plugin.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true

StateSaveLocation=$CTLD_STATE
SlurmdSpoolDir=$SLURMD_SPOOL
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info

# Scheduling: consumable CPUs + memory, so several 1-CPU array tasks share the node.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=$DEFMEM

# Fast turnaround for tests.
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
Waittime=0
MessageTimeout=10
# Keep finished jobs visible to scontrol for 5 minutes (accounting is off).
MinJobAge=300
MaxArraySize=10001
$SLURMD_PARAMS

NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF

conf_changed=0
if [[ ! -f $CONF ]] || ! cmp -s "$NEW_CONF" "$CONF"; then
    log "writing $CONF"
    install -m 0644 "$NEW_CONF" "$CONF"
    conf_changed=1
fi
# No cgroup.conf: with proctrack/linuxproc + task/none, slurmd 22.05 never
# reads it (checked: starts and runs jobs cleanly without one).

# --------------------------------------------------------------------------
# 5. Daemons
# --------------------------------------------------------------------------
pid_alive() { [[ -f $1 ]] && alive "$(cat "$1" 2>/dev/null)"; }
ctld_up() { pid_alive "$RUN_DIR/slurmctld.pid" && scontrol ping 2>/dev/null | grep -q 'is UP'; }

if ((conf_changed)); then
    # Configuration changed under running daemons: restart them.
    for d in slurmd slurmctld; do
        if pid_alive "$RUN_DIR/$d.pid"; then
            log "config changed; stopping $d"
            kill "$(cat "$RUN_DIR/$d.pid")" || true
            for _ in $(seq 100); do pid_alive "$RUN_DIR/$d.pid" || break; sleep 0.1; done
        fi
    done
fi

if ! pid_alive "$RUN_DIR/slurmctld.pid"; then
    args=()
    [[ ${SLURM_CI_CLEAN:-0} == 1 ]] && args+=(-c)
    log "starting slurmctld ${args[*]}"
    setsid slurmctld "${args[@]}" </dev/null >>"$LOG_DIR/slurmctld.start.log" 2>&1 ||
        { tail -n 30 "$LOG_DIR/slurmctld.start.log" "$LOG_DIR/slurmctld.log" >&2 2>/dev/null; die "slurmctld failed to start"; }
fi
for _ in $(seq $((TIMEOUT * 5))); do ctld_up && break; sleep 0.2; done
ctld_up || { tail -n 40 "$LOG_DIR/slurmctld.log" >&2 2>/dev/null; die "slurmctld not responding"; }

slurmd_started_at=0
if ! pid_alive "$RUN_DIR/slurmd.pid"; then
    log "starting slurmd"
    slurmd_started_at=$(($(date +%s) - 1))
    setsid slurmd </dev/null >>"$LOG_DIR/slurmd.start.log" 2>&1 ||
        { tail -n 30 "$LOG_DIR/slurmd.start.log" "$LOG_DIR/slurmd.log" >&2 2>/dev/null; die "slurmd failed to start"; }
fi

# --------------------------------------------------------------------------
# 6. Wait for the node to be usable
# --------------------------------------------------------------------------
deadline=$(($(date +%s) + TIMEOUT))
state=""
resumed=0
while :; do
    state=$(sinfo -h -N -n "$HOST" -o '%T' 2>/dev/null | head -n1 || true)
    # After a fresh slurmd start, the controller may still show the saved node
    # state; wait until this slurmd instance has registered.
    if ((slurmd_started_at)) && [[ $state != *'*' ]]; then
        reg=$(scontrol show node "$HOST" 2>/dev/null | sed -n 's/.*SlurmdStartTime=\([^ ]*\).*/\1/p')
        reg_ts=$(date -d "${reg:-@0}" +%s 2>/dev/null || echo 0)
        ((reg_ts >= slurmd_started_at)) || state="$state(registering)"
    fi
    case $state in
        idle | mixed | allocated | completing) break ;;
        down* | drain* | fail* | *inval*)
            if ((!resumed)) || ((resumed % 10 == 0)); then
                log "node state '$state' (reason: $(sinfo -h -N -n "$HOST" -o '%E' 2>/dev/null)); resuming"
                scontrol update nodename="$HOST" state=resume 2>/dev/null || true
            fi
            resumed=$((resumed + 1))
            ;;
    esac
    if (($(date +%s) >= deadline)); then
        log "node $HOST not idle after ${TIMEOUT}s (state='$state')"
        sinfo -N -l >&2 || true
        scontrol show node "$HOST" >&2 || true
        for f in slurmctld.log slurmd.log slurmd.start.log slurmctld.start.log; do
            [[ -f $LOG_DIR/$f ]] && { echo "--- $LOG_DIR/$f" >&2; tail -n 40 "$LOG_DIR/$f" >&2; }
        done
        exit 1
    fi
    # slurmd died (e.g. config error)? Say so right away.
    if ! pid_alive "$RUN_DIR/slurmd.pid" && [[ -z $(live_pids slurmd) ]]; then
        echo "--- $LOG_DIR/slurmd.log" >&2
        tail -n 40 "$LOG_DIR/slurmd.log" >&2 2>/dev/null || true
        die "slurmd is not running"
    fi
    sleep 0.5
done

log "node $HOST is $state (CPUs=$CPUS RealMemory=${MEM}M) after $(elapsed) s"
