#!/bin/bash
# Body shared by the per-recipe sbatch scripts in launch/ (they set RECIPE and source this file).
#
#   sbatch launch/deepseek_b1500.sh                    # from the repository root (or set REPO_DIR)
#   DRY_RUN=1 bash launch/deepseek_b1500.sh            # print every command, run nothing
#
# Steps, each an srun inside the container (pyxis/enroot):
#   1. plan     validate the recipe for this layout (no GPU, no model): exit code 2 on a bad layout/key
#   2. prepare  convert the HF checkpoint to .nemo when model.path is missing (NeMo-Aligner recipes)
#   3. train    one task per GPU; resumes from the latest checkpoint in run.output_dir
# Preemption: Slurm sends SIGUSR1 to this shell (--signal=B:USR1@...) or SIGTERM; the trap forwards
# SIGUSR1 to the training step, the trainer checkpoints at the end of the current step and exits,
# then this script requeues the job, which resumes from that checkpoint.
#
# Environment (defaults in brackets):
#   RECIPE (required), HF_MODEL [none]: HF checkpoint (container path) converted when the .nemo is missing
#   CONTAINER [/lustre/containers/laconic-nemo-25.02.sqsh], DATA_DIR [/lustre/data],
#   CKPT_DIR [/lustre/checkpoints], RESULTS_DIR [/lustre/results], MOUNTS [derived from those],
#   GPUS_PER_NODE [8], EXTRA_OVERRIDES [none]: extra key=value overrides, DRY_RUN [0]
set -euo pipefail

: "${RECIPE:?RECIPE must name a recipe, e.g. recipes/deepseek_1.5b_b1500.yaml}"
REPO_DIR="${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
DRY_RUN="${DRY_RUN:-0}"
HF_MODEL="${HF_MODEL:-}"
CONTAINER="${CONTAINER:-/lustre/containers/laconic-nemo-25.02.sqsh}"
DATA_DIR="${DATA_DIR:-/lustre/data}"
CKPT_DIR="${CKPT_DIR:-/lustre/checkpoints}"
RESULTS_DIR="${RESULTS_DIR:-/lustre/results}"
REPO_IN_CONTAINER=/opt/laconic-nemo
MOUNTS="${MOUNTS:-${DATA_DIR}:/data,${CKPT_DIR}:/checkpoints,${RESULTS_DIR}:/results,${REPO_DIR}:${REPO_IN_CONTAINER}}"
# The node count comes from the allocation; outside Slurm (dry run) from the wrapper's #SBATCH line.
NODES="${SLURM_JOB_NUM_NODES:-$(sed -n 's/^#SBATCH --nodes=\([0-9]*\).*/\1/p' "$0" | sed -n '1p')}"
NODES="${NODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
JOB_ID="${SLURM_JOB_ID:-dryrun}"
RESTART="${SLURM_RESTART_COUNT:-0}"
RUN_NAME="$(basename "${RECIPE}" .yaml)"
# run.output_dir of the recipes is /results/${run.name}: the same folder seen from the host.
JOB_LOG_DIR="${RESULTS_DIR}/${RUN_NAME}/logs/job_${JOB_ID}_restart${RESTART}"
read -r -a OVERRIDES <<< "${EXTRA_OVERRIDES:-}"

