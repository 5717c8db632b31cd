"""Prompt datasets: problems with reference answers, rendered through a prompt template.

A dataset is a list of :class:`PromptItem` (the rendered prompt text and the reference answer the
reward needs). Math problem files are JSON (a list of rows), JSONL or Parquet with fields
``problem`` and ``answer`` (answer: str, number or list of acceptable strings, kept as is: the
reward normalises it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

# The authors' format prompt: EasyR1 v0.3.2.dev0 examples/format_prompt/math.jinja,
# `{{ content | trim }} You FIRST think ... \boxed{}.`, which EasyR1's RLHFDataset renders into the single user
# turn of the model's own chat template (tokenizer.apply_chat_template(..., add_generation_prompt=True)).
EASYR1_MATH_SUFFIX = (" You FIRST think about the reasoning process as an internal monologue and then provide the "
                      "final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
                      "answer MUST BE put in \\boxed{{}}.")
_QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{{}}."

# Prompt templates. `{problem}` is replaced by the problem text. Each is the chat template of its model
# family written out for one user turn (CHAT_MESSAGES below gives that turn; `laconic-nemo plan` compares the
# two when the tokenizer is at hand).
TEMPLATES = {
    # DeepSeek-R1-Distill / DeepScaleR: user turn, answer expected in \boxed{}.
    "deepseek_r1": "<｜begin▁of▁sentence｜><｜User｜>{problem} Let's think step by step and output the final answer "
    "within \\boxed{{}}.<｜Assistant｜><think>\n",
    # Qwen chat format (Qwen2.5-Math-Instruct, Qwen3).
    "qwen_chat": "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    "<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n",
    # The authors' prompt (math.jinja) in the DeepSeek-R1-Distill / DeepScaleR chat template.
    "deepseek_r1_easyr1_math": "<｜begin▁of▁sentence｜><｜User｜>{problem}" + EASYR1_MATH_SUFFIX
    + "<｜Assistant｜><think>\n",
    # The authors' prompt in the Qwen3 chat template (no system turn; thinking mode is the default).
    "qwen3_easyr1_math": "<|im_start|>user\n{problem}" + EASYR1_MATH_SUFFIX + "<|im_end|>\n<|im_start|>assistant\n",
    # The authors' prompt in the Qwen2.5-Math-Instruct chat template (its default system turn).
    "qwen_math_easyr1_math": "<|im_start|>system\n" + _QWEN_MATH_SYSTEM + "<|im_end|>\n<|im_start|>user\n{problem}"
    + EASYR1_MATH_SUFFIX + "<|im_end|>\n<|im_start|>assistant\n",
    # The bare problem (base models, tests).
    "plain": "{problem}",
}

# Templates whose problem is trimmed first (jinja's `content | trim` in math.jinja).
_TRIMMED = {"deepseek_r1_easyr1_math", "qwen3_easyr1_math", "qwen_math_easyr1_math"}


def chat_messages(template: str, problem: str) -> list[dict] | None:
    """The chat turns a template writes out, for ``tokenizer.apply_chat_template(messages,
    add_generation_prompt=True)``; None for ``plain``."""
    if template not in TEMPLATES:
        raise ValueError(f"data.prompt_template = {template!r}: allowed {', '.join(sorted(TEMPLATES))}")
    unescape = lambda t: t.replace("{{}}", "{}")  # noqa: E731
    if template == "plain":
        return None
    if template == "deepseek_r1":
        return [{"role": "user", "content": problem + " Let's think step by step and output the final answer within "
                 "\\boxed{}."}]
    if template == "qwen_chat":
        return [{"role": "system", "content": unescape(_QWEN_MATH_SYSTEM)}, {"role": "user", "content": problem}]
    user = [{"role": "user", "content": problem.strip() + unescape(EASYR1_MATH_SUFFIX)}]
    if template == "qwen_math_easyr1_math":
        return [{"role": "system", "content": unescape(_QWEN_MATH_SYSTEM)}, *user]
    return user


@dataclass(frozen=True)
class PromptItem:
    prompt: str
    answer: Any
    source: str = ""  # file and line the row came from (error messages)


def render(template: str, problem: str) -> str:
    if template not in TEMPLATES:
        raise ValueError(f"data.prompt_template = {template!r}: allowed {', '.join(sorted(TEMPLATES))}")
    if template in _TRIMMED:
        problem = problem.strip()
    return TEMPLATES[template].replace("{{}}", "{}").replace("{problem}", problem)


# What a rendered prompt of each template ends with after the user's text: the end of the user turn and the
# opening of the assistant's (empty for `plain`, whose prompt is the user's text alone).
_USER_TURN_END = {
    "deepseek_r1": "<｜Assistant｜><think>\n",
    "deepseek_r1_easyr1_math": "<｜Assistant｜><think>\n",
    "qwen_chat": "<|im_end|>\n<|im_start|>assistant\n",
    "qwen3_easyr1_math": "<|im_end|>\n<|im_start|>assistant\n",
    "qwen_math_easyr1_math": "<|im_end|>\n<|im_start|>assistant\n",
    "plain": "",
}


def state_in_user_turn(template: str, prompt: str, text: str) -> str:
    """``prompt`` (rendered with ``template``) with ``text`` (e.g. the L1 "Think for 512 tokens.") added at the end
    of the USER turn, before the assistant turn opens: the instruction is the user's words, as in L1 (arXiv
    2503.04697), not the first words of the model's own reasoning. ``plain``: appended."""
    end = _USER_TURN_END[template]
    if not prompt.endswith(end):
        raise ValueError(f"the prompt does not end with the {template!r} template's assistant turn {end!r}")
    return prompt[: len(prompt) - len(end)] + text + end


