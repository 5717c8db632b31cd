"""The trainer end to end on real megatron-core over gloo (2 CPU processes under torchrun).

* resume after step k reproduces the uninterrupted run's metrics for steps k+1.. bit for bit; the same runs'
  TensorBoard event files and offline W&B run hold every metric at its step, once, and they print no warning
  the user did not cause;
* with DP = 2 every rank holds the same lambda, bit for bit, each step;
* SIGUSR1 makes the run checkpoint at the end of the step and stop; rerunning finishes the run;
* the tiny LACONIC run's behaviour (slow): mean length from above B to within 15% of B over the last
  tenth of the steps, at least 20% below the first tenth, lambda > 0 at the end, task reward no more than
  5 points below its start, while the same run with the `grpo` shaper ends more than 20% above B.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from laconic_nemo.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def _band_claims() -> dict:
    """benchmarks/tiny_runs.py's CLAIMS: the band the README's main-job table states for every cell."""
    spec = importlib.util.spec_from_file_location("tiny_runs", ROOT / "benchmarks" / "tiny_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CLAIMS


CLAIMS = _band_claims()
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
# A smaller, faster variant of the tiny recipe for the mechanics tests (behaviour does not matter there).
FAST = [
    "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "warmup.num_steps=20",
    "grpo.num_prompts_per_step=4", "grpo.group_size=4", "grpo.minibatch_size=8", "grpo.micro_batch_size=4",
    "rollout.max_new_tokens=40", "laconic.budget=20", "laconic.eta=0.5", "laconic.ceiling=1.0", "logging.plot=false",
]
TIMING_KEYS = ("step_seconds", "time/")


LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def clean_env() -> dict:
    """This environment without launcher variables (the command must start its own ranks)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run_train(args, out: Path, env_extra=None, timeout=900, check=True):
    env = clean_env()
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "laconic_nemo", "train", *args, f"run.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def strip_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Three runs of the fast recipe sharing one warm-up cache: ``full`` (4 steps) and ``cut`` (2 steps, then
    resumed to 4). Dashboards at their defaults (TensorBoard on where installed); the cut run also writes an
    offline W&B run where wandb is installed."""
    tmp = tmp_path_factory.mktemp("resume")
    cache = f"warmup.cache_dir={tmp / 'cache'}"
    full, cut = tmp / "full", tmp / "cut"
    wandb = ["logging.wandb=true", "logging.wandb_mode=offline"] if importlib.util.find_spec("wandb") else []
    procs = [run_train([TINY, *FAST, cache, "run.num_steps=4", "checkpoint.every_n_steps=2"], full)]
    procs.append(run_train([TINY, *FAST, cache, *wandb, "run.num_steps=2", "checkpoint.every_n_steps=2"], cut))
    first = metrics(cut)
    procs.append(run_train([TINY, *FAST, cache, *wandb, "run.num_steps=4", "checkpoint.every_n_steps=2"], cut))
    return SimpleNamespace(full=full, cut=cut, procs=procs, first=first, wandb=bool(wandb))


def test_resume_after_step_k_equals_the_uninterrupted_run(resumed):
    full, cut, proc = resumed.full, resumed.cut, resumed.procs[2]
    assert [r["step"] for r in resumed.first] == [1, 2]
    assert "resumed from" in proc.stdout
    a, b = metrics(full), metrics(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert strip_timing(ra) == strip_timing(rb), f"step {ra['step']} differs after resume"
    # the run actually trained: lambda moved and the policy changed between steps
    assert any(r["lambda_next"] != r["lambda"] for r in a)
    latest = (cut / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_000004" and not list((cut / "checkpoints").glob("*.tmp"))


def test_tensorboard_event_files_hold_every_metric_at_its_step(resumed):
    """Read with TensorBoard's own reader: lambda, the mean length and every other number of metrics.jsonl at each
    step, once (the resumed run continues the same curves), equal to the row (as float32, TensorBoard's scalar)."""
    pytest.importorskip("tensorboard")
    from tests.dashboards import tensorboard_scalars

    for out in (resumed.full, resumed.cut):
        rows = metrics(out)
        scalars = tensorboard_scalars(out / "tensorboard")
        numeric = {k for k, v in rows[0].items() if isinstance(v, (int, float)) and k != "step"}
        assert {"lambda", "mean_response_length", "task_reward", "frac_over_budget", "time/generate"} <= numeric
        assert set(scalars) == numeric
        for tag in numeric:
            assert scalars[tag] == [(r["step"], float(np.float32(r[tag]))) for r in rows], (out.name, tag)
        assert [s for s, _ in scalars["lambda"]] == [1, 2, 3, 4]


def test_wandb_offline_run_holds_every_metric_from_rank_0(resumed):
    """W&B in offline mode: one run file per launch (rank 0 alone logs), both under one run id, steps 1..4 once
    each with the values of metrics.jsonl (exactly: W&B keeps floats as JSON)."""
    if not resumed.wandb:
        pytest.skip("wandb is not installed")
    from tests.dashboards import wandb_history, wandb_offline_runs

    files = wandb_offline_runs(resumed.cut)
    assert len(files) == 2, files
    runs = [wandb_history(f) for f in files]
    assert len({run_id for run_id, _ in runs}) == 1
    history = [h for _, rows in runs for h in rows]
    rows = metrics(resumed.cut)
    assert [h["_step"] for h in history] == [r["step"] for r in rows] == [1, 2, 3, 4]
    for h, r in zip(history, rows):
        assert {k: v for k, v in h.items() if not k.startswith("_")} == \
            {k: v for k, v in r.items() if isinstance(v, (int, float)) and k != "step"}


def test_a_plain_run_prints_progress_with_an_eta_and_no_warning_the_user_did_not_cause(resumed):
    """No FutureWarning (torch's deprecated all_gather_into_tensor, the pynvml shim's import hook) and no request
    for CUDA_DEVICE_MAX_CONNECTIONS; the warm-up and the steps print an ETA."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pynvml = version("pynvml")
    except PackageNotFoundError:
        pynvml = "absent"
    for proc in resumed.procs:
        text = proc.stdout + proc.stderr
        assert "FutureWarning" not in text, (f"pynvml {pynvml} (pyproject: pynvml < 13; rerun scripts/setup.sh)",
                                             text[-3000:])
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in text, text[-3000:]
    first = resumed.procs[0].stdout.splitlines()
    assert any(x.startswith("warmup    20/20 | nll/token") and " | eta 0s" in x for x in first), first
    steps = [x for x in first if x.startswith("step ")]
    assert [x[:11] for x in steps] == ["step    1/4", "step    2/4", "step    3/4", "step    4/4"]
    assert all(" | eta " in x for x in steps) and steps[-1].endswith("| eta 0s")


def test_data_parallel_ranks_hold_the_same_lambda_bit_for_bit(tmp_path):
    out = tmp_path / "dp"
    run_train(["--nprocs", "2", TINY, *FAST, "parallel.tensor_model_parallel_size=1", "run.num_steps=3",
               "logging.rank_trace=true", "checkpoint.every_n_steps=0"], out)
    traces = {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in (out / "rank_trace").glob("*")}
    assert len(traces) == 2
    r0, r1 = traces["rank00000.jsonl"], traces["rank00001.jsonl"]
    assert {r0[0]["dp_rank"], r1[0]["dp_rank"]} == {0, 1}  # really two data-parallel replicas
    for a, b in zip(r0, r1):
        assert (a["lambda"], a["lambda_next"], a["mean_response_length"]) == (
            b["lambda"], b["lambda_next"], b["mean_response_length"])
    assert float.fromhex(r0[-1]["lambda_next"]) != 0.0


def test_sigusr1_checkpoints_and_stops_then_resume_finishes(tmp_path):
    out = tmp_path / "sig"
    args = [sys.executable, "-m", "laconic_nemo", "train", TINY, *FAST, "run.num_steps=200",
            "checkpoint.every_n_steps=0", f"warmup.cache_dir={tmp_path / 'cache'}", f"run.output_dir={out}"]
    env = clean_env()
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if (out / "metrics.jsonl").is_file() and metrics(out):
            break
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the run produced no step in time")
    os.killpg(proc.pid, signal.SIGUSR1)  # as Slurm's --signal does: every process of the job
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == 3, stdout[-3000:]
    done = metrics(out)
    assert 1 <= len(done) < 200
    last = (out / "checkpoints" / "latest").read_text().strip()
    assert last == f"step_{done[-1]['step']:06d}"
    proc2 = run_train([TINY, *FAST, "run.num_steps=" + str(done[-1]["step"] + 2), "checkpoint.every_n_steps=0",
                       f"warmup.cache_dir={tmp_path / 'cache'}"], out)
    assert "resumed from" in proc2.stdout
    assert [r["step"] for r in metrics(out)] == list(range(1, done[-1]["step"] + 3))


@pytest.mark.slow
def test_tiny_run_tracks_the_budget_and_grpo_does_not(tmp_path):
    cache = f"warmup.cache_dir={tmp_path / 'cache'}"
    lac, grpo = tmp_path / "laconic", tmp_path / "grpo"
    run_train([TINY, cache], lac, timeout=1800)
    # GRPO stays far above B from the start (47-63 tokens over the last tenth of 70 steps over the grid's 9 cells,
    # README, "The main job"); 10 steps suffice
    run_train([str(ROOT / "recipes" / "tiny_cpu_grpo.yaml"), cache, "run.num_steps=10"], grpo, timeout=1800)
    m, g = metrics(lac), metrics(grpo)
    B = m[0]["budget"]
    n = max(1, math.ceil(len(m) / 10))
    assert m[0]["mean_response_length"] > B, "the warmed-up policy must start above the budget"
    tail = m[-n:]
    # the band the main job claims on every machine (benchmarks/tiny_runs.py CLAIMS, README "The main job"): the
    # mean length over the last tenth within 5% of B (measured: 32.3-34.5 at B = 34 over the grid's 9 cells; seed 7,
    # this run's, 33.3-33.9 under every setting) and the task reward there at least the band's minimum (seed 7:
    # 0.819-0.859)
    tail_len = sum(r["mean_response_length"] for r in tail) / n
    assert abs(tail_len - B) <= CLAIMS["length_tol"] * B, [r["mean_response_length"] for r in tail]
    first_len = sum(r["mean_response_length"] for r in m[:n]) / n
    assert tail_len <= 0.85 * first_len, (first_len, tail_len)
    # the price acted (lambda rose above 0 while the batch was over B) and stayed within its ceiling
    assert max(r["lambda_next"] for r in m) > 0
    ceiling = load_config(TINY).laconic.ceiling
    assert all(0.0 <= r["lambda_next"] <= ceiling for r in m), ceiling
    start_reward = sum(r["task_reward"] for r in m[:n]) / n
    end_reward = sum(r["task_reward"] for r in tail) / n
    assert end_reward >= start_reward - 0.05, (start_reward, end_reward)
    assert end_reward >= CLAIMS["reward_min"], [r["task_reward"] for r in tail]
    g_tail = sum(r["mean_response_length"] for r in g[-n:]) / n
    assert g_tail > 1.2 * B, g_tail
    assert all(r["lambda"] == 0.0 for r in g)
    assert (lac / "training_curves.png").stat().st_size > 10_000
