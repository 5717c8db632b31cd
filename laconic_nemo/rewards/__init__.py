"""Verifiable math reward: last-boxed-answer extraction and math-verify grading with a worker pool.

Public API (used by the trainer and the evaluation):
    extract_answer(text) -> str | None
    exact_answer_status(text, answer) -> correct | wrong | no_answer (the synthetic task's rule)
    normalize_reference(answer) -> list[str]
    grade_one(response, answer) -> (score, status)
    MathReward(num_workers=2, timeout_s=5.0, format_weight=0.0).score(responses, answers) -> RewardResult
"""

from .extract import exact_answer_status, extract_answer, has_boxed_answer
from .grader import STATUSES, answers_equivalent, clean_answer, grade_one, normalize_reference
from .math_reward import MathReward, RewardResult

__all__ = [
    "STATUSES",
    "MathReward",
    "RewardResult",
    "answers_equivalent",
    "clean_answer",
    "exact_answer_status",
    "extract_answer",
    "grade_one",
    "has_boxed_answer",
    "normalize_reference",
]
