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
    # 9^(9^(9^9)): sympy would run for hours; the main-thread CPU-time interval timer stops it. The hang guard (minutes)
    # only turns a timer that never fires into a failure; it is no bound on speed.
    from laconic_nemo.rewards.grader import grade_extracted, normalize_reference
    from tests.hang_guard import hang_guard

    with hang_guard(300):
        score, status = grade_one("\\boxed{9^{9^{9^{9}}}}", "5", timeout_s=1.0)
        # the CPU-time bound alone (no wall-clock backstop): "timeout" says that it, not a parse error, ended it
        bare = grade_extracted("9^{9^{9^{9}}}", normalize_reference("5"), timeout_s=1.0)
    assert (score, status) == (0.0, "error")
    assert bare == "timeout"


def test_grade_one_rejects_bad_reference():
    with pytest.raises(ValueError, match="normalize_reference"):
        grade_one("\\boxed{1}", None)


# ---------------------------------------------------------------- grading defects, one class per list
# Each list: the reported examples first, then variants. (reference, boxed prediction, expected status).

# 1. ``,\!`` thousands separators followed by a space (the MATH dataset writes ``11,\! 111,\! 111,\! 100``).
NEG_THIN_SPACE_THOUSANDS = [
    ("11111111100", "11,\\! 111,\\! 111,\\! 100", "correct"),
    ("32349", "32,\\! 349", "correct"),
    ("11,\\! 111,\\! 111,\\! 100", "11111111100", "correct"),  # the same form as a reference (MATH500 row 217)
    ("1000", "1,\\!  000", "correct"),  # two spaces
    ("-32349", "-32,\\! 349", "correct"),
    ("32349.5", "32,\\! 349.5", "correct"),
    ("1000", "\\$1,\\! 000", "correct"),
    ("1234567", "1,\\! 234,\\!567", "correct"),  # mixed, with and without the space
    ("11111111101", "11,\\! 111,\\! 111,\\! 100", "wrong"),
    ("10000", "1,\\! 000", "wrong"),
    ("\\{1, 2\\}", "1,\\! 2", "correct"),  # not a thousands group: stays a list
]

# 2. A plain space (or ``\ ``, ``~``) between digit groups as thousands separator.
SPACE_THOUSANDS = [
    ("1000", "1 000", "correct"),
    ("0", "1 000", "wrong"),  # was read as 1*000
    ("502", "2 500", "wrong"),  # was read as 2+500
    ("2500", "2 500", "correct"),
    ("12345678", "12 345 678", "correct"),
    ("-1000000", "-1 000 000", "correct"),
    ("1234.5", "1 234.5", "correct"),
    ("2500", "\\$2 500", "correct"),
    ("1000", "1\\ 000", "correct"),
    ("1000", "1~000", "correct"),
    ("(1000, 2000)", "(1 000, 2 000)", "correct"),
    ("0", "10 000", "wrong"),
    ("1", "1 000", "wrong"),
    ("1000", "100 0", "wrong"),  # not a 3-digit group
    # genuine products and lists are left alone
    ("1000", "2 \\cdot 500", "correct"),
    ("1000", "2 \\times 500", "correct"),
    ("\\{100, 200\\}", "100, 200", "correct"),
    ("2\\sqrt{3}", "2 \\sqrt{3}", "correct"),
    ("100x^2", "x^2 100", "correct"),
    ("a_{1}\\cdot 100", "a_1 100", "correct"),
]

