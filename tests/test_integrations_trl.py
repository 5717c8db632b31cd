"""The TRL plug-in (laconic_nemo/integrations/trl.py) with the real ``GRPOTrainer`` of TRL 1.16 on CPU.

One launch of ``torchrun --nproc_per_node 2 tests/dist/trl_laconic.py`` (module fixture, about a minute: two
processes over gloo) runs a tiny Qwen2 for 4 optimiser steps with a checkpoint every 2, then a second trainer
resumed from ``checkpoint-2``, then the documented example script for 2 steps. The checks rebuild every step's
GLOBAL batch from the lengths both processes' task rewards saw, apply the dual step in float64 written out here,
and compare with the plug-in's lambda on both processes, with what TRL logged, and across the resume. The
in-process tests cover the refusals. Needs ``pip install -e ".[trl]"`` (the integrations tier of .ci/run);
skipped otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration_frameworks import framework

trl = framework("trl")
from laconic_nemo.integrations.trl import Laconic, LaconicCallback  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "dist" / "trl_laconic.py"
B, ETA, CEILING, STEPS = 5, 0.05, 1.0, 4  # as in tests/dist/trl_laconic.py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl_laconic")
    # torchrun: accelerate launch --cpu runs a single process unless MPI is set up; TRL's Accelerator reads the
    # torchrun environment and uses gloo on CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(WORKER), str(out), "--max-steps", str(STEPS)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # hang guard only
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    def load(name):
        ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]
        calls = [[json.loads(line) for line in (out / f"{name}.lengths.rank{r}.jsonl").read_text().splitlines()]
                 for r in (0, 1)]
        return ranks, calls
    return {"out": out, "full": load("full"), "resumed": load("resumed")}


def global_means(calls):
    """float64 mean of L over both processes' completions, per generation batch (call k of rank 0 with call k of
    rank 1), and each rank's own mean."""
    means, local = [], []
    for c0, c1 in zip(*calls, strict=True):
        assert c0["global_step"] == c1["global_step"]
        both = c0["lengths"] + c1["lengths"]
        means.append(sum(both) / len(both))
        local.append((sum(c0["lengths"]) / len(c0["lengths"]), sum(c1["lengths"]) / len(c1["lengths"])))
    return means, local


def dual_steps(lam, means):
    """lambda_{k+1} = clip(lambda_k + eta (mean_k / B - 1), 0, Lambda), float64; (used, next) per step."""
    used, nxt = [], []
    for m in means:
        used.append(lam)
        lam = min(max(lam + ETA * (m / B - 1.0), 0.0), CEILING)
        nxt.append(lam)
    return used, nxt


def f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


@pytest.mark.slow
def test_lambda_follows_the_dual_step_on_the_global_mean_length(runs):
    (rank0, rank1), calls = runs["full"]
    means, local = global_means(calls)
    assert [c["global_step"] for c in calls[0]] == list(range(STEPS))  # one generation per optimiser step
    used, nxt = dual_steps(0.0, means)
    for rank in (rank0, rank1):  # every process, bit for bit
        assert [h["step"] for h in rank["history"]] == list(range(1, STEPS + 1))
        assert [h["mean_length"] for h in rank["history"]] == means
        assert [h["lambda"] for h in rank["history"]] == used
        assert [h["next_lambda"] for h in rank["history"]] == nxt
        assert rank["state"]["multipliers"]["length"]["lam"] == nxt[-1]
    # what TRL logged, step by step: its own completions/mean_length (float32 mean of the gathered lengths) and the
    # plug-in's laconic/* through log_metric (a float32 average over processes of equal values)
    logged = [e for e in rank0["log_history"] if "laconic/lambda" in e]
    assert [e["step"] for e in logged] == list(range(1, STEPS + 1))
    assert [e["laconic/lambda"] for e in logged] == [f32(x) for x in used]
    assert [e["laconic/mean_length"] for e in logged] == [f32(m) for m in means]
    assert [e["completions/mean_length"] for e in logged] == pytest.approx(means, rel=1e-6, abs=0)
    # the check has teeth: lambda moved, and the processes' own means would have given another trajectory
    assert max(nxt) > 0
    assert dual_steps(0.0, [a for a, _ in local])[1] != nxt or dual_steps(0.0, [b for _, b in local])[1] != nxt


@pytest.mark.slow
def test_a_resumed_run_continues_lambda_exactly(runs):
    (full0, _), full_calls = runs["full"]
    (res0, res1), res_calls = runs["resumed"]
    saved = json.loads((runs["out"] / "full" / "checkpoint-2" / "trainer_state.json").read_text())
    state = saved["stateful_callbacks"]["LaconicCallback"]["attributes"]["laconic"]
    assert state["format"] == "laconic-multipliers/1"
    assert state["multipliers"]["length"]["lam"] == full0["history"][1]["next_lambda"]
    assert state["multipliers"]["length"]["num_updates"] == 2
    means, _ = global_means(res_calls)
    used, nxt = dual_steps(full0["history"][1]["next_lambda"], means)
    for rank in (res0, res1):
        assert [h["step"] for h in rank["history"]] == [3, 4]
        assert [h["lambda"] for h in rank["history"]] == used
        assert [h["next_lambda"] for h in rank["history"]] == nxt
    # TRL restores the RNG states too, so the resumed steps generate what the uninterrupted run generated: then
    # lambda must end exactly where it ended there
    assert res_calls[0] == full_calls[0][2:] and res_calls[1] == full_calls[1][2:]
    assert res0["state"] == full0["state"] and res0["history"] == full0["history"][2:]


