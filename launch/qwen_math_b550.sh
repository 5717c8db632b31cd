#!/bin/bash
# Paper run (cost ablation): Qwen2.5-Math-1.5B-Instruct, B = 550, 350 steps, clipped cost.
# Submit from the repository root:  sbatch launch/qwen_math_b550.sh   (DRY_RUN=1 bash launch/qwen_math_b550.sh to preview)
# Written by launch/wrappers.py from its table: edit the row there, then run python launch/wrappers.py.
#SBATCH --job-name=laconic-qwen_math_b550
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

RECIPE=recipes/qwen_math_1.5b_b550.yaml
HF_MODEL="${HF_MODEL:-/checkpoints/hf/Qwen2.5-Math-1.5B-Instruct}"
# the recipe's image, laconic-nemo:25.02 (containers/Dockerfile; laconic_nemo/plan/images.py)
CONTAINER="${CONTAINER:-/lustre/containers/laconic-nemo-25.02.sqsh}"
REPO_DIR="${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
# shellcheck source=launch/submit.sh
source "${REPO_DIR}/launch/submit.sh"