def _utf8_text(path: Path) -> str:
    """The text of ``path``; bytes that are not UTF-8 raise ValueError naming the line and column."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        head = raw[: exc.start]
        line, column = head.count(b"\n") + 1, exc.start - (head.rfind(b"\n") + 1) + 1
        raise ValueError(f"{path} line {line}: byte 0x{raw[exc.start]:02x} at column {column} is not UTF-8 text "
                         "(save the file as UTF-8)") from None


def read_rows(path: str | Path) -> list[tuple[str, Any]]:
    """(location, row) pairs of a .json (list of objects), .jsonl or .parquet file; the location names the
    1-based line (.jsonl, blank lines counted) or row (.json, .parquet). Parse errors and bytes that are not
    UTF-8 raise ValueError naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(_utf8_text(path).split("\n"), start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"line {n}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {n}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        return rows
    if path.suffix == ".json":
        try:
            rows = json.loads(_utf8_text(path))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of rows")
        return [(f"row {i}", r) for i, r in enumerate(rows, start=1)]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # optional dependency, present in the NeMo container

        return [(f"row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist(), start=1)]
    raise ValueError(f"{path}: unsupported data file type {path.suffix!r} (use .json, .jsonl or .parquet)")


def _scalar_answer(a: Any) -> bool:
    """A non-empty string or a finite number (json reads NaN and Infinity as floats: no answer matches them)."""
    return (isinstance(a, str) and bool(a.strip())) or (
        isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a))


def check_row(row: Any, where: str) -> None:
    """A row needs ``problem``: a non-empty string, and ``answer``: a non-empty string, a number, or a
    non-empty list of those. Raises ValueError naming ``where`` (file and line) and the field."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object with fields 'problem' and 'answer', got {row!r:.60}")
    for field in ("problem", "answer"):
        if field not in row:
            raise ValueError(f"{where}: field {field!r} is missing (the row has {sorted(row)})")
    p, a = row["problem"], row["answer"]
    if not isinstance(p, str) or not p.strip():
        raise ValueError(f"{where}: field 'problem' = {p!r:.60} is invalid: allowed a non-empty string")
    if not (_scalar_answer(a) or (isinstance(a, list) and a and all(_scalar_answer(x) for x in a))):
        raise ValueError(f"{where}: field 'answer' = {a!r:.60} is invalid: allowed a non-empty string, a finite "
                         "number or a non-empty list of those")


def validate_data_files(files: Sequence[str | Path]) -> int:
    """Read and check every row of ``files`` (see :func:`check_row`); a file without rows is refused too.
    Returns the number of rows."""
    n = 0
    for f in files:
        rows = read_rows(f)
        if not rows:
            raise ValueError(f"{f}: no rows (an empty file); every data file needs at least one problem")
        for loc, row in rows:
            check_row(row, f"{f} {loc}")
            n += 1
    return n


def load_math_prompts(files: Sequence[str | Path], template: str) -> list[PromptItem]:
    """All rows of ``files`` as prompts; an invalid row raises ValueError naming file, line and field."""
    if not files:
        raise ValueError("data.train_files is empty: give at least one problem file")
    items = []
    for f in files:
        rows = read_rows(f)
        if not rows:
            raise ValueError(f"{f}: no rows (an empty file); every data file needs at least one problem")
        for loc, row in rows:
            check_row(row, f"{f} {loc}")
            items.append(PromptItem(render(template, row["problem"]), row["answer"], f"{f} {loc}"))
    return items


def check_prompt_lengths(items: Sequence[PromptItem], count_tokens, context: int, max_new_tokens: int) -> None:
    """Every rendered prompt leaves room for ``max_new_tokens`` in a ``context`` of tokens (``count_tokens``:
    text -> number of tokens). Raises ValueError naming the file and line of the first that does not."""
    room = context - max_new_tokens
    for item in items:
        n = count_tokens(item.prompt)
        if n > room:
            raise ValueError(f"{item.source}: field 'problem' is {n} tokens after the prompt template; with "
                             f"rollout.max_new_tokens = {max_new_tokens} at most {room} fit the context of {context} "
                             "tokens")


def prompt_budgets(files: Sequence[str | Path], key: str, missing: str, default: float,
                   max_new_tokens: int) -> list[float]:
    """Each row's budget B_i from its field ``key`` (data.budget_key), in the order of :func:`load_math_prompts`
    (:func:`row_budgets` over the rows of every file, each named by its file and line). Returns [rows] floats."""
    located = [(f"{f} {loc}", row) for f in files for loc, row in read_rows(f)]
    return row_budgets([row for _, row in located], key, missing, default, max_new_tokens,
                       where=[w for w, _ in located])


def row_budgets(rows: Sequence[Any], key: str, missing: str, default: float, max_new_tokens: int,
                where: Sequence[str] | None = None) -> list[float]:
    """Each data row's budget B_i from its field ``key`` (data.budget_key): the rows of data files, or the synthetic
    task's (``SyntheticTask.rows``). ``where``: each row's name in errors (default ``row <index>``).

    A row without the field gets ``default`` (laconic.budget) when ``missing`` is ``recipe``, else it is refused;
    a value that is not a finite number in (0, max_new_tokens) is refused. Errors name the row and the key.
    Returns [rows] floats."""
    out = []
    for i, row in enumerate(rows):
        at = where[i] if where is not None else f"row {i}"
        if not isinstance(row, dict) or key not in row or row[key] is None:
            if missing == "refuse":
                raise ValueError(f"{at}: field {key!r} (data.budget_key) is missing and data.budget_missing = "
                                 "refuse")
            out.append(float(default))
            continue
        v = row[key]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v < max_new_tokens
        if not ok:
            raise ValueError(f"{at}: field {key!r} (data.budget_key) = {v!r:.40} is invalid: allowed a number "
                             f"of tokens in (0, rollout.max_new_tokens = {max_new_tokens})")
        out.append(float(v))
    return out
