"""The constraints beyond the mean end to end through the real trainer (megatron-core over gloo, 2 CPU
processes, DP = 2): a reasoning-only length, per-prompt stated budgets with one multiplier per class and the
tail constraint, all on in one run. Every data-parallel rank holds the same multipliers bit for bit each step;
a kill -9 of rank 0 right after the step-2 checkpoint and a rerun give the uninterrupted run's metrics (every
multiplier and measured value included) row for row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_trainer_e2e import FAST, TINY, clean_env, metrics, strip_timing

ROOT = Path(__file__).resolve().parent.parent
ALL_ON = [
    "--nprocs", "2", TINY, *FAST, "parallel.tensor_model_parallel_size=1", "run.num_steps=4",
    "checkpoint.every_n_steps=2", "logging.rank_trace=true", "logging.tensorboard=false",
    "laconic.per_prompt_budget=true", "data.target_lengths=[12,30]", 'data.target_instruction="m{target}\\n"',
    "laconic.tail_budget=25", "laconic.tail_share=0.2", "laconic.tail_eta=0.3", "laconic.reasoning_marker=boxed",
    "laconic.ceiling=2.0",
]


def train(args, out, fault=None, check=True):
    """``laconic-nemo train ARGS run.output_dir=OUT`` (``fault``: LACONIC_FAULT); the process, checked by default."""
    import subprocess

    env = clean_env()
    if fault:
        env["LACONIC_FAULT"] = fault
    cmd = [sys.executable, "-m", "laconic_nemo", "train", *args, f"run.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def uninterrupted_and_killed(args, tmp: Path):
    """Two runs of ``args`` sharing one warm-up cache: ``full`` uninterrupted, ``cut`` killed (kill -9 of rank 0)
    right after its step-2 checkpoint and rerun. Returns (full, cut, the rerun's process)."""
    cache = f"warmup.cache_dir={tmp / 'cache'}"
    full, cut = tmp / "full", tmp / "cut"
    train([*args, cache], full)
    killed = train([*args, cache], cut, fault="after_checkpoint@2:0:kill", check=False)
    assert killed.returncode != 0, killed.stdout[-2000:]
    return full, cut, train([*args, cache], cut)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return uninterrupted_and_killed(ALL_ON, tmp_path_factory.mktemp("constraints"))


@pytest.mark.slow
def test_all_constraints_run_report_and_agree_across_ranks(runs):
    full, _, _ = runs
    rows = metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    keys = ("laconic/lambda/class_12", "laconic/lambda/class_30", "laconic/length_ratio/class_12",
            "laconic/length_ratio/class_30", "laconic/mu_tail", "laconic/tail_share",
            "laconic/reasoning_length_mean")
    for r in rows:
        assert all(k in r for k in keys), sorted(r)
        assert 0.0 <= r["laconic/tail_share"] <= 1.0
        # the reasoning span is shorter than the response only where "boxed" appeared; L is the span
        assert r["laconic/reasoning_length_mean"] == r["mean_response_length"]
    # the multipliers moved (the dual steps ran); each multiplier used is the float64 dual step of the
    # previous one with its own constraint's measured value (a class without a response keeps its multiplier)
    assert any(r[k] != 0.0 for r in rows[1:] for k in (keys[0], keys[1], keys[4]))
    for k in ("12", "30"):
        lam = 0.0
        for r in rows:
            assert r[f"laconic/lambda/class_{k}"] == lam
            rho = r[f"laconic/length_ratio/class_{k}"]
            if rho is not None:
                lam = min(max(lam + 0.5 * (rho - 1.0), 0.0), 2.0)
    mu = 0.0
    for r in rows:
        assert r["laconic/mu_tail"] == mu
        mu = min(max(mu + 0.3 * (r["laconic/tail_share"] / 0.2 - 1.0), 0.0), 1.0)
    traces = {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in (full / "rank_trace").glob("*")}
    r0, r1 = traces["rank00000.jsonl"], traces["rank00001.jsonl"]
    assert {r0[0]["dp_rank"], r1[0]["dp_rank"]} == {0, 1}
    for a, b in zip(r0, r1):
        ca = {k: v for k, v in a.items() if k.startswith("laconic/")}
        assert ca == {k: v for k, v in b.items() if k.startswith("laconic/")} and len(ca) == len(keys) + 1


def assert_rerun_is_uninterrupted(full: Path, cut: Path, rerun) -> None:
    """The rerun resumed, and the killed-and-rerun run's metrics are the uninterrupted run's, row for row."""
    assert "resumed from" in rerun.stdout
    a, b = metrics(full), metrics(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert strip_timing(ra) == strip_timing(rb), f"step {ra['step']} differs after kill and rerun"


@pytest.mark.slow
def test_kill_and_rerun_give_the_uninterrupted_multipliers(runs):
    assert_rerun_is_uninterrupted(*runs)
