"""The paper's math benchmarks and the evaluation prompt.

Files ship in ``laconic_nemo/data/benchmarks`` (from agentica-project/deepscaler, MIT; see ATTRIBUTION.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "benchmarks")

# benchmark key -> (file, display name); the order is the paper's Table 1 column order
BENCHMARKS = {
    "aime2024": ("aime2024.json", "AIME2024"),
    "math500": ("math500.json", "MATH500"),
    "minerva": ("minerva.json", "Minerva"),
    "olympiad_bench": ("olympiad_bench.json", "OlympiadBench"),
    "amc": ("amc.json", "AMC"),
}
# the macro average of the paper's table
AVERAGE_OVER = ("aime2024", "math500", "minerva", "olympiad_bench")

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass
class Problem:
    """One benchmark problem: index in the file, statement and reference answer (str, float or list)."""

    benchmark: str
    index: int
    problem: str
    answer: Any


def parse_benchmarks(spec: str | list[str]) -> list[str]:
    """"aime2024,math500" -> ["aime2024", "math500"]; "all" -> every benchmark. Raises for unknown names."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() for n in names if n.strip()]
    if names == ["all"]:
        return list(BENCHMARKS)
    bad = [n for n in names if n not in BENCHMARKS]
    if bad or not names:
        raise ValueError(f"--benchmarks: unknown {bad or names}; choose from {', '.join(BENCHMARKS)} or 'all'")
    return names


def load_benchmark(name: str, limit: int | None = None, data_dir: str | None = None) -> list[Problem]:
    """The first ``limit`` problems (all when None) of benchmark ``name``."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    path = os.path.join(data_dir or DATA_DIR, BENCHMARKS[name][0])
    with open(path) as f:
        rows = json.load(f)
    rows = rows[:limit] if limit else rows
    return [Problem(name, i, r["problem"], r["answer"]) for i, r in enumerate(rows)]


def build_prompt(problem: str, tokenizer=None, stated: str = "") -> str:
    """DeepSeek-R1 style prompt: the problem followed by :data:`INSTRUCTION` (and ``stated``, a budget stated to
    the model, e.g. " Think for 1000 tokens.") as the user turn, wrapped in the tokenizer's chat template (with the
    generation prompt) when it has one; plain text otherwise."""
    return chat_prompt(user_turn(problem, stated), tokenizer)


def user_turn(problem: str, stated: str = "") -> str:
    """The evaluation's user turn: the problem, :data:`INSTRUCTION`, then ``stated`` (a stated budget, or nothing)."""
    return f"{problem}\n{INSTRUCTION}{stated}"


def chat_prompt(user: str, tokenizer=None) -> str:
    """``user`` as the one user turn of the tokenizer's chat template (with the generation prompt) when it has one;
    plain text otherwise."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
    return user
