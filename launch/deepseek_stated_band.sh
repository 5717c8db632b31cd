#!/bin/bash
# Beyond the paper: DeepSeek-R1-Distill-Qwen-1.5B, stated budgets 500-3000 with the band [rho B, B] per budget.
# Submit from the repository root:  sbatch launch/deepseek_stated_band.sh   (DRY_RUN=1 bash launch/deepseek_stated_band.sh to preview)
# Written by launch/wrappers.py from its table: edit the row there, then run python launch/wrappers.py.
#SBATCH --job-name=laconic-deepseek_stated_band
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

RECIPE=recipes/deepseek_1.5b_stated_band.yaml
HF_MODEL="${HF_MODEL:-/checkpoints/hf/DeepSeek-R1-Distill-Qwen-1.5B}"
# the recipe's image, laconic-nemo:25.02 (containers/Dockerfile; laconic_nemo/plan/images.py)
CONTAINER="${CONTAINER:-/lustre/containers/laconic-nemo-25.02.sqsh}"
REPO_DIR="${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
# shellcheck source=launch/submit.sh
source "${REPO_DIR}/launch/submit.sh"
