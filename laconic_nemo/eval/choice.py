"""Multiple-choice benchmarks (GPQA / LSAT / MMLU style, the paper's Table 2): local files, letter grading.

File format (JSONL, one problem per line; nothing of the kind ships here, bring your own copy)::

    {"question": "Which gas ...?", "options": ["Argon", "Neon", "Xenon", "Helium"], "answer": "C"}
    {"question": "...", "options": {"A": "...", "B": "...", "C": "..."}, "answer": "b", "id": "q17"}

* ``options``: 2 to 26 non-empty strings, as a list (lettered A, B, C, ... in order) or an object whose keys
  are exactly the first letters A, B, ... (any order, any case);
* ``answer``: the correct option's letter (any case).

Prompt: the question, a blank line, one ``X. option`` line per option, then :data:`INSTRUCTION`.

Answer extraction (:func:`extract_choice`), first rule that finds something wins, always the LAST occurrence:

1. the last ``\\boxed{...}``: its content with ``\\text{...}`` unwrapped, and parentheses, periods, colons and
   spaces stripped, is one letter of the options (``\\boxed{C}``, ``\\boxed{(c)}``, ``\\boxed{\\text{C}}``), or
   equals one option's text (case and spacing ignored: ``\\boxed{Xenon}``); several letters (``\\boxed{A, C}``,
   ``\\boxed{AC}``) are MULTIPLE; anything else in the box is no letter at all (``\\boxed{42}``: wrong);
2. an answer statement ``answer: X``, ``answer is X``, ``answer is (X)`` (any case; ``Answer: (C)``,
   ``**Answer:** C``, ``the final answer is c.``; a bare lowercase letter must end the statement, so "the answer
   is a bit longer" names nothing); ``answer: A and C`` or ``A, C`` is MULTIPLE;
3. the last standalone option letter in parentheses, ``(C)`` / ``(c)``.

A letter counts only when it names an option (E is nothing for a 4-option problem). MULTIPLE is graded wrong,
and so is an answer that is not one of the options; no answer at all is ``no_answer`` (score 0).
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Any

INSTRUCTION = "Answer with the letter of the correct option, and put only that letter within \\boxed{}."
MULTIPLE = "MULTIPLE"
LETTERS = string.ascii_uppercase


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        i, depth = start + len("\\boxed{"), 1
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


def _norm(s: str) -> str:
    return " ".join(s.lower().split()).strip(" .")


def _letters_in(token: str, n: int) -> list[str] | None:
    """Option letters named by a short answer token ("C", "(c)", "A, C", "AC", "A and C"), or None when the
    token is not made of option letters only."""
    t = re.sub(r"\\text\{([^{}]*)\}", r"\1", token).strip()
    parts = [p for p in re.split(r"[\s,;/()\[\].:&]+|\band\b|\bor\b", t) if p]
    if not parts:
        return None
    if len(parts) == 1 and len(parts[0]) > 1 and parts[0].isalpha() and parts[0].isupper():
        parts = list(parts[0])  # "AC"
    if not all(len(p) == 1 and p.upper() in LETTERS[:n] for p in parts):
        return None
    return sorted({p.upper() for p in parts})


def extract_choice(text: str, options: list[str]) -> str | None:
    """The option letter ``text`` answers (``"A"``..), :data:`MULTIPLE` for several letters, ``""`` for a boxed
    answer that names no option, None when no answer is found. See the module docstring for the rules."""
    n = len(options)
    boxed = _last_boxed(text)
    if boxed is not None:
        got = _letters_in(boxed, n)
        if got:
            return got[0] if len(got) == 1 else MULTIPLE
        plain = _norm(re.sub(r"\\text\{([^{}]*)\}", r"\1", boxed))
        matches = [LETTERS[i] for i, o in enumerate(options) if _norm(o) == plain]
        return matches[0] if len(matches) == 1 else ""
    stated = re.finditer(r"answer\s*(?:is|:)[\s:*]*((?:\(?[A-Za-z]\)?(?:\s*(?:,|and|or|&)\s*)?)+)(?![A-Za-z])",
                         text, re.IGNORECASE)
    for m in reversed(list(stated)):
        raw = m.group(1).strip()
        # a bare lowercase letter must end the statement ("the answer is c." but not "the answer is a bit ...")
        if "(" not in raw and raw.islower() and not re.match(r"\s*($|[.,;:!?*\n])", text[m.end(1):]):
            continue
        got = _letters_in(raw, n)
        if got:
            return got[0] if len(got) == 1 else MULTIPLE
    for m in reversed(list(re.finditer(r"\(([A-Za-z])\)", text))):
        if m.group(1).upper() in LETTERS[:n]:
            return m.group(1).upper()
    return None


class ChoiceGrader:
    """Grader of the evaluation runner for multiple-choice problems: answers are ``{"letter": "C", "options":
    [...]}``; score 1.0 for the right single letter; statuses correct / wrong / no_answer."""

    def score(self, responses: list[str], answers: list[dict]):
        from laconic_nemo.rewards.math_reward import RewardResult

        scores, statuses = [], []
        for text, ans in zip(responses, answers):
            got = extract_choice(text, ans["options"])
            ok = got == ans["letter"]
            scores.append(1.0 if ok else 0.0)
            statuses.append("no_answer" if got is None else "correct" if ok else "wrong")
        return RewardResult(scores, {"accuracy": sum(scores) / max(len(scores), 1)}, statuses)

    def close(self) -> None:
        pass


def chat_prompt(text: str, tokenizer=None) -> str:
    """``text`` as the user turn of the tokenizer's chat template (with the generation prompt), plain otherwise."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


