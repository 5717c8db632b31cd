#!/bin/bash
# Body shared by the per-recipe sbatch scripts in launch/ (they set RECIPE and source this file; they are
# written from the table in launch/wrappers.py).
#
#   sbatch launch/deepseek_b1500.sh                    # from the repository root (or set REPO_DIR)
#   DRY_RUN=1 bash launch/deepseek_b1500.sh            # print every command, run nothing
#
# Steps, each an srun inside the container (pyxis/enroot):
#   1. plan     validate the recipe for this layout (no GPU, no model): exit code 2 on a bad layout/key
#   2. prepare  convert the HF checkpoint to .nemo when model.path is missing (NeMo-Aligner recipes)
#   3. train    one task per GPU; resumes from the latest checkpoint in run.output_dir
# Preemption: Slurm sends SIGUSR1 to this shell (--signal=B:USR1@...) or SIGTERM; the trap forwards
# SIGUSR1 to the training step, the trainer checkpoints at the end of the current step and exits with
# code 3, then this script requeues the job, which resumes from that checkpoint. Only exit code 3
# requeues (a crash, even after a signal, ends the job), and at most MAX_REQUEUES times per job. A step
# that runs out of GPU memory ends the job (status 5) with the failing rank's line: the memory model's
# prediction and the keys to change.
#
# Environment (defaults in brackets):
#   RECIPE (required), HF_MODEL [none]: HF checkpoint (container path) converted when the .nemo is missing
#   CONTAINER (required; each wrapper's default is the squash file of the image its recipe runs in, the image
#   `laconic-nemo plan RECIPE` names: laconic_nemo/plan/images.py, docs/images.md), DATA_DIR [/lustre/data],
#   CKPT_DIR [/lustre/checkpoints], RESULTS_DIR [/lustre/results], MOUNTS [derived from those],
#   GPUS_PER_NODE [the allocation's SLURM_GPUS_ON_NODE; outside Slurm the #SBATCH --gpus-per-node line, else 8],
#   MAX_REQUEUES [20], EXTRA_OVERRIDES [none]: extra key=value overrides, DRY_RUN [0],
#   CPUS_PER_TASK [the job's --cpus-per-task, else a node's CPUs / GPUS_PER_NODE]: srun --cpus-per-task of the
#   train step (the prepare step gets a whole node's CPUs)
# CONTAINER=none runs every step without pyxis, in the submitting environment (python with this package
# on its PATH, the repository at REPO_DIR, host paths in the recipe): the srun lines lose only their
# --container-* flags. tests/slurm submits this way on a machine without pyxis.
# Inside the container HOME, XDG_CACHE_HOME and TRITON_CACHE_DIR point at /results/<recipe>/home (the
# host's home is not mounted) and PYTHONPATH is the repository mount alone (no host value leaks in).
# All bash here works on bash >= 4.2 (empty arrays under `set -u` are expanded as ${A[@]+"${A[@]}"}).
set -euo pipefail

