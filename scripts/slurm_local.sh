#!/usr/bin/env bash
# Refuses to run unless KVSHOT_LOCAL_SLURM=1 is set (CI sets it): it acts as root on this machine.
# A single-node SLURM cluster on this machine, for testing the SLURM path: up | down.
#   up:   installs Debian's slurm-wlm + munge when missing (apt-get), creates /etc/munge/munge.key
#         only when there is none, writes /etc/slurm/slurm.conf for one node (a slurm.conf it did
#         not write is moved aside to slurm.conf.kvshot-backup and put back by `down`), and starts
#         munged, slurmctld and slurmd, recording each daemon it starts in /run/kvshot-slurm/.
#         It refuses when a slurmctld or slurmd it did not start is running (a real cluster node).
#   down: cancels the jobs of the cluster it started (only while its own slurmctld runs), stops
#         only the daemons whose pids `up` recorded, and restores a slurm.conf it moved aside.
# Root, no accounting storage (the executor plugin then needs --slurm-status-command squeue).
set -euo pipefail
if [ "${KVSHOT_LOCAL_SLURM:-}" != 1 ]; then
  echo "slurm_local.sh: refusing: it installs packages and starts SLURM daemons as root; set KVSHOT_LOCAL_SLURM=1 to run it (CI does)" >&2
  exit 2
fi
action=${1:-up}
case "$action" in
  up | down) ;;
  *) echo "slurm_local.sh: usage: KVSHOT_LOCAL_SLURM=1 bash scripts/slurm_local.sh up|down" >&2; exit 2 ;;
esac

state=/run/kvshot-slurm           # one pid file per daemon this script started
conf=/etc/slurm/slurm.conf
marker="# written by kvshot scripts/slurm_local.sh"

# the pid recorded in $state/$1.pid, when that process still runs under that name
recorded() {
  local file="$state/$1.pid" pid
  [ -s "$file" ] || return 1
  pid=$(cat "$file")
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] && echo "$pid"
}

stop() {   # stop one recorded daemon by its pid, wait up to 10 s, then forget it
  local pid
  if pid=$(recorded "$1"); then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$state/$1.pid"
}

if [ "$action" = down ]; then
  if recorded slurmctld >/dev/null; then   # our controller: every job it knows is a test job
    scancel --partition=debug >/dev/null 2>&1 || true
  fi
  stop slurmd
  stop slurmctld
  stop munged
  if [ -f "$conf.kvshot-backup" ]; then mv -f "$conf.kvshot-backup" "$conf"; fi
  exit 0
fi

# up: leave a SLURM that someone else runs alone
for daemon in slurmctld slurmd; do
  if pgrep -x "$daemon" >/dev/null && ! recorded "$daemon" >/dev/null; then
    echo "slurm_local.sh: a $daemon not started by this script is running; not touching it (stop it yourself, or use that cluster)" >&2
    exit 1
  fi
done

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
fi
mkdir -p "$state"

# munge: a generated key only when none exists, the daemon as its own user (an already running
# munged is used as it is, and not recorded, so `down` leaves it running)
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
fi
chown munge:munge /run/munge /var/lib/munge /var/log/munge
if ! pgrep -x munged >/dev/null; then
  runuser -u munge -- /usr/sbin/munged --force
  for _ in $(seq 1 20); do [ -s /run/munge/munged.pid ] && break; sleep 0.25; done
  cp /run/munge/munged.pid "$state/munged.pid"
fi

host=$(hostname -s)
cpus=$(nproc)
mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
if [ -f "$conf" ] && ! grep -qxF "$marker" "$conf" && [ ! -f "$conf.kvshot-backup" ]; then
  mv "$conf" "$conf.kvshot-backup"
fi
cat > "$conf" <<CONF
$marker
ClusterName=kvshot-test
SlurmctldHost=${host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=${state}/slurmctld.pid
SlurmdPidFile=${state}/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=${host} CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF

# the daemons write their own pid files into $state (SlurmctldPidFile, SlurmdPidFile above)
recorded slurmctld >/dev/null || slurmctld
recorded slurmd >/dev/null || slurmd
for _ in $(seq 1 30); do
  if sinfo -h -o '%T' 2>/dev/null | grep -q -E '^(idle|mixed|allocated)'; then
    sinfo
    exit 0
  fi
  sleep 1
done
echo "slurm_local.sh: the node did not come up; see /var/log/slurm/" >&2
exit 1
