#!/bin/bash
# Paper run: Qwen3-8B, B = 1000, 150 steps (megatron-core actor + HF bridge, TP 4 x PP 2 x DP 4).
# Submit from the repository root:  sbatch launch/qwen3_8b_b1000.sh   (DRY_RUN=1 bash launch/qwen3_8b_b1000.sh to preview)
# Written by launch/wrappers.py from its table: edit the row there, then run python launch/wrappers.py.
#SBATCH --job-name=laconic-qwen3_8b_b1000
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

RECIPE=recipes/qwen3_8b_b1000.yaml
# the recipe's image, laconic-mcore:25.12 (containers/Dockerfile.mcore; laconic_nemo/plan/images.py)
CONTAINER="${CONTAINER:-/lustre/containers/laconic-mcore-25.12.sqsh}"
REPO_DIR="${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
# shellcheck source=launch/submit.sh
source "${REPO_DIR}/launch/submit.sh"
