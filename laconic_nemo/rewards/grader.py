"""Answer normalisation and the math-verify equivalence check for one extracted answer.

math-verify's own time limits use ``signal.alarm``; they are switched off here (``parsing_timeout=None``,
``timeout_seconds=None``) and time is bounded by the caller instead: :func:`bounded` arms an interval timer
in the main thread of a process (used by the reward's worker processes and by the in-process mode), and the
worker pool kills a worker whose item overruns its hard timeout (a long computation inside C code, such as
a huge integer power, cannot be interrupted by a signal).
"""

from __future__ import annotations

import logging
import math
import numbers
import re
import signal
import threading
import time
from contextlib import contextmanager
from decimal import Decimal
from functools import lru_cache

from .extract import extract_answer

STATUSES = ("correct", "wrong", "no_answer", "error")
# No benchmark reference is longer than ~200 characters; a boxed answer longer than this is graded wrong
# without parsing (parsing a 200k-character nested expression can take minutes).
MAX_ANSWER_CHARS = 1000
# Relative tolerance for the numeric fallback (see `answers_equivalent`): float representation error only.
NUMERIC_RTOL = 1e-9

# math-verify logs a warning per disabled timeout and per failed parse; the bound is handled here.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_INT_FLOAT = re.compile(r"^([+-]?\d+)\.0+$")
_SCI = re.compile(r"^([+-]?\d+(?:\.\d+)?)[eE]([+-]?\d+)$")
# Thousands separators written as thin spaces: 1\,000 or 1\!000 (math-verify itself handles 1,000 and 1{,}000).
_THIN_THOUSANDS = re.compile(r"(?<=\d)\\[,!](?=\d{3}(?!\d))")
# A trailing arc-second / arc-minute mark, written ^{\prime\prime}, ^{\prime} or '' / '.
_TRAILING_PRIME = re.compile(r"(?:\^\{\s*(?:\\prime\s*)+\}|\^\\prime|'+)$")


class ItemTimeout(BaseException):
    """Raised by the interval timer of :func:`bounded`. A BaseException so that the broad
    ``except Exception`` blocks inside sympy / math-verify cannot swallow it."""


def clean_answer(text: str) -> str:
    """Normalise an answer string (reference or extracted prediction) before parsing.

    Rules: strip surrounding whitespace; drop unescaped ``$`` (OlympiadBench writes ``$69$,$84$``);
    ``142.0`` -> ``142``; ``4.5e33`` -> ``4.5\\times 10^{33}`` (math-verify would read ``e`` as Euler's number);
    thin-space thousands separators ``1\\,000`` -> ``1000``; drop ``\\!``; drop a trailing prime mark
    (``0.003^{\\prime\\prime}`` -> ``0.003``).
    """
    s = _UNESCAPED_DOLLAR.sub("", text).strip()
    s = _THIN_THOUSANDS.sub("", s)
    s = s.replace("\\!", "")
    s = _TRAILING_PRIME.sub("", s).strip() or s
    m = _INT_FLOAT.match(s)
    if m:
        s = m.group(1)
    m = _SCI.match(s)
    if m:
        s = f"{m.group(1)}\\times 10^{{{int(m.group(2))}}}"
    return s


def _number_to_str(x: numbers.Real) -> str:
    if isinstance(x, numbers.Integral):
        return str(int(x))
    f = float(x)
    if not math.isfinite(f):
        raise ValueError(f"normalize_reference: a numeric answer must be finite, got {x!r}")
    if f.is_integer():
        return str(int(f))
    return format(Decimal(repr(f)), "f")  # 1e-05 -> 0.00001 (no exponent for the parser to misread)


def normalize_reference(answer) -> list[str]:
    """Reference answer(s) -> non-empty list of cleaned strings, any of which counts as correct.

    Accepts str, int, float (``142.0`` -> ``"142"``) or a list/tuple of those (Minerva and OlympiadBench
    store lists of acceptable answers). Strings are cleaned with :func:`clean_answer` (trailing newlines,
    ``$`` delimiters, ...). Duplicates are removed, order is kept.
    """
    if isinstance(answer, bool) or answer is None:
        raise ValueError(f"normalize_reference: answer must be str, int, float or a list of them, got {answer!r}")
    if isinstance(answer, (list, tuple)):
        out: list[str] = []
        for a in answer:
            for s in normalize_reference(a):
                if s not in out:
                    out.append(s)
        if not out:
            raise ValueError("normalize_reference: answer list is empty")
        return out
    if isinstance(answer, numbers.Real):
        return [_number_to_str(answer)]
    if isinstance(answer, str):
        s = clean_answer(answer)
        if not s:
            raise ValueError(f"normalize_reference: answer string is empty: {answer!r}")
        return [s]
    raise ValueError(
        f"normalize_reference: answer must be str, int, float or a list of them, got {type(answer).__name__}"
    )