# --- in process, no launch -------------------------------------------------------------------------------------

def grpo_args(tmp_path, **kw):
    return trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=4,
                          num_generations=4, **kw)


def test_the_reward_is_the_lagrangian_reward_and_logs_through_trl(tmp_path):
    laconic = Laconic(budget=4, eta=0.1, lambda_init=0.5, ceiling=1.0)
    laconic.callback.on_init_end(grpo_args(tmp_path), None, None)
    logged = {}
    reward = laconic.reward(lambda completions, **kw: [1.0, None, 0.0, 1.0])
    out = reward(prompts=["p"] * 4, completions=["a"] * 4, completion_ids=[[1] * 2, [1] * 6, [1] * 8, [1] * 4],
                 log_metric=lambda k, v: logged.__setitem__(k, v))
    assert reward.__name__ == "laconic_<lambda>"
    assert out == [1.0, None, 0.0 - 0.5 * (8 - 4) / 4, 1.0]
    assert logged["laconic/lambda"] == 0.5 and logged["laconic/mean_length"] == 5.0
    assert not laconic.history  # scored outside an optimiser step (as in evaluation): no dual step input


def test_the_band_prices_the_lower_bound_and_logs_its_multiplier_through_trl(tmp_path):
    """band=0.5: B_lo = 2 beside B = 4; lambda_lo from lambda_init 0 after one dual step on a mean of 1 token."""
    laconic = Laconic(budget=4, eta=0.1, lambda_init=0.5, ceiling=1.0, band=0.5)
    laconic.callback.on_init_end(grpo_args(tmp_path), None, None)
    laconic.state.dual_step(1.0)  # x = 0.25: lambda 0.5 + 0.1 (0.25 - 1) = 0.425, lambda_lo 0.1 (1 - 0.5) = 0.05
    lam, lo = laconic.state.lam, laconic.state.band.value
    assert lam == pytest.approx(0.425, abs=1e-15) and lo == pytest.approx(0.05, abs=1e-15)
    logged = {}
    reward = laconic.reward(lambda completions, **kw: [1.0, 1.0, 0.0])
    out = reward(prompts=["p"] * 3, completions=["a"] * 3, completion_ids=[[1], [1] * 3, [1] * 8],
                 log_metric=lambda k, v: logged.__setitem__(k, v))
    # L = 1 under B_lo = 2: c_lo = 0.5; L = 3 inside [2, 4]; L = 8 over B: c = 1
    assert out == pytest.approx([1.0 - lo * 0.5, 1.0, 0.0 - lam * 1.0], abs=1e-15)
    assert logged["laconic/lambda_lo"] == lo and logged["laconic/mean_band_penalty"] == pytest.approx(lo * 0.5 / 3)


@pytest.mark.parametrize("kw, message", [
    ({"steps_per_generation": 2, "gradient_accumulation_steps": 1}, r"steps_per_generation \(2\) must equal"),
    ({"steps_per_generation": 2, "gradient_accumulation_steps": 4, "num_iterations": 3},
     r"steps_per_generation \* num_iterations \(2 \* 3\) must divide"),
    ({"restore_callback_states_from_checkpoint": True}, "restore_callback_states_from_checkpoint=True"),
])
def test_settings_the_dual_step_cannot_follow_are_refused(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        Laconic(budget=4, eta=0.1).callback.on_init_end(grpo_args(tmp_path, **kw), None, None)
    Laconic(budget=4, eta=0.1).callback.on_init_end(grpo_args(tmp_path, gradient_accumulation_steps=4,
                                                              steps_per_generation=2, num_iterations=2), None, None)


def test_a_reward_without_the_callback_or_a_rebuilt_callback_is_refused():
    reward = Laconic(budget=4, eta=0.1).reward(lambda completions, **kw: [1.0])
    with pytest.raises(RuntimeError, match=r"pass callbacks=\[laconic.callback\]"):
        reward(prompts=["p"], completions=["a"], completion_ids=[[1, 2]])
    with pytest.raises(ValueError, match="not connected to a Laconic"):
        LaconicCallback().on_train_begin(None, None, None)


@pytest.mark.slow
def test_the_documented_example_runs_in_two_processes(runs):
    """examples/integrations/trl_grpo_laconic.py --tiny (the docs' runnable example), run by the same launch."""
    r0, r1 = (json.loads((runs["out"] / f"example.rank{r}.json").read_text()) for r in (0, 1))
    assert r0["global_step"] == 2 and len(r0["history"]) == 2 and r0["history"] == r1["history"]
    assert r0["logged_lambda"] == [f32(h["lambda"]) for h in r0["history"]]
