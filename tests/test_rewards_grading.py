"""Equivalences and non-equivalences of the math-verify grading (single process)."""

from __future__ import annotations

import pytest

from laconic_nemo.rewards import STATUSES, grade_one


def _box(ans: str) -> str:
    return f"Reasoning...\n</think>\nThe answer is $\\boxed{{{ans}}}$."


EQUIVALENT = [
    ("0.5", "\\frac{1}{2}"),
    ("\\frac{1}{2}", "0.5"),
    ("\\frac{1}{2}", "\\dfrac{1}{2}"),
    ("\\frac12", "\\tfrac{1}{2}"),
    ("\\frac{14}{3}", "\\dfrac{14}{3}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\pi/2)"),
    ("(3,\\frac{\\pi}{2})", "\\left(3,\\frac{\\pi}{2}\\right)"),
    ("[1,2)", "[1, 2)"),
    ("(-\\infty, 3]", "(-\\infty,3]"),
    ("(-\\infty,-2)\\cup(2,\\infty)", "(-\\infty, -2) \\cup (2, \\infty)"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("50\\%", "50"),
    ("50\\%", "0.5"),
    ("1000", "1,000"),
    ("1000000", "1{,}000{,}000"),
    ("1000", "1\\,000"),
    ("142.0", "142"),
    (142.0, "142"),
    ("025", "25"),
    ("x^2+1", "1+x^2"),
    ("5", "x=5"),
    ("\\{1,2\\}", "\\{2,1\\}"),
    ("1,3,5", "5,3,1"),
    ("8.7 \\times 10^{8}", "870000000"),
    ("8.7 \\times 10^{8}", "8.7e8"),
    ("4.5e33\n", "4.5 \\times 10^{33}"),
    ("0.022\n", "0.0220"),
    ("\\frac{1}{3}", "0.333333"),
    ("41.8^\\circ", "41.8"),
    ("0.003^{\\prime \\prime}", "0.003"),
    ("\\text{(C)}", "C"),
    (["6630.65\n", "6630\n"], "6630"),  # any acceptable answer of a list may match
    (["0.01\n", "0.02\n"], "0.02"),
    (["$\\frac{1}{2 n+2}$"], "\\frac{1}{2n+2}"),
    (["$69$,$84$"], "84, 69"),
]

NOT_EQUIVALENT = [
    ("3", "4"),
    ("\\frac{1}{2}", "\\frac{1}{3}"),
    ("\\frac{1}{3}", "0.333"),  # math-verify rounds to 6 decimals, 0.333 is too coarse
    ("\\sqrt{2}", "1.414"),
    ("\\pi", "3.14159"),
    ("2^{1009}", "2^{1009}+1"),  # huge exact numbers are not compared with a float tolerance
    ("(1,2)", "(2,1)"),
    ("[1,2]", "(1,2)"),
    ("(-\\infty, 3]", "(-\\infty, 3)"),
    ("x^2+1", "x^2-1"),
    ("9.6", "9.7"),
    ("8.7 \\times 10^{8}", "8.8 \\times 10^{8}"),
    ("1000", "100"),
    (["6630.65\n", "6630\n"], "6631"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{2}}{2}"),
    ("\\text{(C)}", "D"),
]


@pytest.mark.parametrize("gold, pred", EQUIVALENT)
def test_equivalent(gold, pred):
    assert grade_one(_box(pred), gold) == (1.0, "correct")


@pytest.mark.parametrize("gold, pred", NOT_EQUIVALENT)
def test_not_equivalent(gold, pred):
    assert grade_one(_box(pred), gold) == (0.0, "wrong")


def test_statuses():
    assert grade_one("I do not know", "3") == (0.0, "no_answer")
    assert grade_one("\\boxed{3", "3") == (0.0, "no_answer")
    assert grade_one("\\boxed{3}</think>", "3") == (0.0, "no_answer")
    assert grade_one("\\boxed 3", 3) == (1.0, "correct")
    assert grade_one("\\fbox{3}", 3.0) == (1.0, "correct")
    assert grade_one("\\boxed{" + "1" * 5000 + "}", "3") == (0.0, "wrong")  # over MAX_ANSWER_CHARS
    for response in ("\\boxed{)(}", "\\boxed{\\frac{}{}}", "\\boxed{\\\\}", "\\boxed{^_^}"):
        score, status = grade_one(response, "3")
        assert score == 0.0 and status in STATUSES


def test_grade_one_signal_bound():
    # 9^(9^(9^9)): sympy would run for hours; the main-thread interval timer stops it.
    import time

    start = time.perf_counter()
    score, status = grade_one("\\boxed{9^{9^{9^{9}}}}", "5", timeout_s=1.0)
    assert (score, status) == (0.0, "error")
    assert time.perf_counter() - start < 5.0


def test_grade_one_rejects_bad_reference():
    with pytest.raises(ValueError, match="normalize_reference"):
        grade_one("\\boxed{1}", None)
