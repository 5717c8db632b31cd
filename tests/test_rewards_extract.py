"""Boxed-answer extraction and reference normalisation."""

from __future__ import annotations

import pytest

from laconic_nemo.rewards import clean_answer, extract_answer, has_boxed_answer, normalize_reference
from tests.hang_guard import hang_guard


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{3}}{\\left(2+\\frac{1}{x}\\right)}}", "\\frac{\\sqrt{3}}{\\left(2+\\frac{1}{x}\\right)}"),
        ("first \\boxed{1} then \\boxed{2} finally \\boxed{3}", "3"),
        ("no box here, the answer is 7", None),
        ("", None),
        ("so \\boxed{12", None),  # truncated inside the box
        ("\\boxed{5} and later \\boxed{\\frac{1}{", None),  # the last box decides
        ("\\boxed{7} </think> no answer after thinking", None),
        ("<think>draft \\boxed{7}</think> final: \\boxed{8}", "8"),
        ("<think>a</think> b </think> \\boxed{9}", "9"),
        ("the answer is \\boxed 5", "5"),
        ("the answer is $\\boxed 5$.", "5"),
        ("the answer is \\boxed 5.", "5"),
        ("\\fbox{17}", "17"),
        ("\\boxed{1} \\fbox{2}", "2"),
        ("\\fbox{2} \\boxed{1}", "1"),
        ("\\boxed {  3 }", "3"),
        ("\\boxed{}", None),
        ("\\boxed", None),
        ("\\boxedfoo{1} \\boxed{2} \\boxedbar{3}", "2"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
        ("\\boxed{\\}}", "\\}"),
        ("\\boxed{\\text{(C)}}", "\\text{(C)}"),
        ("$\\boxed{x^{2}+1}$", "x^{2}+1"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected
    assert has_boxed_answer(text) == (expected is not None)


def test_extract_rejects_non_string():
    with pytest.raises(TypeError, match="text must be str"):
        extract_answer(None)


def test_extract_on_pathological_text():
    nested = "{" * 100_000 + "1" + "}" * 100_000
    cases = [
        "\\boxed{" + nested + "}",  # 200k-character nested expression
        "\\boxed{" + "{" * 200_000,  # never closed
        "\\boxed{1}" * 50_000,  # many boxes
        "x" * 1_000_000 + "\\boxed{3}",
        "\\boxe" * 100_000,
    ]
    # linear in the text: ~0.1 s here; the hang guard (minutes) only fails a scan that never ends, whatever the speed
    with hang_guard(300):
        results = [extract_answer(c) for c in cases]
    assert results[0] == nested and results[1] is None and results[2] == "1" and results[3] == "3"
    assert results[4] is None


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("204", ["204"]),
        ("025", ["025"]),
        (142.0, ["142"]),
        (7, ["7"]),
        (0.5, ["0.5"]),
        (1e-05, ["0.00001"]),
        ("142.0", ["142"]),
        (["9.6\n"], ["9.6"]),
        (["0.01\n", "0.02\n"], ["0.01", "0.02"]),
        (["7.5 \\times 10^7", "7.5 \\times 10^7\n"], ["7.5 \\times 10^7"]),  # duplicates removed
        (["$\\frac{1}{2 n+2}$"], ["\\frac{1}{2 n+2}"]),
        (["$69$,$84$"], ["69,84"]),
        ("4.5e33\n", ["4.5\\times 10^{33}"]),
        ("3.3e-12", ["3.3\\times 10^{-12}"]),
        ("1\\,000\\,000", ["1000000"]),
        ("0.003^{\\prime \\prime}\n", ["0.003"]),
        ("\\$5", ["\\$5"]),  # an escaped dollar is kept
    ],
)
def test_normalize_reference(answer, expected):
    assert normalize_reference(answer) == expected


@pytest.mark.parametrize("bad", [None, True, "", "  \n", [], [""], ["", " "], {"a": 1}, float("nan"), float("inf")])
def test_normalize_reference_rejects(bad):
    with pytest.raises(ValueError, match="normalize_reference"):
        normalize_reference(bad)


def test_clean_answer_keeps_exact_numbers():
    # only a purely decimal-zero fraction is dropped; a real fraction or an exponent form stays exact
    assert clean_answer("2.50") == "2.50"
    assert clean_answer("-3.000") == "-3"
    assert clean_answer("2^{1009}") == "2^{1009}"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("11,\\! 111,\\! 111,\\! 100", "11,111,111,100"),
        ("32,\\!  349", "32,349"),
        ("1 000", "1000"),
        ("12 345 678.5", "12345678.5"),
        ("-2 500", "-2500"),
        ("(1 000, 2 000)", "(1000, 2000)"),
        ("1\\ 000~000", "1000000"),
        # not thousands groups: left alone
        ("x^2 100", "x^2 100"),
        ("a_1 000", "a_1 000"),
        ("\\frac12 500", "\\frac12 500"),
        ("0 500", "0 500"),
        ("1 2 3", "1 2 3"),
        ("100 0", "100 0"),
        ("1.5 000", "1.5 000"),
        ("2 dollars", "2"),
        ("\\frac{1}{2} dollar", "\\frac{1}{2}"),
        ("dollars", "dollars"),
        ("185\\", "185"),
        ("185\\\\", "185"),
        ("\\{1,2\\}", "\\{1,2\\}"),
    ],
)
def test_clean_answer_separators_units_backslash(text, expected):
    assert clean_answer(text) == expected


@pytest.mark.parametrize(
    "answer, expected",
    [
        (["", "42"], ["42"]),
        (["42", ""], ["42"]),
        (["", "  \n", "$$", "7"], ["7"]),
        ([" ", 3.0], ["3"]),
        (("", "x=1"), ["x=1"]),
    ],
)
def test_normalize_reference_drops_empty_entries(answer, expected):
    assert normalize_reference(answer) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{185\\}", "185"),
        ("so \\boxed{185\\}.", "185"),
        ("\\boxed{\\frac{1}{2}\\}", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{42 \\}", "42"),
        ("\\boxed{x\\} and more text", "x"),
        # escaped braces that pair up, or a box closed by a real brace, are unchanged
        ("\\boxed{\\{1,2\\}", None),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{\\}}", "\\}"),
        ("\\boxed{12", None),
    ],
)
def test_extract_stray_backslash_before_closing_brace(text, expected):
    assert extract_answer(text) == expected
