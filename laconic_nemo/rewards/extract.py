"""Final-answer extraction: the content of the last ``\\boxed{...}`` of a response.

Everything here is linear in the length of the text (``str.rfind`` from the end plus one brace scan of the
last box), so a pathological response cannot stall extraction.
"""

from __future__ import annotations

import re

THINK_END = "</think>"
_BOX_COMMANDS = ("\\boxed", "\\fbox")
# A brace token for the balanced scan: an escaped character (``\{``, ``\}``, ``\\``) or a bare brace.
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.DOTALL)
# Argument of the brace-less form ``\boxed 5``: one run of characters up to whitespace or ``$``.
_BARE_ARG = re.compile(r"[^\s$]+")


def answer_region(text: str) -> str:
    """The part of a response that may hold the final answer: the text after the last ``</think>``
    when the tag is present, otherwise the whole text."""
    cut = text.rfind(THINK_END)
    return text if cut < 0 else text[cut + len(THINK_END) :]


def _last_box_command(text: str) -> int:
    """Index just past the last ``\\boxed`` / ``\\fbox`` command name (not a prefix of a longer command
    name such as ``\\boxedfoo``), or -1."""
    end = len(text)
    while end > 0:
        best, best_cmd = -1, ""
        for cmd in _BOX_COMMANDS:
            i = text.rfind(cmd, 0, end)
            if i > best:
                best, best_cmd = i, cmd
        if best < 0:
            return -1
        after = best + len(best_cmd)
        if after < len(text) and text[after].isalpha():
            end = best  # e.g. ``\boxedfoo``: keep looking further left
            continue
        return after
    return -1


def extract_answer(text: str) -> str | None:
    """Content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``, or the brace-less ``\\boxed 5``).

    Only the text after ``</think>`` counts when that tag is present. Nested braces are balanced
    (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``), escaped braces ``\\{``/``\\}`` do not count.
    The last box decides: if it is not closed (a response truncated inside ``\\boxed{12``) there is no
    answer, even when an earlier box is complete. A box that is closed only by an escaped brace with no
    ``\\{`` to match (a stray backslash: ``\\boxed{185\\}``) ends there: its content is ``185``.
    Returns None when there is no complete, non-empty box.
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_answer: text must be str, got {type(text).__name__}")
    region = answer_region(text)
    pos = _last_box_command(region)
    if pos < 0:
        return None
    n = len(region)
    while pos < n and region[pos].isspace():
        pos += 1
    if pos >= n:
        return None
    if region[pos] != "{":
        m = _BARE_ARG.match(region, pos)
        if m is None:
            return None
        content = m.group(0).rstrip(".,;:")
        return content or None
    depth = 0
    escaped_depth = 0  # open ``\{`` not yet closed by a ``\}``
    stray_close = -1  # first ``\}`` at the box's own level with no ``\{`` to close
    for tok in _BRACE_TOKEN.finditer(region, pos):
        t = tok.group(0)
        if t == "{":
            depth += 1
        elif t == "}":
            depth -= 1
            if depth == 0:
                content = region[pos + 1 : tok.start()].strip()
                return content or None
        elif t == "\\{":
            escaped_depth += 1
        elif t == "\\}":
            if escaped_depth:
                escaped_depth -= 1
            elif depth == 1 and stray_close < 0:
                stray_close = tok.start()
    if stray_close >= 0:
        # ``\boxed{185\}``: a stray backslash before the closing brace; the brace closes the box.
        content = region[pos + 1 : stray_close].strip()
        return content or None
    return None  # unbalanced: truncated inside the box


def has_boxed_answer(text: str) -> bool:
    """True when :func:`extract_answer` finds a complete, non-empty boxed answer."""
    return extract_answer(text) is not None


def exact_answer_status(text: str, answer) -> str:
    """The synthetic task's rule (its training reward and its benchmark): "correct" when the content of the last
    ``\\boxed{}`` of ``text``, stripped, equals ``str(answer)``; "wrong" when it differs; "no_answer" without one."""
    got = extract_answer(text)
    if got is None:
        return "no_answer"
    return "correct" if got.strip() == str(answer) else "wrong"
