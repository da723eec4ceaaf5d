#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, from Debian's packages, with fake GPUs.
#
# For CI (.ci/run) and `make slurm-check`: run as root on Debian/Ubuntu; about 30 s on a fresh machine
# (mostly apt), a few seconds when the packages are installed. Idempotent: a healthy cluster is left as is.
# No systemd needed: munged, slurmctld and slurmd are started directly and stopped by scripts/slurm-down.sh.
#
# The fake GPUs are character devices (clones of /dev/null): slurmd refuses regular files and drops
# file-less GPUs, but schedules char devices as GRES, so `sbatch --gpus=2` jobs are placed, counted
# and given CUDA_VISIBLE_DEVICES=0,1 exactly as on a GPU node.
#
# No accounting database (slurmdbd): sacct fails here, so Snakemake's slurm executor must be told
# `--slurm-status-command squeue`, or it waits forever for job states.
#
# Knobs: FAKE_GPUS (default 4; 0 = no GRES), FAKE_GPU_DIR, PARTITION (default gpu, as in profiles/slurm).
set -euo pipefail

FAKE_GPUS=${FAKE_GPUS:-4}
FAKE_GPU_DIR=${FAKE_GPU_DIR:-/run/draftsmith-fake-gpus}
PARTITION=${PARTITION:-gpu}  # the name profiles/slurm uses
START=$(date +%s.%N)

say() { printf 'slurm-up: %s\n' "$*"; }
die() { printf 'slurm-up: error: %s\n' "$*" >&2; exit 1; }
elapsed() { awk -v s="$START" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }'; }

[ "$(id -u)" = 0 ] || die "run as root (installs packages and starts daemons)"
[ "$(uname -s)" = Linux ] || die "Linux only"

HOST=$(hostname -s)
CPUS=$(nproc)
# 90% of the memory, so slurmd's own measurement never falls below what is declared (that drains the node).
MEM_MB=$(awk '/MemTotal/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo)
GRES=""
[ "$FAKE_GPUS" -gt 0 ] && GRES="Gres=gpu:fake:$FAKE_GPUS"

healthy() {
    scontrol ping 2>/dev/null | grep -q UP &&
        sinfo -h -N -p "$PARTITION" -o '%t %G' 2>/dev/null | grep -Eq "^(idle|mix|alloc|comp)[^ ]* ${GRES:+gpu:fake:$FAKE_GPUS}"
}

if command -v scontrol >/dev/null && healthy; then
    say "cluster already up: $(sinfo -h -o '%P %a %D %t %c %m %G')"
    exit 0
fi

# --- packages ---------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurm-wlm slurmctld slurmd slurm-client munge >/dev/null
    say "packages installed (+$(elapsed) s)"
fi

# --- stop whatever an earlier run (or a package's init script) left running --------------------------
bash "$(dirname "$0")/slurm-down.sh" >/dev/null

# --- munge --------------------------------------------------------------------------------------------
[ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key -f; }
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
# runuser, not su: su leaves a zombie behind.
runuser -u munge -- /usr/sbin/munged
for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
munge -n | unmunge >/dev/null || die "munged does not answer"

# --- fake GPUs ------------------------------------------------------------------------------------------
rm -rf "$FAKE_GPU_DIR"
if [ "$FAKE_GPUS" -gt 0 ]; then
    install -d "$FAKE_GPU_DIR"
    for i in $(seq 0 $((FAKE_GPUS - 1))); do mknod "$FAKE_GPU_DIR/gpu$i" c 1 3; done
fi

# --- configuration ----------------------------------------------------------------------------------------
install -d -o slurm -g slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm /run/slurm
cat >/etc/slurm/slurm.conf <<EOF
# Written by draftsmith's scripts/slurm-up.sh: one node, fake GPUs, no accounting database.
ClusterName=draftsmith
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without it a job that names no memory takes the whole node and jobs run one at a time.
DefMemPerCPU=1000
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Finished jobs stay visible to squeue for 5 minutes: Snakemake's squeue status check needs that.
MinJobAge=300
KillWait=5
GresTypes=gpu
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB $GRES State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
if [ "$FAKE_GPUS" -gt 0 ]; then
    cat >/etc/slurm/gres.conf <<EOF
AutoDetect=off
NodeName=$HOST Name=gpu Type=fake File=$FAKE_GPU_DIR/gpu[0-$((FAKE_GPUS - 1))]
EOF
else
    rm -f /etc/slurm/gres.conf
fi

# --- daemons ------------------------------------------------------------------------------------------------
/usr/sbin/slurmctld
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
scontrol ping | grep -q UP || die "slurmctld is not up; see /var/log/slurm/slurmctld.log"
/usr/sbin/slurmd
# A node drained by an earlier bad configuration stays drained across restarts (saved state): resume it.
for _ in $(seq 150); do
    state=$(sinfo -h -N -o '%t' 2>/dev/null | head -1)
    case "$state" in
        idle*) break ;;
        drain* | down*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.2
done
[[ "$state" == idle* ]] || die "node $HOST is '$state', not idle; see /var/log/slurm/slurmd.log"

# --- smoke test: a GPU job is scheduled and sees its devices -----------------------------------------------
if [ "$FAKE_GPUS" -gt 0 ]; then
    got=$(timeout -k 5 60 srun --gpus=2 --mem=100 bash -c 'echo "$CUDA_VISIBLE_DEVICES"')
    [ "$got" = "0,1" ] || die "srun --gpus=2 saw CUDA_VISIBLE_DEVICES='$got', expected 0,1"
else
    timeout -k 5 60 srun --mem=100 true
fi
say "cluster ready in $(elapsed) s: $(sinfo -h -o '%P %a %D %t %c %m %G')"
