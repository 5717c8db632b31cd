"""Reward shapers: LACONIC and the baselines of the paper, each a registered pure function
(task rewards r, lengths L, truncation flags, lambda) -> shaped rewards (docs/algorithm.md, "Shapers").

The trainer calls the recipe's :class:`Shaper` once per GRPO step on the rollout batch (flat tensors [N],
N = num_prompts * G, each prompt's G responses contiguous) with the current lambda, then computes group
advantages of the shaped rewards. lambda lives in the trainer's :class:`~laconic_nemo.core.dual.DualController`
(shapers registered with ``lam="dual"``), is ``laconic.lambda_init`` (``lam="fixed"``) or 0 (``lam="none"``).
Settings are checked once, at the config boundary (:mod:`laconic_nemo.config`).

L is the number of generated tokens of a response (EOS excluded; a truncated response counts L_max).
``1[correct]`` is ``task_reward > correct_threshold`` (0.5: right for 0/1 accuracy and for the authors'
0.9 * accuracy + 0.1 * format reward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from laconic_nemo.core.advantages import check_group_size
from laconic_nemo.core.costs import clipped_cost, float_dtype_of, lagrangian_reward, length_penalty, linear_cost

__all__ = ["SHAPERS", "Shaper", "register_shaper", "shaping_metrics"]

# name -> fn(r64 [N], L64 [N], trunc [N] bool, targets64 [N] | None, group_size, lam, settings) -> (shaped64, metrics)
SHAPERS: dict[str, Callable] = {}


def register_shaper(name: str, *, lam: str = "none", needs_targets: bool = False,
                    cost: Callable = clipped_cost) -> Callable:
    """Register a shaping function under ``name`` (``laconic.shaper``).

    lam: where its lambda comes from: "dual" (the DualController), "fixed" (laconic.lambda_init) or "none" (0).
    needs_targets: it takes per-sample target lengths n_gold. cost: the cost its ``mean_cost`` metric reports."""
    def deco(fn: Callable) -> Callable:
        fn.lam, fn.needs_targets, fn.cost = lam, needs_targets, cost
        SHAPERS[name] = fn
        return fn
    return deco


@dataclass(frozen=True)
class Shaper:
    """The recipe's shaper: a registered function and its settings (from ``laconic:``); no state."""

    name: str
    budget: float | None = None          # B; None: the budget metrics are NaN
    max_length: float | None = None      # L_max; ``truncated=None`` reads as ``L >= L_max``
    penalty_cap: float | None = None
    hit_cap: float = 0.0
    alpha: float | None = None           # None: the method's default
    overlong_buffer: float = 512.0
    overlong_penalty: float = 1.0
    correct_threshold: float = 0.5

    @property
    def fn(self) -> Callable:
        return SHAPERS[self.name]

    def __call__(self, rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor | None,
                 group_size: int, lam: float, targets: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        """Shape one rollout batch.

        Args:
            rewards: [N] task rewards r. lengths: [N] L (a truncated response counts L_max).
            truncated: [N] bool, True where the response hit L_max; None = ``L >= max_length`` (all False
                without max_length). group_size: G, dividing N. lam: lambda of this step.
            targets: [N] per-sample target lengths n_gold (l1_exact / l1_max only).

        Returns:
            shaped rewards [N] (rewards' float dtype) and Python-float metrics (:func:`shaping_metrics` plus the
            method's own).
        """
        r, L = torch.as_tensor(rewards), torch.as_tensor(lengths)
        if r.dim() != 1 or L.shape != r.shape:
            raise ValueError(f"rewards and lengths must be flat tensors [N] of one shape, got {tuple(r.shape)} "
                             f"and {tuple(L.shape)}")
        check_group_size(r.numel(), group_size)
        r64, L64 = r.to(torch.float64), L.to(torch.float64)
        if self.max_length is not None and (L64 > self.max_length).any():
            raise ValueError(f"lengths must be <= max_length ({self.max_length:g}); a truncated response counts "
                             f"as max_length, got max {float(L64.max()):g}")
        if truncated is None:
            truncated = L64 >= self.max_length if self.max_length is not None else torch.zeros_like(L64, dtype=bool)
        elif truncated.shape != r.shape or truncated.dtype != torch.bool:
            raise ValueError(f"truncated must be a bool tensor of shape {tuple(r.shape)}, got "
                             f"{truncated.dtype} {tuple(truncated.shape)}")
        if self.fn.needs_targets and targets is None:
            raise ValueError(f"shaper {self.name!r} needs per-sample target lengths (targets [N], n_gold)")
        t64 = None if targets is None else torch.as_tensor(targets).to(torch.float64)
        shaped64, extra = self.fn(r64, L64, truncated, t64, group_size, lam, self)
        metrics = shaping_metrics(r64, L64, truncated, shaped64, lam, self.budget, self.fn.cost)
        metrics.update(extra)
        return shaped64.to(float_dtype_of(r)), metrics


def shaping_metrics(r64, L64, trunc, shaped64, lam: float, budget: float | None, cost: Callable) -> dict[str, float]:
    """The metrics every shaper reports (means over the batch; NaN where they need a budget and B is None)."""
    n = max(r64.numel(), 1)
    return {
        "mean_length": float(L64.sum()) / n,
        "frac_over_budget": float((L64 > budget).sum()) / n if budget is not None else math.nan,
        "frac_truncated": float(trunc.sum()) / n,
        "mean_cost": float(cost(L64, budget).sum()) / n if budget is not None else math.nan,
        "lambda": lam,
        "task_reward_mean": float(r64.sum()) / n,
        "shaped_reward_mean": float(shaped64.sum()) / n,
    }


def _lagrangian(r64, L64, trunc, lam, s: Shaper, cost: Callable):
    """``r - min(lambda * c(L), penalty_cap) - hit_cap * 1[truncated]`` (core.costs.lagrangian_reward)."""
    c = cost(L64, s.budget)
    n = max(r64.numel(), 1)
    extra = {}
    if s.penalty_cap is not None:
        extra["frac_penalty_capped"] = float((lam * c > s.penalty_cap).sum()) / n
    extra["mean_penalty"] = float(length_penalty(c, lam, s.penalty_cap, s.hit_cap, trunc).sum()) / n
    return lagrangian_reward(r64, c, lam, s.penalty_cap, s.hit_cap, trunc), extra


@register_shaper("laconic", lam="dual")
def laconic(r64, L64, trunc, t64, G, lam, s):
    """LACONIC: clipped cost ``max((L - B) / B, 0)``, adaptive lambda."""
    return _lagrangian(r64, L64, trunc, lam, s, clipped_cost)


@register_shaper("linear", lam="dual", cost=linear_cost)
def linear(r64, L64, trunc, t64, G, lam, s):
    """Ablation: linear cost ``(L - B) / B`` (negative under budget), adaptive lambda."""
    return _lagrangian(r64, L64, trunc, lam, s, linear_cost)


@register_shaper("fixed", lam="fixed")
def fixed(r64, L64, trunc, t64, G, lam, s):
    """Ablation: clipped cost with a constant lambda = lambda_init (no dual step)."""
    return _lagrangian(r64, L64, trunc, lam, s, clipped_cost)


@register_shaper("grpo")
def grpo(r64, L64, trunc, t64, G, lam, s):
    """Plain GRPO: the task reward, no length term (lambda = 0)."""
    return r64.clone(), {}


def _alpha(s: Shaper, default: float) -> float:
    return float(s.alpha) if s.alpha is not None else default


@register_shaper("l1_exact", needs_targets=True)
def l1_exact(r64, L64, trunc, t64, G, lam, s):
    """L1-Exact: ``1[correct] - alpha * |n_gold - L|`` (alpha default 0.0003)."""
    gap = (t64 - L64).abs()
    return (r64 > s.correct_threshold).to(torch.float64) - _alpha(s, 0.0003) * gap, {
        "mean_abs_target_gap": float(gap.mean())}


@register_shaper("l1_max", needs_targets=True)
def l1_max(r64, L64, trunc, t64, G, lam, s):
    """L1-Max: ``1[correct] * clip(alpha * (n_gold - L) + 0.5, 0, 1)`` (alpha default 0.0003)."""
    factor = (_alpha(s, 0.0003) * (t64 - L64) + 0.5).clamp(0.0, 1.0)
    extra = {"mean_abs_target_gap": float((t64 - L64).abs().mean()),
             "frac_over_target": float((L64 > t64).to(torch.float64).mean())}
    return (r64 > s.correct_threshold).to(torch.float64) * factor, extra


@register_shaper("efficient")
def efficient(r64, L64, trunc, t64, G, lam, s):
    """Efficient Reasoning (Arora & Zanette): correct response i of a group gets
    ``1 - alpha * sigmoid((L_i - mean_c) / (std_c + 1e-7))`` with mean_c and the population std_c over the
    group's correct responses; incorrect responses get 0 (alpha default 0.1)."""
    correct = (r64 > s.correct_threshold).view(-1, G)
    c = correct.to(torch.float64)
    Lg = L64.view(-1, G)
    denom = c.sum(dim=1, keepdim=True).clamp_min(1.0)
    mean_c = (Lg * c).sum(dim=1, keepdim=True) / denom
    std_c = (((Lg - mean_c) ** 2) * c).sum(dim=1, keepdim=True).div(denom).sqrt()
    bonus = 1.0 - _alpha(s, 0.1) * torch.sigmoid((Lg - mean_c) / (std_c + 1e-7))
    shaped = torch.where(correct, bonus, torch.zeros_like(bonus)).view(-1)
    return shaped, {"frac_correct": float(c.mean()) if c.numel() else math.nan}


@register_shaper("overlong")
def overlong(r64, L64, trunc, t64, G, lam, s):
    """DAPO soft overlong punishment: ``r + min(-(L - (L_max - buffer)) / buffer * penalty, 0)``."""
    buffer = float(s.overlong_buffer)
    start = float(s.max_length) - buffer
    pen = (-(L64 - start) / buffer * float(s.overlong_penalty)).clamp_max(0.0)
    n = max(r64.numel(), 1)
    return r64 + pen, {"frac_in_overlong_buffer": float((L64 > start).sum()) / n,
                       "mean_overlong_penalty": float(pen.sum()) / n}
