"""The worker pool: per-item CPU-time limit and wall-clock backstop, crash recovery, agreement with
single-process grading, scores independent of machine load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from laconic_nemo.rewards import MathReward, grade_one

TIMEOUT_S = 2.0
# The stubborn pool: 1 CPU-second per item, wall-clock backstop at 2 s.
STUB_TIMEOUT_S = 1.0
STUB_WALL_S = 2.0


def stubborn_checker(pred, golds):
    """Ignores the worker's soft timer: only a kill stops it. ``stuck`` sleeps (a hung or descheduled worker,
    no CPU used: the wall-clock backstop ends it), ``spin`` burns CPU (like a computation stuck in C code:
    the kernel's CPU-time limit ends it)."""
    if pred.startswith("stuck"):
        while True:
            try:
                time.sleep(60)
            except BaseException:  # noqa: B036 - deliberately swallow the soft timeout
                pass
    if pred.startswith("spin"):
        while True:
            try:
                while True:
                    pass
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
    with MathReward(num_workers=2, timeout_s=STUB_TIMEOUT_S, wall_timeout_s=STUB_WALL_S,
                    checker=stubborn_checker) as r:
        r.start()
        yield r


def test_timeout_kills_worker_and_pool_survives(stubborn):
    pids_before = set(stubborn.worker_pids)
    responses = [_box("1"), _box("stuck"), _box("2"), _box("3"), "no box", _box("4")]
    answers = ["1", "1", "2", "0", "1", "4"]
    res = stubborn.score(responses, answers)
    assert res.statuses == ["correct", "timeout", "correct", "wrong", "no_answer", "correct"]
    assert res.scores == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert res.metrics["timeouts"] == 1 and res.metrics["graded"] == 5 and res.metrics["correct"] == 3
    assert res.metrics["wall_timeouts"] == 1  # a sleeping worker uses no CPU: the backstop ended it
    assert res.metrics["max_item_seconds"] >= STUB_WALL_S  # the killed item: never before its backstop
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


def test_cpu_limit_ends_spinning_worker():
    # a computation that swallows the soft timer and keeps burning CPU is ended by the kernel (SIGXCPU) at
    # timeout_s CPU seconds rounded up to a whole second, long before the (here very large) wall backstop
    with MathReward(num_workers=1, timeout_s=STUB_TIMEOUT_S, wall_timeout_s=120.0, checker=stubborn_checker) as r:
        r.start()
        pid = r.worker_pids[0]
        res = r.score([_box("spin"), _box("5")], ["1", "5"])
        assert r.worker_pids[0] != pid and r.replaced_workers == 1
    assert res.statuses == ["timeout", "correct"]
    # the kernel's CPU-time limit ended it (SIGXCPU), not the wall-clock backstop
    assert res.metrics["timeouts"] == 1 and res.metrics["wall_timeouts"] == 0
    assert res.metrics["max_item_cpu_seconds"] == STUB_TIMEOUT_S


def test_many_stuck_items_each_bounded(stubborn):
    # 4 different stuck items on 2 workers: each one is ended by the backstop (one kill and one fresh worker
    # each), and the other items are all graded
    replaced = stubborn.replaced_workers
    responses = [_box(f"stuck{k}") for k in range(4)] + [_box("7")] * 10
    res = stubborn.score(responses, ["7"] * 14)
    assert res.statuses == ["timeout"] * 4 + ["correct"] * 10
    assert res.metrics["timeouts"] == 4 and res.metrics["wall_timeouts"] == 4 and res.metrics["unique_graded"] == 5
    assert stubborn.replaced_workers - replaced == 4


def test_identical_answers_graded_once(stubborn):
    # G samples giving the same pathological answer cost one timeout (one killed worker), not G.
    replaced = stubborn.replaced_workers
    responses = [_box("stuck")] * 16 + [_box("8")] * 16
    res = stubborn.score(responses, ["8"] * 32)
    assert res.statuses == ["timeout"] * 16 + ["correct"] * 16
    assert res.metrics["timeouts"] == 16 and res.metrics["graded"] == 32 and res.metrics["unique_graded"] == 2
    assert res.metrics["wall_timeouts"] == 16
    assert stubborn.replaced_workers - replaced == 1


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
    # (the CPU-time limit, or the wall-clock backstop of 10 x TIMEOUT_S on a descheduled worker, ends it)
    with MathReward(num_workers=1, timeout_s=TIMEOUT_S, max_answer_chars=10**6) as reward:
        reward.start()
        res = reward.score([_box(answer), _box("5")], ["5", "5"])
    assert res.statuses[0] in ("timeout", "error", "wrong")
    assert res.scores[0] == 0.0 and res.statuses[1] == "correct"
    # no item used more CPU than its limit allows: the kernel's limit is TIMEOUT_S rounded up to a whole second
    assert res.metrics["max_item_cpu_seconds"] <= TIMEOUT_S + 1.0


def test_adversarial_default_length_guard():
    with MathReward(num_workers=0, timeout_s=TIMEOUT_S) as reward:
        res = reward.score([_box("{" * 100_000 + "1" + "}" * 100_000)], ["1"])
    # graded wrong by the length guard: the answer never reached the parser or the verifier
    assert res.statuses == ["wrong"] and res.metrics["unique_graded"] == 0


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
        ({"timeout_s": 2.0, "wall_timeout_s": 1.0}, "wall_timeout_s"),
        ({"wall_timeout_s": float("nan")}, "wall_timeout_s"),
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


def _heavy_item() -> tuple[str, str]:
    """A valid answer whose check costs ~0.35 CPU-second in a fresh worker (sympy expands and compares a
    degree-40 polynomial): ``(x+1)^{40}`` against its expansion."""
    import sympy

    x = sympy.Symbol("x")
    return _box("(x+1)^{40}"), sympy.latex(sympy.expand((x + 1) ** 40))


def test_cpu_heavy_answer_scores_the_same_idle_and_saturated():
    """The score of an item that needs real CPU time (~0.35 CPU-s here) does not depend on machine load: graded
    by fresh workers once on an idle machine and once with 3 busy processes per core, it gets the same status
    and score and no timeout. The limit (10 CPU-s) is far above the item's cost on any machine, so nothing here
    depends on how fast the machine is; that the limit counts CPU time and not wall-clock time is checked
    exactly by test_item_limit_counts_cpu_time_not_wall_time."""
    response, gold = _heavy_item()
    timeout_s = 10.0
    # two pools started before the load (fresh workers: no warm sympy caches in the second one)
    with MathReward(num_workers=1, timeout_s=timeout_s) as idle_pool, \
            MathReward(num_workers=1, timeout_s=timeout_s) as loaded_pool:
        idle_pool.start()
        loaded_pool.start()
        idle = idle_pool.score([response], [gold])
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * cores)]
        try:
            loaded = loaded_pool.score([response], [gold])
        finally:
            for hog in hogs:
                hog.kill()
            for hog in hogs:
                hog.wait()
    assert idle.statuses == loaded.statuses == ["correct"]
    assert idle.scores == loaded.scores == [1.0]
    assert idle.metrics["timeouts"] == loaded.metrics["timeouts"] == 0


def sleepy_checker(pred, golds):
    """Takes ``pred`` seconds of wall-clock time and almost no CPU time (a worker that the scheduler keeps off the
    CPU on a loaded machine looks like this to the item's timers), then compares exactly."""
    time.sleep(float(pred))
    return pred == golds[0]


def test_item_limit_counts_cpu_time_not_wall_time():
    """An item that lasts 1.5 limits of wall-clock time but uses almost no CPU is graded, not timed out: the limit
    is on CPU time. ``time.sleep`` guarantees the wall time, so this holds on a fast or a slow machine alike;
    a wall-clock limit would score the item 0 (a timeout)."""
    limit = 1.0
    with MathReward(num_workers=1, timeout_s=limit, wall_timeout_s=600.0, checker=sleepy_checker) as pool:
        res = pool.score([_box("1.5"), _box("0.0")], ["1.5", "1"])
    assert res.statuses == ["correct", "wrong"]
    assert res.metrics["timeouts"] == 0 and res.metrics["wall_timeouts"] == 0
    assert res.metrics["max_item_seconds"] >= 1.5 * limit  # the sleep's guarantee, not a measurement of speed
