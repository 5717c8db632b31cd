"""launch/eval.sh: it parses, and its dry run hands `laconic-nemo eval` the paper's settings through the real
argument parser (shellcheck: tests/test_launch.py::test_shellcheck_clean covers every launch script)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from laconic_nemo.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "launch" / "eval.sh"


def _run(*args, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base.update(DRY_RUN="1", REPO_DIR=str(ROOT), **env)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=base, capture_output=True, text=True,
                          timeout=30)


def _eval_args(out: subprocess.CompletedProcess):
    assert out.returncode == 0, out.stderr
    line = [x for x in out.stdout.splitlines() if x.startswith("+ srun ")]
    assert len(line) == 1
    tokens = shlex.split(line[0][2:])
    cut = tokens.index("laconic_nemo")
    assert tokens[cut - 2: cut] == ["python", "-m"]
    return tokens[:cut - 2], build_parser().parse_args(tokens[cut + 1:])


def test_eval_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_eval_script_passes_the_paper_settings():
    srun, a = _eval_args(_run("/results/deepscaler_1.5b_b2000/hf", "LACONIC",
                              BASE_SUMMARY="/results/eval/base/summary.json", CONTAINER="/img/vllm.sqsh"))
    assert a.command == "eval" and a.backend == "vllm"
    assert (a.model, a.name, a.output_dir) == ("/results/deepscaler_1.5b_b2000/hf", "LACONIC", "/results/eval/LACONIC")
    assert (a.n_samples, a.temperature, a.top_p, a.max_tokens, a.seed) == (16, 0.6, 0.95, 32768, 0)
    assert a.benchmarks == "aime2024,math500,minerva,olympiad_bench,amc"
    assert a.base_summary == "/results/eval/base/summary.json" and a.hf_config is None
    assert a.tensor_parallel_size == 1 and "--gpus-per-node=1" in srun and "--nodes=1" in srun
    assert "--container-image=/img/vllm.sqsh" in srun


def test_eval_script_overrides_and_errors():
    srun, a = _eval_args(_run("/results/qwen3_8b_b1000/", N_SAMPLES="4", SLURM_GPUS_ON_NODE="2",
                              HF_CONFIG="/checkpoints/hf/Qwen3-8B", EXTRA_ARGS="--limit 3"))
    assert a.name == "qwen3_8b_b1000" and a.n_samples == 4 and a.limit == 3  # NAME from RUN without its slash
    assert a.tensor_parallel_size == 2 and "--gpus-per-node=2" in srun
    assert a.hf_config == "/checkpoints/hf/Qwen3-8B" and a.base_summary is None
    assert _run().returncode != 0  # RUN is required
    bad = _run("/results/x", N_SAMPLES="0")
    assert bad.returncode == 2 and "N_SAMPLES" in bad.stderr


def test_eval_step_gets_the_jobs_cpus():
    """The job asks for CPUs (#SBATCH --cpus-per-task) and the srun step asks for them again: Slurm >= 22.05 does not
    pass the job's --cpus-per-task on to srun (sbatch(1): "Beginning with 22.05, srun will not inherit the
    --cpus-per-task value requested by salloc or sbatch"), and a task gets one CPU otherwise (srun(1), -c)."""
    header = [x for x in SCRIPT.read_text().splitlines() if x.startswith("#SBATCH --cpus-per-task=")]
    assert len(header) == 1 and int(header[0].split("=")[1]) > 1
    srun, _ = _eval_args(_run("/results/x", SLURM_CPUS_PER_TASK="8"))
    assert "--cpus-per-task=8" in srun
    srun, _ = _eval_args(_run("/results/x"))  # dry run outside an allocation
    assert not [t for t in srun if t.startswith("--cpus-per-task")]