: "${RECIPE:?RECIPE must name a recipe, e.g. recipes/deepseek_1.5b_b1500.yaml}"
REPO_DIR="${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
DRY_RUN="${DRY_RUN:-0}"
HF_MODEL="${HF_MODEL:-}"
: "${CONTAINER:?CONTAINER must name the image (a squash file, a registry URI or none): each launch wrapper sets the image of its recipe, which laconic-nemo plan RECIPE names}"
DATA_DIR="${DATA_DIR:-/lustre/data}"
CKPT_DIR="${CKPT_DIR:-/lustre/checkpoints}"
RESULTS_DIR="${RESULTS_DIR:-/lustre/results}"
REPO_IN_CONTAINER=/opt/laconic-nemo
MOUNTS="${MOUNTS:-${DATA_DIR}:/data,${CKPT_DIR}:/checkpoints,${RESULTS_DIR}:/results,${REPO_DIR}:${REPO_IN_CONTAINER}}"
# The node count comes from the allocation; outside Slurm (dry run) from the wrapper's #SBATCH line.
NODES="${SLURM_JOB_NUM_NODES:-$(sed -n 's/^#SBATCH --nodes=\([0-9]*\).*/\1/p' "$0" | sed -n '1p')}"
NODES="${NODES:-1}"
# GPUs per node: the allocation's (SLURM_GPUS_ON_NODE, from --gpus-per-node) wins over the environment, so
# editing the #SBATCH line alone changes plan and train together; outside Slurm the wrapper's #SBATCH line.
if [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then
    if [ -n "${GPUS_PER_NODE:-}" ] && [ "${GPUS_PER_NODE}" != "${SLURM_GPUS_ON_NODE}" ]; then
        echo "laconic-nemo: GPUS_PER_NODE=${GPUS_PER_NODE} ignored: the allocation has ${SLURM_GPUS_ON_NODE} GPUs per node" >&2
    fi
    GPUS_PER_NODE="${SLURM_GPUS_ON_NODE}"
fi
GPUS_PER_NODE="${GPUS_PER_NODE:-$(sed -n 's/^#SBATCH --gpus-per-node=\([0-9]*\).*/\1/p' "$0" | sed -n '1p')}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
if ! [[ "${GPUS_PER_NODE}" =~ ^[1-9][0-9]*$ ]]; then
    echo "laconic-nemo: GPUS_PER_NODE = '${GPUS_PER_NODE}': expected a whole number >= 1" >&2
    exit 2
fi
# CPUs per task of the srun steps. Without --cpus-per-task a step's task is allocated one CPU (srun(1), -c: "The
# default is one CPU per process"), and where the site binds tasks by default (CpuBind, TaskPluginParam; srun(1)
# --cpu-bind) that task runs on one core: every rank's decoding, reward workers and data loading. Since Slurm 22.05
# srun also ignores the job's own --cpus-per-task (sbatch(1): "Beginning with 22.05, srun will not inherit the
# --cpus-per-task value requested by salloc or sbatch"). So the steps ask for their share explicitly: the train
# step the CPUs of a node (the smallest of the job's nodes, SLURM_JOB_CPUS_PER_NODE) over its tasks, or the job's
# own --cpus-per-task when it was given one; the one-task prepare step (the CPU-side conversion) the whole node.
# CPUS_PER_TASK overrides the train step's value. Outside an allocation (dry run) no flag is added.
cpus_per_node() {
    local list n min=""
    list="$(printf '%s' "${SLURM_JOB_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-}}" | sed 's/([^)]*)//g; s/,/ /g')"
    for n in ${list}; do
        if [[ "${n}" =~ ^[0-9]+$ ]] && { [ -z "${min}" ] || [ "${n}" -lt "${min}" ]; }; then
            min="${n}"
        fi
    done
    echo "${min}"
}
CPUS_ON_NODE="$(cpus_per_node)"
if [ -n "${CPUS_ON_NODE}" ] && [ -z "${CPUS_PER_TASK:-}" ]; then
    CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-$(( CPUS_ON_NODE / GPUS_PER_NODE > 0 ? CPUS_ON_NODE / GPUS_PER_NODE : 1 ))}"
fi
TRAIN_CPUS=()
PREPARE_CPUS=()
if [ -n "${CPUS_PER_TASK:-}" ]; then
    if ! [[ "${CPUS_PER_TASK}" =~ ^[1-9][0-9]*$ ]]; then
        echo "laconic-nemo: CPUS_PER_TASK = '${CPUS_PER_TASK}': expected a whole number >= 1" >&2
        exit 2
    fi
    TRAIN_CPUS=(--cpus-per-task="${CPUS_PER_TASK}")
fi
if [ -n "${CPUS_ON_NODE}" ]; then
    PREPARE_CPUS=(--cpus-per-task="${CPUS_ON_NODE}")
fi
JOB_ID="${SLURM_JOB_ID:-dryrun}"
RESTART="${SLURM_RESTART_COUNT:-0}"
MAX_REQUEUES="${MAX_REQUEUES:-20}"
if ! [[ "${MAX_REQUEUES}" =~ ^[0-9]+$ ]]; then
    echo "laconic-nemo: MAX_REQUEUES = '${MAX_REQUEUES}': expected a whole number >= 0" >&2
    exit 2
