"""Prompt datasets: problems with reference answers, rendered through a prompt template.

A dataset is a list of :class:`PromptItem` (the rendered prompt text and the reference answer the
reward needs). Math problem files are JSON (a list of rows), JSONL or Parquet with fields
``problem`` and ``answer`` (answer: str, number or list of acceptable strings, kept as is: the
reward normalises it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

# Prompt templates. `{problem}` is replaced by the problem text. Chat-formatted templates (for
# instruction-tuned models) are applied by the tokenizer's chat template when one is available;
# these plain forms are what the paper's DeepScaleR / DeepSeek-R1-Distill runs use.
TEMPLATES = {
    # DeepSeek-R1-Distill / DeepScaleR: user turn, answer expected in \boxed{}.
    "deepseek_r1": "<｜begin▁of▁sentence｜><｜User｜>{problem} Let's think step by step and output the final answer "
    "within \\boxed{{}}.<｜Assistant｜><think>\n",
    # Qwen chat format (Qwen2.5-Math-Instruct, Qwen3).
    "qwen_chat": "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    "<|im_end|>\n<|im_start|>user\n{problem}<|im_end|>\n<|im_start|>assistant\n",
    # The bare problem (base models, tests).
    "plain": "{problem}",
}


@dataclass(frozen=True)
class PromptItem:
    prompt: str
    answer: Any


def render(template: str, problem: str) -> str:
    if template not in TEMPLATES:
        raise ValueError(f"data.prompt_template = {template!r}: allowed {', '.join(sorted(TEMPLATES))}")
    return TEMPLATES[template].replace("{problem}", problem).replace("{{}}", "{}")


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a .json (list of objects), .jsonl or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.suffix == ".jsonl":
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of rows")
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # optional dependency, present in the NeMo container

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported data file type {path.suffix!r} (use .json, .jsonl or .parquet)")


def load_math_prompts(files: Sequence[str | Path], template: str) -> list[PromptItem]:
    """All rows of ``files`` as prompts. Rows without a problem or answer raise ValueError."""
    if not files:
        raise ValueError("data.train_files is empty: give at least one problem file")
    items = []
    for f in files:
        for i, row in enumerate(read_rows(f)):
            if "problem" not in row or "answer" not in row:
                raise ValueError(f"{f} row {i}: needs fields 'problem' and 'answer', has {sorted(row)}")
            items.append(PromptItem(render(template, str(row["problem"])), row["answer"]))
    return items
