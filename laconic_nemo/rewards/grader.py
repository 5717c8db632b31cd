"""Answer normalisation and the math-verify equivalence check for one extracted answer.

math-verify's own time limits use ``signal.alarm``; they are switched off here (``parsing_timeout=None``,
``timeout_seconds=None``) and time is bounded by the caller instead: :func:`bounded` arms a CPU-time interval
timer (and a wall-clock backstop) in the main thread of a process (used by the reward's worker processes and
by the in-process mode), and a worker process also carries a kernel CPU-time limit that ends it when an item
overruns its budget inside C code (a huge integer power cannot be interrupted by a signal handler). Bounds are
CPU time so that a score does not depend on how busy the machine is.
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
# Default wall-clock backstop of a per-item bound, as a multiple of its CPU-time limit: generous enough that a
# worker descheduled on a saturated node still finishes an item within its CPU budget, short enough that a hung
# worker does not hold a batch for long.
WALL_BACKSTOP_FACTOR = 10.0
# Relative tolerance for the numeric fallback (see `answers_equivalent`): float representation error only.
NUMERIC_RTOL = 1e-9

# math-verify logs a warning per disabled timeout and per failed parse; the bound is handled here.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_INT_FLOAT = re.compile(r"^([+-]?\d+)\.0+$")
_SCI = re.compile(r"^([+-]?\d+(?:\.\d+)?)[eE]([+-]?\d+)$")
# Thousands separators written as thin spaces: 1\,000 or 1\!000 (math-verify itself handles 1,000 and 1{,}000).
_THIN_THOUSANDS = re.compile(r"(?<=\d)\\[,!](?=\d{3}(?!\d))")
# A negative thin space and the whitespace after it, as math-verify's own LaTeX normalisation drops it:
# ``11,\! 111,\! 100`` -> ``11,111,100`` (a number), not ``11, 111, 100`` (a set).
_NEG_THIN_SPACE = re.compile(r"\\!\s*")
# Digit groups separated by a space (plain, ``\ `` or ``~``) as thousands separators: ``1 000``, ``12 345 678.5``.
# The first group has 1-3 digits and does not start with 0; every further group has exactly 3 digits. Not
# after a letter, digit, ``.``, ``^`` or ``_`` (``x^2 100``, ``a_1 000``, ``\frac12 500`` are left alone).
_SPACE_THOUSANDS = re.compile(r"(?<![\w.^_])[1-9]\d{0,2}(?:(?: |\\ |~)\d{3})+(?![\d])")
_SPACE_SEP = re.compile(r" |\\ |~")
# A currency word after a number (math-verify's unit list has ``cents`` but no ``dollars``).
_CURRENCY_WORD = re.compile(r"(?<=[\d}])\s*(?:dollars?|euros?|usd|eur|yuan|yen)\.?$", re.IGNORECASE)
# A trailing arc-second / arc-minute mark, written ^{\prime\prime}, ^{\prime} or '' / '.
_TRAILING_PRIME = re.compile(r"(?:\^\{\s*(?:\\prime\s*)+\}|\^\\prime|'+)$")


# Python / sympy syntax that math-verify's LaTeX parser misreads: a relation call around the whole answer
# (``Eq(lhs, rhs)``) and the power operator ``**``. Such answers are rewritten to LaTeX before parsing.
_SYMPY_RELATIONS = {"Eq": "=", "Ne": "\\neq", "Lt": "<", "Le": "\\le", "Gt": ">", "Ge": "\\ge"}
_SYMPY_RELATION_CALL = re.compile(r"^(Eq|Ne|Lt|Le|Gt|Ge)\s*(?=\()")
_POWER_OPERAND = re.compile(r"\s*[+-]?\s*(?:\d+(?:\.\d+)?|[A-Za-z_]\w*)")
_SYMPY_CONSTANTS = ((re.compile(r"(?<![A-Za-z_\\])pi(?![A-Za-z_])"), "\\pi "),
                    (re.compile(r"(?<![A-Za-z_\\])oo(?![A-Za-z_])"), "\\infty "))
# Answers for which math-verify's plain-expression extraction may stand in when the LaTeX parse fails: digits
# and arithmetic only, so the expression it finds is the whole answer, never a fragment such as the trailing
# ``1`` of ``Eq(x**2/16 + y**2/12, 1)`` or ``x**2 + 1``.
_PLAIN_ARITHMETIC = re.compile(r"^[\d\s.,+\-*/^()%×÷]+$")


class ItemTimeout(BaseException):
    """Raised by the interval timer of :func:`bounded`. A BaseException so that the broad
    ``except Exception`` blocks inside sympy / math-verify cannot swallow it."""


def clean_answer(text: str) -> str:
    """Normalise an answer string (reference or extracted prediction) before parsing.

    Rules: strip surrounding whitespace; drop unescaped ``$`` (OlympiadBench writes ``$69$,$84$``);
    ``142.0`` -> ``142``; ``4.5e33`` -> ``4.5\\times 10^{33}`` (math-verify would read ``e`` as Euler's number);
    thin-space thousands separators ``1\\,000`` -> ``1000``; drop ``\\!`` and the spaces after it
    (``32,\\! 349`` -> ``32,349``); space-separated digit groups ``1 000`` -> ``1000``; drop a trailing
    backslash (``185\\`` -> ``185``), a trailing currency word (``2 dollars`` -> ``2``) and a trailing
    prime mark (``0.003^{\\prime\\prime}`` -> ``0.003``).
    """
    s = _UNESCAPED_DOLLAR.sub("", text).strip()
    s = _THIN_THOUSANDS.sub("", s)
    s = _NEG_THIN_SPACE.sub("", s)
    s = _SPACE_THOUSANDS.sub(lambda m: _SPACE_SEP.sub("", m.group(0)), s)
    s = s.rstrip("\\").rstrip() or s  # a stray trailing backslash (``185\``) or line break ``\\``
    s = _CURRENCY_WORD.sub("", s).strip() or s
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
    ``$`` delimiters, ...). Empty strings in a list are dropped (a list with no non-empty answer is refused).
    Duplicates are removed, order is kept.
    """
    if isinstance(answer, bool) or answer is None:
        raise ValueError(f"normalize_reference: answer must be str, int, float or a list of them, got {answer!r}")
    if isinstance(answer, (list, tuple)):
        out: list[str] = []
        for a in answer:
            if isinstance(a, str) and not clean_answer(a):
                continue  # an empty entry of a list of acceptable answers (``["", "42"]``) is dropped
            for s in normalize_reference(a):
                if s not in out:
                    out.append(s)
        if not out:
            raise ValueError(f"normalize_reference: answer list has no non-empty answer: {answer!r}")
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


def _group_end(s: str, start: int) -> tuple[list[str], int] | None:
    """Top-level comma-separated parts of the bracketed group opening at ``s[start]`` and the index just past
    its closing bracket; None when the group is not closed."""
    depth, parts, last = 0, [], start + 1
    for i in range(start, len(s)):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                parts.append(s[last:i])
                return parts, i + 1
        elif c == "," and depth == 1:
            parts.append(s[last:i])
            last = i + 1
    return None


def _powers_to_latex(s: str) -> str | None:
    """``x**2/16`` -> ``x^{2}/16``, ``(x+1)**(n-1)`` -> ``(x+1)^{(n-1)}``; None when an operand is missing."""
    out, i = [], 0
    while True:
        j = s.find("**", i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:j])
        k = j + 2
        m = _POWER_OPERAND.match(s, k)
        if m is not None:
            k = m.end()
        if k < len(s) and s[k] == "(":  # a parenthesised exponent, or the arguments of a function call
            group = _group_end(s, k)
            if group is None:
                return None
            k = group[1]
        elif m is None:
            return None
        out.append("^{" + s[j + 2 : k].strip() + "}")
        i = k


