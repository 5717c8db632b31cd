#!/bin/bash
# Evaluate one policy on the paper's math benchmarks with vLLM (one node): pass@1 and #Tokens, Table 1 layout.
#
#   sbatch launch/eval.sh RUN [NAME]               # from the repository root (or set REPO_DIR)
#   DRY_RUN=1 bash launch/eval.sh RUN [NAME]       # print the command, run nothing
#
# RUN, as the job sees it (container paths): a Hugging Face model folder (the base model, or a run's `hf/`
# written by checkpoint.export_hf), or a megatron-core run directory (model.source hf), exported once into
# OUT_DIR/model by `laconic-nemo eval`. NAME: the row label [basename of RUN]. docs/eval.md: how the base,
# GRPO and LACONIC rows of the paper's Table 1 are filled.
#
# Settings (the paper's evaluation, DESIGN.md "Evaluation"): temperature 0.6, top_p 0.95, max 32768 response
# tokens (DESIGN.md section 1: 32768 at evaluation), N_SAMPLES samples per problem [16: the DeepScaleR authors'
# evaluation command, `eval_model.sh ... --n 16 --max-length 32768` in their rllm README; the benchmark files come
# from the same project], seed 0. Benchmarks AIME2024, MATH500, Minerva, OlympiadBench (averaged) and AMC.
#
# Environment (defaults in brackets):
#   N_SAMPLES [16], TP [the allocation's GPUs per node, else 1]: vLLM tensor-parallel size (sbatch --gpus-per-node=N
#   for a model that needs N GPUs), BENCHMARKS [all five],
#   BASE_SUMMARY [none]: the base model's summary.json, adds the base and change rows,
#   OUT_DIR [/results/eval/NAME], HF_CONFIG [none]: base config.json + tokenizer folder for a run directory,
#   CONTAINER [/lustre/containers/laconic-vllm-0.33.0.sqsh] (containers/Dockerfile.vllm; none: no pyxis),
#   DATA_DIR, CKPT_DIR, RESULTS_DIR, MOUNTS as in launch/submit.sh, EXTRA_ARGS [none]: more eval flags, DRY_RUN [0].
# Resumable: a rerun (or the requeued job) generates only the samples missing from OUT_DIR/samples.jsonl.
#SBATCH --job-name=laconic-eval
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

RUN="${1:?usage: sbatch launch/eval.sh RUN [NAME]  (RUN: HF model folder or megatron-core run directory)}"
NAME="${2:-$(basename "${RUN%/}")}"
REPO_DIR="${REPO_DIR:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
DRY_RUN="${DRY_RUN:-0}"
N_SAMPLES="${N_SAMPLES:-16}"
TP="${TP:-${SLURM_GPUS_ON_NODE:-1}}"
BENCHMARKS="${BENCHMARKS:-aime2024,math500,minerva,olympiad_bench,amc}"
BASE_SUMMARY="${BASE_SUMMARY:-}"
HF_CONFIG="${HF_CONFIG:-}"
OUT_DIR="${OUT_DIR:-/results/eval/${NAME}}"
CONTAINER="${CONTAINER:-/lustre/containers/laconic-vllm-0.33.0.sqsh}"
DATA_DIR="${DATA_DIR:-/lustre/data}"
CKPT_DIR="${CKPT_DIR:-/lustre/checkpoints}"
RESULTS_DIR="${RESULTS_DIR:-/lustre/results}"
REPO_IN_CONTAINER=/opt/laconic-nemo
MOUNTS="${MOUNTS:-${DATA_DIR}:/data,${CKPT_DIR}:/checkpoints,${RESULTS_DIR}:/results,${REPO_DIR}:${REPO_IN_CONTAINER}}"
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
for v in N_SAMPLES TP; do
    if ! [[ "${!v}" =~ ^[1-9][0-9]*$ ]]; then
        echo "laconic-nemo eval.sh: ${v} = '${!v}': expected a whole number >= 1" >&2
        exit 2
    fi
done

if [ "${CONTAINER}" = "none" ]; then
    SRUN_CONTAINER=(--export=ALL)
    cd "${REPO_DIR}"
else
    SRUN_CONTAINER=(--container-image="${CONTAINER}" --container-mounts="${MOUNTS}" --no-container-mount-home
                    --container-workdir="${REPO_IN_CONTAINER}" --export=ALL)
    export PYTHONPATH="${REPO_IN_CONTAINER}"
    export HOME="/results/eval/${NAME}/home"
    export XDG_CACHE_HOME="${HOME}/.cache"
fi
export PYTHONUNBUFFERED=1

CMD=(python -m laconic_nemo eval --model "${RUN}" --name "${NAME}" --backend vllm --benchmarks "${BENCHMARKS}"
     --n-samples "${N_SAMPLES}" --temperature 0.6 --top-p 0.95 --max-tokens 32768 --seed 0
     --tensor-parallel-size "${TP}" --output-dir "${OUT_DIR}"
     ${BASE_SUMMARY:+--base-summary "${BASE_SUMMARY}"} ${HF_CONFIG:+--hf-config "${HF_CONFIG}"}
     ${EXTRA[@]+"${EXTRA[@]}"})
# The job's CPUs (#SBATCH --cpus-per-task: vLLM's engine and tokenizer, the grader's worker processes; inferred)
# reach the step only when srun asks for them again: since Slurm 22.05 srun does not inherit --cpus-per-task
# (sbatch(1), --cpus-per-task NOTE), and a task gets one CPU by default (srun(1), -c).
CPUS=(${SLURM_CPUS_PER_TASK:+--cpus-per-task="${SLURM_CPUS_PER_TASK}"})
SRUN=(srun --nodes=1 --ntasks=1 --gpus-per-node="${TP}" ${CPUS[@]+"${CPUS[@]}"} "${SRUN_CONTAINER[@]}" "${CMD[@]}")

echo "laconic-nemo eval.sh: ${RUN} as '${NAME}' -> ${OUT_DIR} (n ${N_SAMPLES}, TP ${TP}, job ${SLURM_JOB_ID:-dryrun})"
if [ "${DRY_RUN}" = "1" ]; then
    printf '+'
    printf ' %q' "${SRUN[@]}"
    printf '\n'
    exit 0
fi
exec "${SRUN[@]}"
