#!/bin/bash
# Map the Slurm task layout to the torch.distributed environment (one srun task per GPU), then exec.
# MASTER_ADDR / MASTER_PORT are exported by launch/submit.sh.
set -euo pipefail
export RANK="${SLURM_PROCID:?run under srun}"
export WORLD_SIZE="${SLURM_NTASKS:?run under srun}"
export LOCAL_RANK="${SLURM_LOCALID:?run under srun}"
export LOCAL_WORLD_SIZE="${SLURM_NTASKS_PER_NODE:-8}"
exec "$@"