first_host() {
    if command -v scontrol > /dev/null 2>&1 && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
        # sed reads all input (head would close the pipe early: SIGPIPE fails the pipeline under pipefail)
        scontrol show hostnames "${SLURM_JOB_NODELIST}" | sed -n '1p'
    else
        # dry run away from Slurm: the first host of a list such as "node[01-04,07],gpu3" or "a,b"
        local list="${SLURM_JOB_NODELIST:-localhost}"
        if [[ "${list}" =~ ^([^,\[]+)\[([0-9]+) ]]; then
            echo "${BASH_REMATCH[1]}${BASH_REMATCH[2]}"
        else
            echo "${list%%,*}"
        fi
    fi
}

export MASTER_ADDR
MASTER_ADDR="$(first_host)"
if [[ "${JOB_ID}" =~ ^[0-9]+$ ]]; then
    export MASTER_PORT=$((20000 + JOB_ID % 20000))
else
    export MASTER_PORT=29500
fi

# NCCL / CUDA settings for multi-node H100 (InfiniBand); override any of them from the environment.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"   # megatron TP/SP overlap ordering
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export TORCH_NCCL_AVOID_RECORD_STREAMS="${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export PYTHONPATH="${REPO_IN_CONTAINER}${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1
export HF_MODEL

SRUN_CONTAINER=(--container-image="${CONTAINER}" --container-mounts="${MOUNTS}" --no-container-mount-home
                --container-workdir="${REPO_IN_CONTAINER}" --export=ALL)

run() {
    if [ "${DRY_RUN}" = "1" ]; then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

TRAIN_PID=""
PREEMPTED=0
# shellcheck disable=SC2317  # invoked by the traps below
forward_signal() {
    PREEMPTED=1
    echo "$(date -u +%FT%TZ) caught SIG$1: asking the trainer to checkpoint and stop" >&2
    if [ -n "${TRAIN_PID}" ]; then
        kill -USR1 "${TRAIN_PID}" 2> /dev/null || true   # srun relays SIGUSR1 to every task
    fi
}
trap 'forward_signal USR1' USR1
trap 'forward_signal TERM' TERM

echo "laconic-nemo: recipe ${RECIPE}, ${NODES} nodes x ${GPUS_PER_NODE} GPUs, job ${JOB_ID} (restart ${RESTART})"
echo "laconic-nemo: master ${MASTER_ADDR}:${MASTER_PORT}, logs ${JOB_LOG_DIR}"
run mkdir -p "${JOB_LOG_DIR}"

# 1. plan: validate recipe and layout inside the container (paths as the job sees them).
run srun --nodes=1 --ntasks-per-node=1 "${SRUN_CONTAINER[@]}" --output="${JOB_LOG_DIR}/plan.log" \
    python -m laconic_nemo plan "${RECIPE}" --nodes="${NODES}" --gpus-per-node="${GPUS_PER_NODE}" \
    ${HF_MODEL:+--hf-model="${HF_MODEL}"} "${OVERRIDES[@]}"

# 2. prepare: HF -> .nemo conversion when the recipe's .nemo checkpoint is missing (rank 0 only).
if [ -n "${HF_MODEL}" ]; then
    run srun --nodes=1 --ntasks-per-node=1 --gpus-per-node=1 "${SRUN_CONTAINER[@]}" \
        --output="${JOB_LOG_DIR}/prepare.log" \
        python -m laconic_nemo.nemo_entry --prepare --hf-model="${HF_MODEL}" "${RECIPE}" "${OVERRIDES[@]}"
fi

# 3. train: one task per GPU (RANK / WORLD_SIZE / LOCAL_RANK mapped from Slurm by launch/torch_env.sh).
#    laconic_nemo.nemo_entry reads the recipe: model.source nemo runs the NeMo-Aligner actor (PyTorch
#    Lightning reads the Slurm layout), hf runs the megatron-core actor; both drive the same trainer.
TRAIN_CMD=(bash launch/torch_env.sh python -m laconic_nemo.nemo_entry "${RECIPE}" "${OVERRIDES[@]}")
set +e
if [ "${DRY_RUN}" = "1" ]; then
    run srun --nodes="${NODES}" --ntasks-per-node="${GPUS_PER_NODE}" --gpus-per-node="${GPUS_PER_NODE}" \
        "${SRUN_CONTAINER[@]}" --output="${JOB_LOG_DIR}/train.log" --label "${TRAIN_CMD[@]}"
    STATUS=0
else
    srun --nodes="${NODES}" --ntasks-per-node="${GPUS_PER_NODE}" --gpus-per-node="${GPUS_PER_NODE}" \
        "${SRUN_CONTAINER[@]}" --output="${JOB_LOG_DIR}/train.log" --label "${TRAIN_CMD[@]}" &
    TRAIN_PID=$!
    wait "${TRAIN_PID}"
    STATUS=$?
    # `wait` returns early when a trapped signal arrives: wait again for the step to finish its checkpoint.
    while kill -0 "${TRAIN_PID}" 2> /dev/null; do
        wait "${TRAIN_PID}"
        STATUS=$?
    done
fi
set -e

# Exit code 3 = the trainer stopped on a signal after writing a checkpoint.
if [ "${PREEMPTED}" = "1" ] || [ "${STATUS}" = "3" ]; then
    echo "laconic-nemo: preempted (status ${STATUS}); requeueing job ${JOB_ID} to resume from the latest checkpoint"
    run scontrol requeue "${JOB_ID}"
    exit 0
fi
echo "laconic-nemo: training exited with status ${STATUS}"
exit "${STATUS}"