# 3. Python / sympy syntax: the whole answer is parsed, never its trailing number alone.
SYMPY_SYNTAX = [
    ("Eq(x**2/4 + y**2/3, 1)", "Eq(x**2/16 + y**2/12, 1)", "wrong"),
    ("1", "Eq(x**2/16 + y**2/12, 1)", "wrong"),
    ("1", "Eq(x**2 + 7, 1)", "wrong"),
    ("1", "Eq(2*x + z, 1)", "wrong"),
    ("1", "Eq(y, x**2 + 1)", "wrong"),  # an assignment is judged by its right-hand side, x**2 + 1
    ("5", "Eq(x, 5)", "correct"),  # ... as ``x = 5`` is
    ("Eq(x**2/4 + y**2/3, 1)", "Eq(3*x**2 + 4*y**2, 12)", "correct"),
    ("\\frac{x^2}{4}+\\frac{y^2}{3}=1", "Eq(x**2/4 + y**2/3, 1)", "correct"),
    ("Eq(x**2/4 + y**2/3, 1)", "\\frac{x^2}{4}+\\frac{y^2}{3}=1", "correct"),
    ("Eq(x**2/4 + y**2/3, 1)", "\\frac{x^2}{16}+\\frac{y^2}{12}=1", "wrong"),
    ("y=x^2+1", "Eq(y, x**2 + 1)", "correct"),
    ("1", "x**2 + 1", "wrong"),  # was the trailing 1
    ("x^2+1", "x**2 + 1", "correct"),
    ("1024", "2**10", "correct"),
    ("(x+1)^{n-1}", "(x+1)**(n-1)", "correct"),
    ("7", "f(x**3, 7)", "wrong"),
    ("x<3", "Lt(x, 3)", "correct"),
    ("3", "Lt(x, 3)", "wrong"),
    ("\\frac{\\pi}{2}", "pi/2 + 0*x**2", "correct"),
]

# 4. Units, references with empty entries, a stray trailing backslash.
UNITS_EMPTY_BACKSLASH = [
    ("2", "2 dollars", "correct"),
    ("5", "5 cents", "correct"),
    ("12", "12 ft", "correct"),
    ("5", "5\\text{ dollars}", "correct"),
    ("2", "\\$2", "correct"),
    ("1", "1 dollar", "correct"),
    ("2.5", "2.50 Dollars", "correct"),
    ("1000", "1 000 dollars", "correct"),
    ("40", "40 euros", "correct"),
    ("3", "2 dollars", "wrong"),
    (["", "42"], "42", "correct"),
    (["", "42", ""], "41", "wrong"),
    (["42", "  "], "42", "correct"),
    ("185", "185\\", "correct"),
    ("186", "185\\", "wrong"),
    ("185", "185\\\\", "correct"),
    ("185", "185 \\", "correct"),
    ("0.5", "\\frac{1}{2}\\", "correct"),
]


def _mv_alone(gold: str, pred: str) -> bool:
    """math-verify 0.9.0 on its own, with its default extraction (LaTeX + expressions)."""
    from math_verify import parse, verify

    return verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}"))


@pytest.mark.parametrize("gold, pred, status", NEG_THIN_SPACE_THOUSANDS)
def test_neg_thin_space_thousands(gold, pred, status):
    assert grade_one(_box(pred), gold) == (float(status == "correct"), status)


def test_neg_thin_space_agrees_with_math_verify():
    # where math-verify alone is right (the ground truth), the grader agrees with it
    for gold, pred, status in NEG_THIN_SPACE_THOUSANDS:
        assert _mv_alone(gold, pred) == (status == "correct"), (gold, pred)


@pytest.mark.parametrize("gold, pred, status", SPACE_THOUSANDS)
def test_space_thousands(gold, pred, status):
    assert grade_one(_box(pred), gold) == (float(status == "correct"), status)


@pytest.mark.parametrize("gold, pred, status", SYMPY_SYNTAX)
def test_sympy_syntax(gold, pred, status):
    assert grade_one(_box(pred), gold) == (float(status == "correct"), status)


@pytest.mark.parametrize("gold, pred, status", UNITS_EMPTY_BACKSLASH)
def test_units_empty_references_stray_backslash(gold, pred, status):
    assert grade_one(_box(pred), gold) == (float(status == "correct"), status)


def test_units_agree_with_math_verify():
    for gold, pred in (("5", "5 cents"), ("12", "12 ft"), ("5", "5\\text{ dollars}"), ("2", "\\$2")):
        assert _mv_alone(gold, pred)
