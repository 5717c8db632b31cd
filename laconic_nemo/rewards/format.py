"""Format terms of the task reward and the recipe's reward function.

The task reward is ``(1 - format_weight) * accuracy + format_weight * format`` (``reward.format_weight``).
Two format terms (``reward.format``):

* ``boxed``: the response has a final boxed answer (the project's default; computed inside
  :class:`~laconic_nemo.rewards.MathReward` from the extraction it already does).
* ``think_boxed``: the authors' term, EasyR1 v0.3.2.dev0 ``examples/reward_function/math.py``
  (``format_reward``): after ``re.sub(r"\\s*(<|>|/)\\s*", r"\\1", response)`` (whitespace around ``<``, ``>``,
  ``/`` removed, applied there to the response before both terms), the whole response must match
  ``<think>.*</think>.*\\boxed\\{.*\\}.*`` (``re.DOTALL``). Accuracy is still graded by MathReward;
  as in the authors' reward the format term counts even when grading failed (timeout / error -> accuracy 0).

Note: when the prompt template already opens ``<think>`` (the DeepSeek-R1-Distill chat template ends with
``<think>\\n``), the decoded response holds only ``</think>``, so ``think_boxed`` is 0 unless the model writes
``<think>`` again; this is the authors' reward as written.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from .math_reward import MathReward

__all__ = ["FORMATS", "think_boxed_format", "build_reward_fn"]

FORMATS = ("boxed", "think_boxed")

_WS_AROUND_TAGS = re.compile(r"\s*(<|>|/)\s*")
_THINK_BOXED = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def think_boxed_format(response: str) -> float:
    """1.0 if ``response`` is ``<think>...</think>`` followed by text holding ``\\boxed{...}``, else 0.0."""
    return 1.0 if _THINK_BOXED.fullmatch(_WS_AROUND_TAGS.sub(r"\1", response)) else 0.0


# (responses, reference answers) -> (scores [N], metrics)
RewardFn = Callable[[list[str], list[Any]], "tuple[list[float], dict[str, float]]"]


def build_reward_fn(reward: Any, checker=None) -> tuple[RewardFn, MathReward]:
    """The math reward function of a recipe's ``reward:`` section (kind ``math``; ``laconic_nemo.config.RewardConfig``:
    its ``format``, ``format_weight``, ``num_workers`` and ``timeout_s``).

    Builds :class:`MathReward` (no worker process starts before the first call) and, for
    ``format: think_boxed``, combines its accuracy with :func:`think_boxed_format`. Returns
    ``(reward_fn, grader)``; close ``grader`` when done. ``checker`` replaces math-verify (tests).
    """
    fmt, fw = reward.format, reward.format_weight
    if fmt not in FORMATS:
        raise ValueError(f"reward.format must be one of {FORMATS}, got {fmt!r}")
    kwargs = dict(num_workers=reward.num_workers, timeout_s=reward.timeout_s)
    if checker is not None:
        kwargs["checker"] = checker
    if fmt == "boxed":
        grader = MathReward(format_weight=fw, **kwargs)

        def reward_fn(texts, answers):
            res = grader.score(texts, answers)
            return res.scores, res.metrics

        return reward_fn, grader

    grader = MathReward(format_weight=0.0, **kwargs)

    def reward_fn_think(texts, answers):
        res = grader.score(texts, answers)
        fmt_scores = [think_boxed_format(t) for t in texts]
        scores = [(1.0 - fw) * (s == "correct") + fw * f for s, f in zip(res.statuses, fmt_scores)]
        metrics = dict(res.metrics)
        metrics["format"] = sum(fmt_scores) / len(fmt_scores) if fmt_scores else 0.0
        return scores, metrics

    return reward_fn_think, grader