def build_prompt(question: str, options: list[str]) -> str:
    lines = [question.strip(), ""] + [f"{LETTERS[i]}. {o}" for i, o in enumerate(options)] + ["", INSTRUCTION]
    return "\n".join(lines)


def _options(row: dict, where: str) -> list[str]:
    opts = row.get("options")
    if isinstance(opts, dict):
        keys = sorted(str(k).upper() for k in opts)
        if keys != list(LETTERS[: len(keys)]):
            raise ValueError(f"{where}: field 'options' keys {sorted(opts)} must be the letters A, B, ... in full")
        opts = [opts[k] for k in sorted(opts, key=lambda k: str(k).upper())]
    if not isinstance(opts, list) or not 2 <= len(opts) <= 26 or not all(isinstance(o, str) and o.strip() for o in opts):
        raise ValueError(f"{where}: field 'options' is invalid: allowed 2 to 26 non-empty strings (a list, or an object "
                         "keyed A, B, ...)")
    return opts


def load_choice_file(name: str, path: str | Path, limit: int | None = None) -> list:
    """The problems of a multiple-choice JSONL file as :class:`laconic_nemo.eval.benchmarks.Problem` rows
    (problem = the full prompt, answer = ``{"letter", "options"}``). A bad row raises ValueError naming file,
    line and field."""
    from laconic_nemo.eval.benchmarks import Problem

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"multiple-choice file {p} does not exist")
    out = []
    with p.open() as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p} line {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg})") from exc
            if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not row["question"].strip():
                raise ValueError(f"{where}: field 'question' is missing or empty")
            opts = _options(row, where)
            letter = str(row.get("answer", "")).strip().upper()
            if len(letter) != 1 or letter not in LETTERS[: len(opts)]:
                raise ValueError(f"{where}: field 'answer' = {row.get('answer')!r} is invalid: allowed one of the "
                                 f"letters A-{LETTERS[len(opts) - 1]}")
            out.append(Problem(name, len(out), build_prompt(row["question"], opts), {"letter": letter, "options": opts}))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{p}: no problems")
    return out


def parse_choice_files(spec: str) -> dict[str, str]:
    """"gpqa=/data/gpqa.jsonl,lsat=/data/lsat.jsonl" -> {"gpqa": "/data/gpqa.jsonl", ...}."""
    out: dict[str, Any] = {}
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--choice-files: {item!r} is not NAME=PATH")
        out[name.strip()] = path.strip()
    if not out:
        raise ValueError("--choice-files is empty: give NAME=PATH[,NAME=PATH]")
    return out
