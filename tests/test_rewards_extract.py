"""Boxed-answer extraction and reference normalisation."""

from __future__ import annotations

import time

import pytest

from laconic_nemo.rewards import clean_answer, extract_answer, has_boxed_answer, normalize_reference


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


def test_extract_is_linear_on_pathological_text():
    nested = "{" * 100_000 + "1" + "}" * 100_000
    cases = [
        "\\boxed{" + nested + "}",  # 200k-character nested expression
        "\\boxed{" + "{" * 200_000,  # never closed
        "\\boxed{1}" * 50_000,  # many boxes
        "x" * 1_000_000 + "\\boxed{3}",
        "\\boxe" * 100_000,
    ]
    start = time.perf_counter()
    results = [extract_answer(c) for c in cases]
    elapsed = time.perf_counter() - start
    assert results[0] == nested and results[1] is None and results[2] == "1" and results[3] == "3"
    assert results[4] is None
    assert elapsed < 2.0, f"extraction took {elapsed:.2f} s"


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


@pytest.mark.parametrize("bad", [None, True, "", "  \n", [], [""], {"a": 1}, float("nan"), float("inf")])
def test_normalize_reference_rejects(bad):
    with pytest.raises(ValueError, match="normalize_reference"):
        normalize_reference(bad)


def test_clean_answer_keeps_exact_numbers():
    # only a purely decimal-zero fraction is dropped; a real fraction or an exponent form stays exact
    assert clean_answer("2.50") == "2.50"
    assert clean_answer("-3.000") == "-3"
    assert clean_answer("2^{1009}") == "2^{1009}"
