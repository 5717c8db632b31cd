#!/bin/bash
# Install what the `slurm` test tier needs (Debian/Ubuntu): slurm-wlm (slurmctld, slurmd, the client
# commands) and munge. A no-op when they are installed; exits non-zero when they cannot be installed.
set -euo pipefail
have() { command -v "$1" > /dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if have slurmctld && have slurmd && have sbatch && have munged; then
    echo "slurm-wlm and munge are installed"
    exit 0
fi
if ! command -v apt-get > /dev/null 2>&1; then
    echo "no apt-get here: install slurm-wlm and munge by hand" >&2
    exit 1
fi
if [ "$(id -u)" != 0 ]; then
    echo "installing slurm-wlm and munge needs root" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq slurm-wlm munge
have slurmctld && have slurmd && have sbatch && have munged