def sympy_syntax_to_latex(answer: str) -> tuple[str, bool]:
    """Rewrite an answer in Python / sympy syntax to LaTeX: ``Eq(x**2/16 + y**2/12, 1)`` ->
    ``x^{2}/16 + y^{2}/12 = 1`` (also ``Ne Lt Le Gt Ge``), ``**`` -> ``^{...}``, ``pi`` -> ``\\pi``,
    ``oo`` -> ``\\infty``. Returns ``(text, is_relation_call)``; text is unchanged unless the answer holds
    ``**`` or is one relation call, and holds no backslash (then it is LaTeX)."""
    m = _SYMPY_RELATION_CALL.match(answer)
    if "\\" in answer or not (m or "**" in answer):
        return answer, False
    text, relation = answer, False
    if m:
        group = _group_end(answer, m.end())
        if group is not None and group[1] == len(answer) and len(group[0]) == 2:
            lhs, rhs = (part.strip() for part in group[0])
            text, relation = f"{lhs} {_SYMPY_RELATIONS[m.group(1)]} {rhs}", True
    if "**" in text:
        converted = _powers_to_latex(text)
        if converted is None:
            return answer, False
        text = converted
    for pattern, latex in _SYMPY_CONSTANTS:
        text = pattern.sub(lambda _m, latex=latex: latex, text)
    return text.strip(), relation