@lru_cache(maxsize=8192)
def _parse(answer: str) -> tuple:
    """math-verify parse of a cleaned answer, wrapped in ``\\boxed{}`` so LaTeX is recognised; no timeout."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
    return tuple(parse("\\boxed{" + answer + "}", list(config), parsing_timeout=None))


def _numeric_close(gold, pred) -> bool:
    """Both sides are closed-form numbers and at least one holds a float: compare values with relative
    tolerance NUMERIC_RTOL. Catches float representation error math-verify misses
    (``8.7 \\times 10^{8}`` vs ``870000000``); exact numbers (``2^{1009}`` vs ``2^{1009}+1``) are never
    compared this way."""
    from sympy import Expr, Float

    if not (isinstance(gold, Expr) and isinstance(pred, Expr)):
        return False
    if gold.free_symbols or pred.free_symbols or not (gold.has(Float) or pred.has(Float)):
        return False
    try:
        g = complex(gold.evalf(30))
        p = complex(pred.evalf(30))
    except (TypeError, ValueError, OverflowError, ArithmeticError):
        return False
    if not all(math.isfinite(v) for v in (g.real, g.imag, p.real, p.imag)):
        return False
    return abs(g - p) <= NUMERIC_RTOL * max(abs(g), abs(p))


def answers_equivalent(pred: str, golds) -> bool:
    """True when the cleaned prediction equals any cleaned reference per math-verify (gold first),
    or per the float-tolerance fallback. No time bound: call through :func:`bounded` or a worker."""
    from math_verify import verify

    pred_parsed = _parse(pred)
    if not pred_parsed:
        return False
    for gold in golds:
        gold_parsed = _parse(gold)
        if not gold_parsed:
            continue
        if verify(list(gold_parsed), list(pred_parsed), timeout_seconds=None):
            return True
        if _numeric_close(gold_parsed[0], pred_parsed[0]):
            return True
    return False


def _alarm_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def bounded(seconds: float | None):
    """Raise :class:`ItemTimeout` inside the block after ``seconds`` (interval timer, main thread only).

    Outside the main thread, or with ``seconds`` None, the block runs unbounded. A previously armed
    SIGALRM handler/timer is restored afterwards (its remaining time reduced by the time spent here).
    """
    if seconds is None or not _alarm_usable():
        yield
        return

    def _on_alarm(signum, frame):
        raise ItemTimeout(f"grading exceeded {seconds} s")

    old_handler = signal.signal(signal.SIGALRM, _on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:
            left = max(old_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, old_interval)


def grade_extracted(pred: str, golds, timeout_s: float | None = None, max_answer_chars: int = MAX_ANSWER_CHARS,
                    checker=None) -> str:
    """Grade an already extracted answer against normalised references.

    Returns "correct", "wrong", "timeout" (the signal bound fired) or "error" (an exception in parsing or
    comparison). ``checker(pred, golds) -> bool`` replaces :func:`answers_equivalent` when given.
    """
    pred = clean_answer(pred)
    if not pred or len(pred) > max_answer_chars:
        return "wrong"
    check = answers_equivalent if checker is None else checker
    try:
        with bounded(timeout_s):
            return "correct" if check(pred, tuple(golds)) else "wrong"
    except ItemTimeout:
        return "timeout"
    except RecursionError:
        return "error"
    except Exception:  # noqa: BLE001 - any failure inside the parser/sympy scores 0
        return "error"


def grade_one(response: str, answer, *, timeout_s: float | None = None) -> tuple[float, str]:
    """Grade one response against its reference answer in the calling process.

    Returns ``(score, status)`` with score 1.0 only for status "correct"; status is one of
    "correct", "wrong", "no_answer" (no complete boxed answer), "error" (parse/compare failure, or the
    optional ``timeout_s`` signal bound fired; the bound only works in the main thread).
    """
    pred = extract_answer(response)
    if pred is None:
        return 0.0, "no_answer"
    status = grade_extracted(pred, normalize_reference(answer), timeout_s=timeout_s)
    if status == "timeout":
        status = "error"
    return (1.0 if status == "correct" else 0.0), status
