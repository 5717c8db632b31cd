"""The band constraint end to end through the real trainer (megatron-core over gloo, 2 CPU processes, DP = 2):
per-prompt stated budgets 12 and 38 with ``laconic.band = 0.9``, each class with lambda (upper) and lambda_lo
(lower). Every multiplier used at a step is the float64 dual step of the previous one on its class's measured
ratio; both ranks hold the same multipliers bit for bit; the checkpoint holds each class's lambda_lo under its key;
a kill -9 of rank 0 right after the step-2 checkpoint and a rerun give the uninterrupted run's metrics row for
row (every multiplier included)."""

from __future__ import annotations

import json

import pytest

from tests.test_constraints_e2e import assert_rerun_is_uninterrupted, uninterrupted_and_killed
from tests.test_trainer_e2e import FAST, TINY, metrics

pytestmark = pytest.mark.slow

RHO, ETA, CEILING, ETA_LO = 0.9, 0.5, 2.0, 0.4
BAND = [
    "--nprocs", "2", TINY, *FAST, "parallel.tensor_model_parallel_size=1", "run.num_steps=4",
    "checkpoint.every_n_steps=2", "logging.rank_trace=true", "logging.tensorboard=false",
    "laconic.per_prompt_budget=true", "data.target_lengths=[12,38]", 'data.target_instruction="m{target}\\n"',
    f"laconic.ceiling={CEILING}", f"laconic.band={RHO}", f"laconic.band_eta={ETA_LO}",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return uninterrupted_and_killed(BAND, tmp_path_factory.mktemp("band"))


def test_both_multipliers_follow_the_float64_dual_step_and_agree_across_ranks(runs):
    full, _, _ = runs
    rows = metrics(full)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    moved = []
    for k in ("12", "38"):
        hi = lo = 0.0
        for r in rows:
            assert r[f"laconic/lambda/class_{k}"] == hi and r[f"laconic/lambda_lo/class_{k}"] == lo
            assert 0.0 <= r[f"budget_class/{k}/in_band"] <= 1.0
            x = r[f"laconic/length_ratio/class_{k}"]
            if x is not None:
                hi = min(max(hi + ETA * (x - 1.0), 0.0), CEILING)
                lo = min(max(lo + ETA_LO * (1.0 - x / RHO), 0.0), CEILING)
            moved += [hi, lo]
        assert "shaper/mean_band_penalty" in rows[-1]
    assert any(v > 0 for v in moved)  # a dual step moved a multiplier (the class 38 sits below its B_lo 34.2)
    state = json.loads((full / "checkpoints" / "step_000004" / "trainer_state.json").read_text())["constraints"]
    for k in ("12", "38"):
        band = state["classes"]["classes"][k]["band"]
        assert band["rho"] == RHO and band["dual"]["bound"] == "lower" and band["dual"]["num_updates"] == 4
    traces = {p.name: [json.loads(x) for x in p.read_text().splitlines()] for p in (full / "rank_trace").glob("*")}
    r0, r1 = traces["rank00000.jsonl"], traces["rank00001.jsonl"]
    assert {r0[0]["dp_rank"], r1[0]["dp_rank"]} == {0, 1}
    for a, b in zip(r0, r1):
        ca = {k: v for k, v in a.items() if k.startswith("laconic/lambda")}
        assert ca == {k: v for k, v in b.items() if k.startswith("laconic/lambda")} and len(ca) == 4


def test_kill_and_rerun_give_the_uninterrupted_band_run(runs):
    assert_rerun_is_uninterrupted(*runs)