fi
PREEMPTED_EXIT=3   # the trainer's exit code after a signal-triggered checkpoint (laconic_nemo.nemo_entry)
OOM_MARKER="laconic-nemo: out of memory"   # a step's last line when it ran out of GPU memory (status 5, fatal)
RUN_NAME="$(basename "${RECIPE}" .yaml)"
# run.output_dir of the recipes is /results/${run.name}: the same folder seen from the host.
JOB_LOG_DIR="${RESULTS_DIR}/${RUN_NAME}/logs/job_${JOB_ID}_restart${RESTART}"
read -r -a OVERRIDES <<< "${EXTRA_OVERRIDES:-}"

first_host() {
    local list="${SLURM_JOB_NODELIST:-localhost}" host=""
    if command -v scontrol > /dev/null 2>&1 && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
        # sed reads all input (head would close the pipe early: SIGPIPE fails the pipeline under pipefail)
        host="$(scontrol show hostnames "${list}" 2> /dev/null | sed -n '1p')" || host=""
    fi
    if [ -z "${host}" ]; then
        # dry run away from Slurm (or scontrol without a cluster config): the first host of a list such as
        # "node[01-04,07],gpu3" or "a,b"
        if [[ "${list}" =~ ^([^,\[]+)\[([0-9]+) ]]; then
            host="${BASH_REMATCH[1]}${BASH_REMATCH[2]}"
        else
            host="${list%%,*}"
        fi
    fi
    echo "${host}"
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
export PYTHONUNBUFFERED=1
export HF_MODEL

if [ "${CONTAINER}" = "none" ]; then
    # No pyxis: the tasks start in REPO_DIR (what --container-workdir does) with the submitting environment.
    SRUN_CONTAINER=(--export=ALL)
    cd "${REPO_DIR}"
else
    SRUN_CONTAINER=(--container-image="${CONTAINER}" --container-mounts="${MOUNTS}" --no-container-mount-home
                    --container-workdir="${REPO_IN_CONTAINER}" --export=ALL)
    # pyxis copies the job's environment into the container (values the image sets itself take precedence):
    # the repository mount alone on PYTHONPATH, and a writable home and caches under the run folder, since
    # --no-container-mount-home leaves HOME at a host path that does not exist inside.
    export PYTHONPATH="${REPO_IN_CONTAINER}"
    export HOME="/results/${RUN_NAME}/home"
    export XDG_CACHE_HOME="${HOME}/.cache"
    export TRITON_CACHE_DIR="${XDG_CACHE_HOME}/triton"
    HOST_HOME_DIR="${RESULTS_DIR}/${RUN_NAME}/home"
fi

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
if [ -n "${CPUS_PER_TASK:-}" ]; then
    echo "laconic-nemo: ${CPUS_PER_TASK} CPUs per training task (${CPUS_ON_NODE:-?} per node)"
fi
echo "laconic-nemo: master ${MASTER_ADDR}:${MASTER_PORT}, logs ${JOB_LOG_DIR}"
run mkdir -p "${JOB_LOG_DIR}" ${HOST_HOME_DIR:+"${HOST_HOME_DIR}/.cache/triton"}

# 1. plan: validate recipe and layout inside the container (paths as the job sees them).
run srun --nodes=1 --ntasks-per-node=1 "${SRUN_CONTAINER[@]}" --output="${JOB_LOG_DIR}/plan.log" \
    python -m laconic_nemo plan "${RECIPE}" --nodes="${NODES}" --gpus-per-node="${GPUS_PER_NODE}" \
    ${HF_MODEL:+--hf-model="${HF_MODEL}"} ${OVERRIDES[@]+"${OVERRIDES[@]}"}

# 2. prepare: HF -> .nemo conversion when the recipe's .nemo checkpoint is missing (rank 0 only).
if [ -n "${HF_MODEL}" ]; then
    run srun --nodes=1 --ntasks-per-node=1 --gpus-per-node=1 ${PREPARE_CPUS[@]+"${PREPARE_CPUS[@]}"} \
        "${SRUN_CONTAINER[@]}" --output="${JOB_LOG_DIR}/prepare.log" \
        python -m laconic_nemo.nemo_entry --prepare --hf-model="${HF_MODEL}" "${RECIPE}" ${OVERRIDES[@]+"${OVERRIDES[@]}"}
fi

# 3. train: one task per GPU (RANK / WORLD_SIZE / LOCAL_RANK mapped from Slurm by launch/torch_env.sh).
#    laconic_nemo.nemo_entry reads the recipe: model.source nemo runs the NeMo-Aligner actor (PyTorch
#    Lightning reads the Slurm layout), hf runs the megatron-core actor; both drive the same trainer.
TRAIN_CMD=(bash launch/torch_env.sh python -m laconic_nemo.nemo_entry "${RECIPE}" ${OVERRIDES[@]+"${OVERRIDES[@]}"})
set +e
if [ "${DRY_RUN}" = "1" ]; then
    run srun --nodes="${NODES}" --ntasks-per-node="${GPUS_PER_NODE}" --gpus-per-node="${GPUS_PER_NODE}" \
        ${TRAIN_CPUS[@]+"${TRAIN_CPUS[@]}"} "${SRUN_CONTAINER[@]}" --output="${JOB_LOG_DIR}/train.log" --label \
        "${TRAIN_CMD[@]}"
    STATUS=0
elif [ "${PREEMPTED}" = "1" ]; then
    # The signal came during plan / prepare (bash runs the trap once that foreground step has ended): nothing is
    # trained yet, so the job is requeued at once, with the .nemo written if prepare finished it.
    echo "laconic-nemo: the signal came before training started; nothing to save"
    STATUS="${PREEMPTED_EXIT}"
else
    srun --nodes="${NODES}" --ntasks-per-node="${GPUS_PER_NODE}" --gpus-per-node="${GPUS_PER_NODE}" \
        ${TRAIN_CPUS[@]+"${TRAIN_CPUS[@]}"} "${SRUN_CONTAINER[@]}" --output="${JOB_LOG_DIR}/train.log" --label \
        "${TRAIN_CMD[@]}" &
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

# Exit code 3 = the trainer stopped on a signal after writing a checkpoint: the only status that requeues.
if [ "${STATUS}" = "${PREEMPTED_EXIT}" ]; then
    if [ "${RESTART}" -ge "${MAX_REQUEUES}" ]; then
        echo "laconic-nemo: preempted (status ${STATUS}) but job ${JOB_ID} was already requeued ${RESTART} times" \
             "(MAX_REQUEUES=${MAX_REQUEUES}): not requeueing; resubmit to resume from the latest checkpoint"
        exit "${STATUS}"
    fi
    echo "laconic-nemo: preempted (status ${STATUS}); requeueing job ${JOB_ID} (requeue $((RESTART + 1)) of at most" \
         "${MAX_REQUEUES}) to resume from the latest checkpoint"
    trap '' USR1 TERM   # `scontrol requeue` sends this shell SIGTERM: nothing left to forward, finish cleanly
    run scontrol requeue "${JOB_ID}"
    exit 0
fi
if [ "${PREEMPTED}" = "1" ]; then
    echo "laconic-nemo: training exited with status ${STATUS} after the signal, not ${PREEMPTED_EXIT}" \
         "(no checkpoint confirmed): not requeueing"
fi
# A step that ran out of GPU memory (status 5 on that rank; srun may report another status once the other ranks
# are stopped) is fatal too: a resumed run would run out again. That rank's last line names the memory model's
# prediction and the keys to change; it becomes this job's last line.
OOM_LINE=""
if [ "${STATUS}" != "0" ]; then
    OOM_LINE="$(grep -h "${OOM_MARKER}" "${JOB_LOG_DIR}/train.log" 2> /dev/null | tail -n 1)" || OOM_LINE=""
fi
if [ -n "${OOM_LINE}" ]; then
    echo "laconic-nemo: training exited with status ${STATUS}: a step ran out of GPU memory; not requeueing"
    echo "${OOM_LINE}"
    exit "${STATUS}"
fi
echo "laconic-nemo: training exited with status ${STATUS}"
exit "${STATUS}"
