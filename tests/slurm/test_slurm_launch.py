"""launch/submit.sh under a real Slurm (22.05, one node on 127.0.0.1, tests/slurm/cluster.py): submit,
preempt, requeue and resume end to end, with the tiny CPU recipe in the container-less mode (CONTAINER=none:
the srun lines without their --container-* flags).

Every job is `sbatch` of a wrapper like launch/deepseek_b1500.sh (RECIPE, then `source launch/submit.sh`) with
the same #SBATCH lines scaled to one node and two tasks (--signal=B:USR1@100, --requeue, --open-mode=append;
no --exclusive, so a second job can run beside the first). Checked:

* `scancel --signal=USR1 --batch` (how a cluster preempts): the batch shell forwards SIGUSR1 through srun, the
  trainer checkpoints and exits 3, the script requeues the job, the requeued job resumes from that checkpoint
  with the same lambda, and the final metrics.jsonl has every step once and equals an uninterrupted run's;
* the same when the time limit triggers --signal=B:USR1@100;
* a second submission into the output dir the first job holds fails (exit 2, "in use") and is not requeued;
* a rank killed after the signal (a crash, not a checkpoint) ends the job without a requeue;
* the train step runs with the job's 2 CPUs per task (`scontrol show step`: TresPerTask=cpu:2): Slurm 22.05's
  srun does not pass the job's --cpus-per-task on by itself, launch/submit.sh asks for it.

Steps of the tiny recipe take about a second, while the signal from a time limit comes at slurmctld's next
periodic check (tens of seconds). So that the signal lands inside a step, as it does on GPUs where a step takes
minutes, the test stops the job's ranks (SIGSTOP) at step 2 and lets them go on (SIGCONT) once the batch shell
has logged the signal. A requeued job waits about two minutes before it restarts (Slurm sets its begin time);
the test moves that begin time to 3 s from now with `scontrol update`.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
RECIPE = "recipes/tiny_cpu.yaml"
NUM_STEPS = 6
FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "warmup.num_steps=20",
    "grpo.num_prompts_per_step=4", "grpo.group_size=4", "grpo.minibatch_size=8", "grpo.micro_batch_size=4",
    "rollout.max_new_tokens=40", "laconic.budget=20", "laconic.eta=0.5", "logging.plot=false",
    f"run.num_steps={NUM_STEPS}", "checkpoint.every_n_steps=0",
]
TIMING_KEYS = ("step_seconds", "time/")
WRAPPER = """#!/bin/bash
#SBATCH --job-name=laconic-tiny_cpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --gpus-per-node=2
#SBATCH --cpus-per-task=2
#SBATCH --time=30
#SBATCH --signal=B:USR1@100
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={output}

