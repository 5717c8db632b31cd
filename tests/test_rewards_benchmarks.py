"""Every benchmark row self-verifies (``\\boxed{<its own answer>}`` scores 1) and a deliberately wrong answer
scores 0, graded through the worker pool."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from laconic_nemo.rewards import MathReward, normalize_reference

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("LACONIC_NEMO_DATA", REPO_ROOT.parent / "shared" / "data"))
BENCH_DIR = DATA_DIR / "benchmarks"
BENCHMARKS = ("aime2024", "amc", "math500", "minerva", "olympiad_bench")
EXPECTED_ROWS = {"aime2024": 30, "amc": 83, "math500": 500, "minerva": 272, "olympiad_bench": 675}

pytestmark = pytest.mark.skipif(
    not BENCH_DIR.is_dir(), reason=f"benchmark data not found at {BENCH_DIR} (expected <repo>/../shared/data)"
)

# (benchmark, row) -> why the row's own answer does not grade correct. Asserted to be exactly the failing set.
NOT_SELF_VERIFYING: dict[tuple[str, int], str] = {}

# (benchmark, row) -> why the chosen "wrong" answer (the next row's answer) is in fact equivalent.
WRONG_IS_EQUIVALENT: dict[tuple[str, int], str] = {
    ("math500", 22): "gold '5'; the next row's answer 'x=5' assigns the same value (math-verify unwraps x=)",
}


def _rows():
    out = []
    for name in BENCHMARKS:
        rows = json.loads((BENCH_DIR / f"{name}.json").read_text())
        out.append((name, rows))
    return out


def _raw_answers(answer) -> list[str]:
    """Each acceptable answer as the dataset writes it (``$...$``, trailing newline, ``142.0`` ...)."""
    return [str(a) for a in answer] if isinstance(answer, list) else [str(answer)]


def _response(answer_text: str) -> str:
    return f"Let me work through it.\n</think>\nSo the final answer is \\boxed{{{answer_text}}}."


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


@pytest.fixture(scope="module")
def reward():
    with MathReward(num_workers=2, timeout_s=20.0) as r:
        yield r


@pytest.fixture(scope="module")
def data():
    return _rows()


def test_row_counts(data):
    assert {name: len(rows) for name, rows in data} == EXPECTED_ROWS


def test_every_row_self_verifies(reward, data):
    responses, answers, keys = [], [], []
    for name, rows in data:
        for i, row in enumerate(rows):
            for raw in _raw_answers(row["answer"]):  # every acceptable form on its own
                responses.append(_response(raw))
                answers.append(row["answer"])
                keys.append((name, i, raw))
    res = reward.score(responses, answers)
    assert res.metrics["timeouts"] == 0 and res.metrics["errors"] == 0, res.metrics
    assert res.metrics["no_answer"] == 0
    failing = {}
    for (name, i, raw), status in zip(keys, res.statuses):
        if status != "correct":
            failing.setdefault((name, i), []).append((raw, status))
    assert set(failing) == set(NOT_SELF_VERIFYING), f"rows whose own answer does not grade correct: {failing}"
    assert res.metrics["correct"] == len(responses) - sum(len(v) for v in failing.values())


def test_wrong_answers_score_zero(reward, data):
    responses, answers, keys = [], [], []
    for name, rows in data:
        for i, row in enumerate(rows):
            golds = normalize_reference(row["answer"])
            # (a) the next row whose reference differs as a string
            for k in range(1, len(rows)):
                other = rows[(i + k) % len(rows)]["answer"]
                if normalize_reference(other)[0] not in golds:
                    break
            responses.append(_response(_raw_answers(other)[0]))
            answers.append(row["answer"])
            keys.append((name, i, "next-row"))
            # (b) numeric references: the value plus one
            value = _as_number(golds[0])
            if value is not None:
                responses.append(_response(repr(value + 1)))
                answers.append(row["answer"])
                keys.append((name, i, "plus-one"))
    res = reward.score(responses, answers)
    assert res.metrics["timeouts"] == 0 and res.metrics["errors"] == 0, res.metrics
    correct = {(name, i) for (name, i, kind), s in zip(keys, res.statuses) if s == "correct"}
    assert correct == set(WRONG_IS_EQUIVALENT), f"wrong answers graded correct: {sorted(correct)}"
    plus_one = [s for (_, _, kind), s in zip(keys, res.statuses) if kind == "plus-one"]
    assert len(plus_one) > 500 and all(s == "wrong" for s in plus_one)
    assert sum(res.scores) == len(WRONG_IS_EQUIVALENT)
