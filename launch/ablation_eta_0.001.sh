#!/bin/bash
# ablation eta 0.001 on DeepScaleR-1.5B-Preview (see recipes/ablation_eta_0.001.yaml).
# Submit from the repository root:  sbatch launch/ablation_eta_0.001.sh   (DRY_RUN=1 bash launch/ablation_eta_0.001.sh to preview)
# Written by launch/wrappers.py from its table: edit the row there, then run python launch/wrappers.py.
#SBATCH --job-name=laconic-ablation_eta_0.001
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

RECIPE=recipes/ablation_eta_0.001.yaml
HF_MODEL="${HF_MODEL:-/checkpoints/hf/DeepScaleR-1.5B-Preview}"
# the recipe's image, laconic-nemo:25.02 (containers/Dockerfile; laconic_nemo/plan/images.py)
CONTAINER="${CONTAINER:-/lustre/containers/laconic-nemo-25.02.sqsh}"
REPO_DIR="${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
# shellcheck source=launch/submit.sh
source "${REPO_DIR}/launch/submit.sh"
