#!/usr/bin/env bash
# Stop the single-node SLURM cluster of scripts/slurm-up.sh: each daemon by the pid in its pid file.
# PURGE=1 also removes the packages, the configuration and the saved state.
set -uo pipefail

stop() { # name pidfile
    local pid
    [ -s "$2" ] || return 0
    pid=$(cat "$2")
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        echo "slurm-down: stopped $1 ($pid)"
    fi
    rm -f "$2"
}

stop slurmd /run/slurm/slurmd.pid
stop slurmctld /run/slurm/slurmctld.pid
stop munged /run/munge/munged.pid

if [ "${PURGE:-0}" = 1 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq slurm-wlm slurmctld slurmd slurm-client munge >/dev/null
    rm -rf /etc/slurm /etc/munge /var/lib/slurm /var/log/slurm /run/slurm /run/munge \
        "${FAKE_GPU_DIR:-/run/draftsmith-fake-gpus}"
    echo "slurm-down: packages and state removed"
fi
exit 0
