"""The worker pool: hard per-item timeout, crash recovery, agreement with single-process grading."""

from __future__ import annotations

import os
import signal
import time

import pytest

from laconic_nemo.rewards import MathReward, grade_one

TIMEOUT_S = 2.0
# Slack for process start-up / IPC on a loaded 2-core machine when checking wall time against the bound.
SLACK_S = 4.0


def stubborn_checker(pred, golds):
    """Ignores the worker's interval timer (like a computation stuck in C code): only a kill stops it."""
    if pred.startswith("stuck"):
        while True:
            try:
                time.sleep(60)
            except BaseException:  # noqa: B036 - deliberately swallow the soft timeout
                pass
    if pred == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    if pred == "raise":
        raise RuntimeError("checker failure")
    return pred == golds[0]


def _box(ans: str) -> str:
    return f"so \\boxed{{{ans}}}"


@pytest.fixture(scope="module")
def stubborn():
    with MathReward(num_workers=2, timeout_s=TIMEOUT_S, checker=stubborn_checker) as r:
        r.start()
        yield r


def test_timeout_kills_worker_and_pool_survives(stubborn):
    pids_before = set(stubborn.worker_pids)
    responses = [_box("1"), _box("stuck"), _box("2"), _box("3"), "no box", _box("4")]
    answers = ["1", "1", "2", "0", "1", "4"]
    start = time.perf_counter()
    res = stubborn.score(responses, answers)
    elapsed = time.perf_counter() - start
    assert res.statuses == ["correct", "timeout", "correct", "wrong", "no_answer", "correct"]
    assert res.scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert res.metrics["timeouts"] == 1 and res.metrics["graded"] == 5 and res.metrics["correct"] == 3
    assert elapsed < TIMEOUT_S + SLACK_S
    assert TIMEOUT_S <= res.metrics["max_item_seconds"] < TIMEOUT_S + SLACK_S  # the killed item
    assert stubborn.replaced_workers >= 1
    assert set(stubborn.worker_pids) != pids_before  # the stuck worker was replaced
    # the pool keeps working afterwards
    res = stubborn.score([_box(str(k)) for k in range(40)], [str(k) for k in range(40)])
    assert res.metrics["correct"] == 40 and res.metrics["timeouts"] == 0


def test_crash_scores_zero_and_pool_survives(stubborn):
    responses = [_box("crash"), _box("1"), _box("raise"), _box("crash"), _box("2")]
    res = stubborn.score(responses, ["1", "1", "1", "1", "2"])
    assert res.statuses == ["error", "correct", "error", "error", "correct"]
    assert res.scores == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert res.metrics["errors"] == 3
    assert len(stubborn.worker_pids) == 2
    res = stubborn.score([_box("5")] * 20, ["5"] * 20)
    assert res.metrics["correct"] == 20


def test_many_stuck_items_each_bounded(stubborn):
    # 4 different stuck items on 2 workers: two rounds of kills, the batch ends within ~2 timeouts.
    responses = [_box(f"stuck{k}") for k in range(4)] + [_box("7")] * 10
    start = time.perf_counter()
    res = stubborn.score(responses, ["7"] * 14)
    elapsed = time.perf_counter() - start
    assert res.statuses == ["timeout"] * 4 + ["correct"] * 10
    assert elapsed < 2 * TIMEOUT_S + SLACK_S
    assert res.metrics["timeouts"] == 4 and res.metrics["unique_graded"] == 5


def test_identical_answers_graded_once(stubborn):
    # G samples giving the same pathological answer cost one timeout, not G.
    responses = [_box("stuck")] * 16 + [_box("8")] * 16
    start = time.perf_counter()
    res = stubborn.score(responses, ["8"] * 32)
    elapsed = time.perf_counter() - start
    assert res.statuses == ["timeout"] * 16 + ["correct"] * 16
    assert res.metrics["timeouts"] == 16 and res.metrics["graded"] == 32 and res.metrics["unique_graded"] == 2
    assert elapsed < TIMEOUT_S + SLACK_S