RECIPE={recipe}
REPO_DIR="${{REPO_DIR:-${{SLURM_SUBMIT_DIR:-$(pwd)}}}}"
# shellcheck source=launch/submit.sh
source "${{REPO_DIR}}/launch/submit.sh"
"""

pytestmark = pytest.mark.slurm


def _strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)}


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _wait(what: str, cond, timeout: float, info=lambda: "") -> None:
    t0 = deadline = time.time()
    deadline += timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{info()}")
        time.sleep(0.3)
    print(f"{time.strftime('%H:%M:%S')} {what}: {time.time() - t0:.1f} s", flush=True)


class Run:
    """One output folder (RESULTS_DIR/tiny_cpu) and the jobs submitted into it."""

    def __init__(self, slurm, tmp: Path, cache: Path):
        self.slurm, self.tmp = slurm, tmp
        self.results = tmp / "results"
        self.out = self.results / "tiny_cpu"
        self.batch_log = tmp / "batch.out"
        self.script = tmp / "tiny_cpu.sh"
        self.script.write_text(WRAPPER.format(output=self.batch_log, recipe=RECIPE))
        overrides = [*FAST, f"warmup.cache_dir={cache}", f"run.output_dir={self.out}"]
        venv_bin = str(Path(sys.executable).parent)
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")
                       and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                     "LACONIC_LAUNCHER_PID")},
                    "PATH": f"{venv_bin}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                    "CONTAINER": "none", "RESULTS_DIR": str(self.results), "EXTRA_OVERRIDES": " ".join(overrides),
                    "MAX_REQUEUES": "3"}

    def submit(self) -> str:
        return self.slurm.sbatch(self.script, self.env, cwd=ROOT)

    def log(self) -> str:
        return self.batch_log.read_text(errors="replace") if self.batch_log.is_file() else ""

    def train_log(self, job: str, restart: int) -> str:
        f = self.results / "tiny_cpu" / "logs" / f"job_{job}_restart{restart}" / "train.log"
        return f.read_text(errors="replace") if f.is_file() else ""

    def info(self, job: str) -> str:
        return (f"job: {self.slurm.job(job)}\nbatch output:\n{self.log()[-3000:]}\n"
                f"train.log:\n{self.train_log(job, 0)[-3000:]}\n{self.slurm.log_tail()}")

    def ranks(self, job: str) -> list[int]:
        return self.slurm.job_processes(job, "0") + self.slurm.job_processes(job, "1")

    def at_step_then_freeze(self, job: str, step: int = 2) -> list[int]:
        """Wait for `step` in metrics.jsonl, then stop both ranks (SIGSTOP)."""
        _wait(f"step {step} of job {job}", lambda: len(_metrics(self.out)) >= step, 300, lambda: self.info(job))
        ranks = self.ranks(job)
        assert len(ranks) == 2, (ranks, self.info(job))
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        return ranks

    def wait_signal_logged(self, job: str, timeout: float) -> None:
        _wait("the batch shell to catch SIGUSR1", lambda: "caught SIGUSR1" in self.log(), timeout,
              lambda: self.info(job))

    def wait_requeued_then_start(self, job: str, **update) -> None:
        _wait(f"job {job} requeued", lambda: self.slurm.job(job).get("Restarts") == "1"
              and self.slurm.job(job).get("JobState") == "PENDING", 120, lambda: self.info(job))
        # now+3: a start within the second of the requeue is refused ("Job credential revoked")
        fields = [f"{k}={v}" for k, v in {"StartTime": "now+3", **update}.items()]
        self.slurm.cmd("scontrol", "update", f"JobId={job}", *fields)

    def wait_done(self, job: str, timeout: float = 300) -> dict:
        _wait(f"job {job} to end", lambda: self.slurm.job(job).get("JobState") in (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout, lambda: self.info(job))
        return self.slurm.job(job)


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory):
    """The uninterrupted run (`laconic-nemo train --nprocs 2`, same recipe and overrides); it also fills the
    warm-up cache the Slurm jobs load."""
    tmp = tmp_path_factory.mktemp("reference")
    cache = tmp / "warmup_cache"
    run = Run(slurm, tmp, cache)
    cmd = [sys.executable, "-m", "laconic_nemo", "train", "--nprocs", "2", RECIPE, *run.env["EXTRA_OVERRIDES"].split()]
    out = subprocess.run(cmd, cwd=ROOT, env=run.env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _metrics(run.out)
    assert [r["step"] for r in rows] == list(range(1, NUM_STEPS + 1))
    return cache, rows


def _check_preempted_and_resumed(run: Run, job: str, reference_rows: list[dict]) -> None:
    state = run.wait_done(job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0" and state["Restarts"] == "1", \
        run.info(job)
    log = run.log()
    assert "preempted (status 3); requeueing job " + job in log, log
    first = run.train_log(job, 0)
    stopped = re.search(r"stopping on signal 10 after step (\d+); checkpoint written", first)
    assert stopped, first[-3000:]
    k = int(stopped.group(1))
    assert 2 <= k < NUM_STEPS
    resumed = re.search(r"resumed from \S+step_(\d+) at step (\d+) \(lambda ([-\d.e]+)\)", run.train_log(job, 1))
    assert resumed, run.train_log(job, 1)[-3000:]
    assert int(resumed.group(1)) == int(resumed.group(2)) == k
    rows = _metrics(run.out)
    assert [r["step"] for r in rows] == list(range(1, NUM_STEPS + 1)), [r["step"] for r in rows]
    # the same lambda: the controller state restored is the one step k ended with, and step k+1 starts from it
    assert resumed.group(3) == f"{rows[k - 1]['lambda_next']:.6f}"
    assert rows[k]["lambda"] == rows[k - 1]["lambda_next"]
    assert any(r["lambda_next"] != r["lambda"] for r in rows)  # lambda moved: the comparison means something
    for a, b in zip(rows, reference_rows):
        assert _strip(a) == _strip(b), f"step {a['step']} differs from the uninterrupted run"
    assert not (run.out / "run.lock").exists()


def test_scancel_usr1_checkpoints_requeues_and_resumes_and_a_second_submission_is_refused(slurm, reference,
                                                                                          tmp_path):
    cache, ref_rows = reference
    run = Run(slurm, tmp_path, cache)
    job = run.submit()
    ranks = run.at_step_then_freeze(job)
    assert json.loads((run.out / "run.lock").read_text())["pid"] in ranks
    steps = [line for line in slurm.cmd("scontrol", "-o", "show", "step", job).stdout.splitlines() if "Tasks=2 " in line]
    assert len(steps) == 1 and "TresPerTask=cpu:2" in steps[0].split(), steps  # the train step: 2 CPUs per rank

    # a second submission into the same output dir while the first job holds it
    second = run.submit()
    state = run.wait_done(second, timeout=180)
    assert state["JobState"] == "FAILED" and state["ExitCode"] == "2:0" and state["Restarts"] == "0", \
        run.info(second)
    assert "is in use by another run" in run.train_log(second, 0), run.train_log(second, 0)[-3000:]
    assert "training exited with status 2" in run.log()

    slurm.cmd("scancel", "--signal=USR1", "--batch", job)
    run.wait_signal_logged(job, timeout=60)
    for pid in ranks:
        os.kill(pid, signal.SIGCONT)
    run.wait_requeued_then_start(job)
    _check_preempted_and_resumed(run, job, ref_rows)


def test_time_limit_signal_checkpoints_requeues_and_resumes(slurm, reference, tmp_path):
    cache, ref_rows = reference
    run = Run(slurm, tmp_path, cache)
    job = run.submit()
    ranks = run.at_step_then_freeze(job)
    # cut the time limit so that the job is inside its last 100 s: slurmctld sends B:USR1@100 to the batch shell
    elapsed = sum(int(x) * m for x, m in zip(reversed(slurm.job(job)["RunTime"].split(":")), (1, 60, 3600)))
    minutes = math.ceil((elapsed + 60) / 60)
    slurm.cmd("scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}")
    run.wait_signal_logged(job, timeout=150)
    for pid in ranks:
        os.kill(pid, signal.SIGCONT)
    run.wait_requeued_then_start(job, TimeLimit="30")  # the requeued job keeps the cut limit otherwise
    _check_preempted_and_resumed(run, job, ref_rows)


def test_a_crash_after_the_signal_is_not_requeued(slurm, reference, tmp_path):
    cache, _ = reference
    run = Run(slurm, tmp_path, cache)
    job = run.submit()
    ranks = run.at_step_then_freeze(job)
    slurm.cmd("scancel", "--signal=USR1", "--batch", job)
    run.wait_signal_logged(job, timeout=60)
    rank1 = slurm.job_processes(job, "1")
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGKILL)  # a rank dies before it could checkpoint
    for pid in ranks:
        if pid != rank1[0]:
            os.kill(pid, signal.SIGCONT)
    state = run.wait_done(job, timeout=180)
    assert state["JobState"] == "FAILED" and state["Restarts"] == "0", run.info(job)
    assert state["ExitCode"] != "3:0"
    log = run.log()
    assert "not requeueing" in log and "requeueing job" not in log, log
    time.sleep(2)
    assert slurm.job(job)["JobState"] == "FAILED"