@lru_cache(maxsize=8192)
def _parse(answer: str) -> tuple:
    """math-verify parse of a cleaned answer (sympy syntax rewritten to LaTeX), wrapped in ``\\boxed{}`` so
    LaTeX is recognised; no timeout.

    The LaTeX parse comes first. Only when it fails and the answer is plain arithmetic (digits and operators)
    does math-verify's plain-expression extraction get a turn: on anything else it would return a fragment
    (the trailing number of ``Eq(<anything>, 1)``). An answer nothing parses stays a string (math-verify then
    compares strings)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    text, _ = sympy_syntax_to_latex(answer)
    boxed = "\\boxed{" + text + "}"
    latex = parse(boxed, [LatexExtractionConfig(boxed_match_priority=0)], parsing_timeout=None)
    if latex and not isinstance(latex[0], str):
        return tuple(latex)
    if _PLAIN_ARITHMETIC.match(text):
        both = parse(boxed, [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
                     parsing_timeout=None)
        return tuple(both)
    return tuple(latex)


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
    from math_verify.grader import is_assignment_relation, is_relation

    pred_parsed = _parse(pred)
    if not pred_parsed:
        return False
    # math-verify grades an equation against a non-equation reference by its right-hand side (``x = 5`` for
    # ``5``). A sympy-syntax relation ``Eq(lhs, rhs)`` gets this only as an assignment (lhs a lone symbol):
    # ``Eq(<anything>, 1)`` is not the number 1.
    strict_relation = sympy_syntax_to_latex(pred)[1] and not is_assignment_relation(pred_parsed[0])
    for gold in golds:
        gold_parsed = _parse(gold)
        if not gold_parsed:
            continue
        if strict_relation and not is_relation(gold_parsed[0]):
            continue
        if verify(list(gold_parsed), list(pred_parsed), timeout_seconds=None):
            return True
        if _numeric_close(gold_parsed[0], pred_parsed[0]):
            return True
    return False


def _alarm_usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def bounded(seconds: float | None, wall_seconds: float | None = None):
    """Raise :class:`ItemTimeout` inside the block after ``seconds`` of CPU time of this process, or after
    ``wall_seconds`` of wall-clock time (a backstop), whichever comes first (main thread only).

    CPU time is user + system time of the whole process (``ITIMER_PROF``): a block that needs 1 CPU-second
    gets it whether the machine is idle or every core is busy with other processes. In a single-threaded
    grading worker that is the item's own cost; in a multi-threaded caller other threads' CPU time counts too.
    Outside the main thread, or with both bounds None, the block runs unbounded. Previously armed SIGPROF /
    SIGALRM handlers and timers are restored afterwards (their remaining time reduced by the time spent here).
    """
    if (seconds is None and wall_seconds is None) or not _alarm_usable():
        yield
        return

    def _on_cpu(signum, frame):
        raise ItemTimeout(f"grading exceeded {seconds} CPU seconds")

    def _on_wall(signum, frame):
        raise ItemTimeout(f"grading exceeded {wall_seconds} s of wall-clock time")

    armed = []  # (signal, timer, old handler, old delay, old interval, start of the clock)
    for value, sig, timer, handler, clock in (
        (seconds, signal.SIGPROF, signal.ITIMER_PROF, _on_cpu, time.process_time),
        (wall_seconds, signal.SIGALRM, signal.ITIMER_REAL, _on_wall, time.monotonic),
    ):
        if value is not None:
            old_handler = signal.signal(sig, handler)
            old_delay, old_interval = signal.setitimer(timer, value)
            armed.append((sig, timer, old_handler, old_delay, old_interval, clock, clock()))
    try:
        yield
    finally:
        for sig, timer, old_handler, old_delay, old_interval, clock, start in armed:
            signal.setitimer(timer, 0)
            signal.signal(sig, old_handler)
            if old_delay > 0:
                signal.setitimer(timer, max(old_delay - (clock() - start), 1e-3), old_interval)


def grade_extracted(pred: str, golds, timeout_s: float | None = None, max_answer_chars: int = MAX_ANSWER_CHARS,
                    checker=None, wall_timeout_s: float | None = None) -> str:
    """Grade an already extracted answer against normalised references.

    ``timeout_s`` bounds the CPU time of the check, ``wall_timeout_s`` its wall-clock time (see :func:`bounded`).
    Returns "correct", "wrong", "timeout" (a bound fired) or "error" (an exception in parsing or
    comparison). ``checker(pred, golds) -> bool`` replaces :func:`answers_equivalent` when given.
    """
    pred = clean_answer(pred)
    if not pred or len(pred) > max_answer_chars:
        return "wrong"
    check = answers_equivalent if checker is None else checker
    try:
        with bounded(timeout_s, wall_timeout_s):
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
    optional ``timeout_s`` bound fired: CPU seconds, with a wall-clock backstop of
    ``WALL_BACKSTOP_FACTOR * timeout_s``; the bound only works in the main thread).
    """
    pred = extract_answer(response)
    if pred is None:
        return 0.0, "no_answer"
    wall = None if timeout_s is None else WALL_BACKSTOP_FACTOR * timeout_s
    status = grade_extracted(pred, normalize_reference(answer), timeout_s=timeout_s, wall_timeout_s=wall)
    if status == "timeout":
        status = "error"
    return (1.0 if status == "correct" else 0.0), status