@pytest.mark.parametrize(
    "answer",
    [
        "9^{9^{9^{9}}}",
        "{" * 100_000 + "1" + "}" * 100_000,  # a 200k-character nested expression
        "\\frac{1}{" * 20_000 + "2" + "}" * 20_000,
    ],
    ids=["power-tower", "nested-braces", "nested-fracs"],
)
def test_adversarial_input_returns_within_timeout(answer):
    # max_answer_chars is raised so the long inputs really reach the parser
    with MathReward(num_workers=1, timeout_s=TIMEOUT_S, max_answer_chars=10**6) as reward:
        reward.start()
        start = time.perf_counter()
        res = reward.score([_box(answer), _box("5")], ["5", "5"])
        elapsed = time.perf_counter() - start
    assert res.statuses[0] in ("timeout", "error", "wrong")
    assert res.scores[0] == 0.0 and res.statuses[1] == "correct"
    assert elapsed < TIMEOUT_S + SLACK_S


def test_adversarial_default_length_guard():
    with MathReward(num_workers=0, timeout_s=TIMEOUT_S) as reward:
        start = time.perf_counter()
        res = reward.score([_box("{" * 100_000 + "1" + "}" * 100_000)], ["1"])
    assert res.statuses == ["wrong"] and time.perf_counter() - start < 2.0


def test_pool_agrees_with_single_process():
    golds = ["\\frac{1}{2}", "3", ["9.6\n"], 142.0, "(1,2)", "\\sqrt{2}", ["$69$,$84$"], "x^2+1"]
    preds = ["0.5", "4", "9.6", "142", "(2,1)", "\\frac{2}{\\sqrt{2}}", "84,69", "x^2-1"]
    responses = [_box(p) for p in preds] + ["no answer"] + [_box("3")]
    answers = golds + ["1", "3"]
    expected = [grade_one(r, a) for r, a in zip(responses, answers)]
    with MathReward(num_workers=2, timeout_s=10.0) as pool, MathReward(num_workers=0, timeout_s=10.0) as local:
        for reward in (pool, local):
            res = reward.score(responses, answers)
            assert [(s, st) for s, st in zip(res.scores, res.statuses)] == expected
    assert [st for _, st in expected] == [
        "correct", "wrong", "correct", "correct", "wrong", "correct", "correct", "wrong", "no_answer", "correct"
    ]


def test_format_weight_and_metrics():
    responses = [_box("1"), _box("2"), "no box", "\\boxed{1"]
    answers = ["1", "1", "1", "1"]
    with MathReward(num_workers=0, format_weight=0.1) as reward:
        res = reward.score(responses, answers)
    assert res.scores == pytest.approx([1.0, 0.1, 0.0, 0.0])
    m = res.metrics
    assert (m["graded"], m["correct"], m["no_answer"], m["timeouts"], m["errors"]) == (2, 1, 2, 0, 0)
    assert m["accuracy"] == pytest.approx(0.25) and m["seconds"] >= 0
    with MathReward(num_workers=0) as reward:
        assert reward.score(responses, answers).scores == [1.0, 0.0, 0.0, 0.0]
        empty = reward.score([], [])
    assert empty.scores == [] and empty.metrics["accuracy"] == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_workers": -1}, "num_workers"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"format_weight": 1.5}, "format_weight"),
        ({"start_method": "fork"}, "start_method"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MathReward(**kwargs)


def test_bad_batch():
    with MathReward(num_workers=0) as reward:
        with pytest.raises(ValueError, match="same length"):
            reward.score(["a"], [])
        with pytest.raises(ValueError, match=r"answers\[1\]"):
            reward.score(["a", "b"], ["1", None])
    with pytest.raises(RuntimeError, match="after close"):
        reward.score([], [])


def test_spawn_start_method():
    with MathReward(num_workers=1, start_method="spawn") as reward:
        res = reward.score([_box("\\dfrac{3}{4}")], ["0.75"])
    assert res.statuses == ["correct"]
