"""Reward shapers: LACONIC and the baselines of the paper, each a registered pure function
(task rewards r, lengths L, truncation flags, lambda) -> shaped rewards, all on [P, G] (prompts x group)
(docs/algorithm.md, "Shapers").

The trainer calls :func:`shape` once per GRPO step on the rollout batch, grouped [P, G], with the recipe's
``laconic:`` section (:class:`laconic_nemo.config.LaconicConfig`, read as it is: ``shaper``, ``budget``,
``penalty_cap``, ``hit_cap``, ``alpha``, ``overlong_buffer``, ``overlong_penalty``) and the current lambda, then
computes group advantages of the shaped rewards. lambda lives in the trainer's
:class:`~laconic_nemo.core.dual.DualController` (shapers registered with ``lam="dual"``: :func:`lambda_controller`),
is ``laconic.lambda_init`` (``lam="fixed"``) or 0 (``lam="none"``) (:func:`constant_lambda`). Settings are checked
once, at the config boundary (:mod:`laconic_nemo.config`; the plug-ins' own boundary is
``integrations.common.LaconicSettings``); :class:`Shaper` holds the same settings for callers without a recipe.

L is the number of generated tokens of a response (EOS excluded; a truncated response counts L_max).
``1[correct]`` is ``task_reward > CORRECT`` (0.5: right for 0/1 accuracy and for the authors'
0.9 * accuracy + 0.1 * format reward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from laconic_nemo.core.costs import (
    clipped_cost64,
    float_dtype_of,
    lagrangian_reward,
    length_penalty,
    linear_cost64,
    per_prompt_cost64,
)
from laconic_nemo.core.dual import DualController, DualSettings

__all__ = ["SHAPERS", "Shaper", "constant_lambda", "lambda_controller", "register_shaper", "shape", "shaping_metrics"]

# name -> fn(r64 [P, G], L64 [P, G], trunc [P, G] bool, targets64 [P, G] | None, lam, settings, max_length)
#         -> (shaped64 [P, G], metrics)
SHAPERS: dict[str, Callable] = {}
CORRECT = 0.5  # 1[correct] = task reward > CORRECT


def register_shaper(name: str, *, lam: str = "none", needs_targets: bool = False,
                    cost: Callable = clipped_cost64) -> Callable:
    """Register a shaping function under ``name`` (``laconic.shaper``).

    lam: where its lambda comes from: "dual" (the DualController), "fixed" (laconic.lambda_init) or "none" (0).
    needs_targets: it takes per-sample target lengths n_gold. cost: the float64 cost its ``mean_cost`` metric
    reports."""
    def deco(fn: Callable) -> Callable:
        fn.lam, fn.needs_targets, fn.cost = lam, needs_targets, cost
        SHAPERS[name] = fn
        return fn
    return deco


def lambda_controller(settings: Any, max_length: float | None) -> DualController | None:
    """The lambda controller of an adaptive shaper (registered with ``lam="dual"``: laconic, linear) from the
    ``laconic:`` settings (budget B, eta, ceiling Lambda, lambda_init, floor, controller, kp, kd) and L_max; None
    for the other shapers. One controller per constraint: a run with several constraints holds several."""
    if SHAPERS[settings.shaper].lam != "dual":
        return None
    return DualSettings.of(settings, max_length).build()


def constant_lambda(settings: Any) -> float:
    """lambda of a shaper without a controller: ``lambda_init`` for ``fixed``, 0 for the others."""
    return settings.lambda_init if SHAPERS[settings.shaper].lam == "fixed" else 0.0


def shape(settings: Any, rewards: torch.Tensor, lengths: torch.Tensor, lam: float, *,
          max_length: float | None = None, truncated: torch.Tensor | None = None,
          targets: torch.Tensor | None = None, budgets: torch.Tensor | None = None,
          lams: torch.Tensor | None = None, tail_penalty: torch.Tensor | None = None,
          band_penalty: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Shape one rollout batch with the shaper ``settings.shaper`` and its settings.

    Args:
        settings: the ``laconic:`` section (or a :class:`Shaper`): shaper, budget (None: the budget metrics are
            NaN), penalty_cap, hit_cap, alpha (None: the method's default), overlong_buffer, overlong_penalty.
        rewards: [P, G] task rewards r. lengths: [P, G] L (a truncated response counts L_max).
        lam: lambda of this step.
        max_length: L_max; ``truncated=None`` reads as ``L >= max_length`` (all False without it).
        truncated: [P, G] bool, True where the response hit L_max.
        targets: [P, G] per-sample target lengths n_gold (l1_exact / l1_max only).
        budgets: [P, G] per-prompt budgets B_i (laconic / linear with ``laconic.per_prompt_budget``): the cost is
            ``(L_i - B_i) / B_i`` (clipped at 0 for laconic) and the multiplier of response i is ``lams[i]``.
        lams: [P, G] float64, each response's class multiplier lambda_k(i) (with ``budgets``).
        tail_penalty: [P, G] float64 ``mu 1[L > B_tail]`` subtracted from the shaped reward (tail constraint).
        band_penalty: [P, G] float64 ``lambda_lo max((B_lo - L) / B_lo, 0)`` subtracted from the shaped reward
            (the band's lower bound, :mod:`laconic_nemo.core.band`; outside ``penalty_cap``).

    Returns:
        shaped rewards [P, G] (rewards' float dtype) and Python-float metrics (:func:`shaping_metrics` plus the
        method's own).
    """
    r, L = torch.as_tensor(rewards), torch.as_tensor(lengths)
    if r.dim() != 2 or L.shape != r.shape:
        raise ValueError(f"rewards and lengths must be grouped [P, G] tensors of one shape, got {tuple(r.shape)} "
                         f"and {tuple(L.shape)}")
    fn = SHAPERS[settings.shaper]
    r64, L64 = r.to(torch.float64), L.to(torch.float64)
    if max_length is not None and (L64 > max_length).any():
        raise ValueError(f"lengths must be <= max_length ({max_length:g}); a truncated response counts "
                         f"as max_length, got max {float(L64.max()):g}")
    if truncated is None:
        truncated = L64 >= max_length if max_length is not None else torch.zeros_like(L64, dtype=torch.bool)
    elif truncated.shape != r.shape or truncated.dtype != torch.bool:
        raise ValueError(f"truncated must be a bool tensor of shape {tuple(r.shape)}, got "
                         f"{truncated.dtype} {tuple(truncated.shape)}")
    if fn.needs_targets and targets is None:
        raise ValueError(f"shaper {settings.shaper!r} needs per-sample target lengths (targets [P, G], n_gold)")
    t64 = None if targets is None else torch.as_tensor(targets).to(torch.float64)
    if budgets is None:
        shaped64, extra = fn(r64, L64, truncated, t64, lam, settings, max_length)
    else:
        if fn.lam != "dual" or lams is None or budgets.shape != r.shape or lams.shape != r.shape:
            raise ValueError(f"per-prompt budgets need an adaptive shaper (laconic, linear) and budgets and "
                             f"multipliers of shape {tuple(r.shape)}; got shaper {settings.shaper!r}")
        cost = per_prompt_cost64(L64, budgets.to(torch.float64), linear=fn.cost is linear_cost64)
        shaped64, extra = _lagrangian(r64, cost, lams.to(torch.float64), truncated, settings)
        extra["mean_cost_per_prompt"] = float(cost.mean())
    if tail_penalty is not None:
        shaped64 = shaped64 - tail_penalty.to(torch.float64)
        extra["mean_tail_penalty"] = float(tail_penalty.to(torch.float64).mean())
    if band_penalty is not None:
        shaped64 = shaped64 - band_penalty.to(torch.float64)
        extra["mean_band_penalty"] = float(band_penalty.to(torch.float64).mean())
    metrics = shaping_metrics(r64, L64, truncated, shaped64, lam, settings.budget, fn.cost)
    metrics.update(extra)
    return shaped64.to(float_dtype_of(r)), metrics


@dataclass(frozen=True)
class Shaper:
    """A shaper and its settings without a recipe (tests, benchmarks): the fields of the ``laconic:`` section that
    :func:`shape` reads, under ``name`` the shaper, and L_max."""

    name: str
    budget: float | None = None          # B; None: the budget metrics are NaN
    max_length: float | None = None      # L_max; ``truncated=None`` reads as ``L >= L_max``
    penalty_cap: float | None = None
    hit_cap: float = 0.0
    alpha: float | None = None           # None: the method's default
    overlong_buffer: float = 512.0
    overlong_penalty: float = 1.0

    @property
    def shaper(self) -> str:
        return self.name

    @property
    def fn(self) -> Callable:
        return SHAPERS[self.name]

    def __call__(self, rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor | None, lam: float,
                 targets: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """:func:`shape` with these settings: rewards, lengths [P, G] -> (shaped [P, G], metrics)."""
        return shape(self, rewards, lengths, lam, max_length=self.max_length, truncated=truncated, targets=targets)


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


def _lagrangian(r64, c, lam, trunc, s):
    """``r - min(lambda * c, penalty_cap) - hit_cap * 1[truncated]`` (core.costs.lagrangian_reward) and its metrics."""
    n = max(r64.numel(), 1)
    extra = {}
    if s.penalty_cap is not None:
        extra["frac_penalty_capped"] = float((lam * c > s.penalty_cap).sum()) / n
    extra["mean_penalty"] = float(length_penalty(c, lam, s.penalty_cap, s.hit_cap, trunc).sum()) / n
    return lagrangian_reward(r64, c, lam, s.penalty_cap, s.hit_cap, trunc), extra


@register_shaper("laconic", lam="dual")
def laconic(r64, L64, trunc, t64, lam, s, lmax):
    """LACONIC: clipped cost ``max((L - B) / B, 0)``, adaptive lambda."""
    return _lagrangian(r64, clipped_cost64(L64, s.budget), lam, trunc, s)


@register_shaper("linear", lam="dual", cost=linear_cost64)
def linear(r64, L64, trunc, t64, lam, s, lmax):
    """Ablation: linear cost ``(L - B) / B`` (negative under budget), adaptive lambda."""
    return _lagrangian(r64, linear_cost64(L64, s.budget), lam, trunc, s)


@register_shaper("fixed", lam="fixed")
def fixed(r64, L64, trunc, t64, lam, s, lmax):
    """Ablation: clipped cost with a constant lambda = lambda_init (no dual step)."""
    return _lagrangian(r64, clipped_cost64(L64, s.budget), lam, trunc, s)


@register_shaper("grpo")
def grpo(r64, L64, trunc, t64, lam, s, lmax):
    """Plain GRPO: the task reward, no length term (lambda = 0)."""
    return r64.clone(), {}


def _alpha(s: Any, default: float) -> float:
    return float(s.alpha) if s.alpha is not None else default


@register_shaper("l1_exact", needs_targets=True)
def l1_exact(r64, L64, trunc, t64, lam, s, lmax):
    """L1-Exact: ``1[correct] - alpha * |n_gold - L|`` (alpha default 0.0003)."""
    gap = (t64 - L64).abs()
    return (r64 > CORRECT).to(torch.float64) - _alpha(s, 0.0003) * gap, {"mean_abs_target_gap": float(gap.mean())}


@register_shaper("l1_max", needs_targets=True)
def l1_max(r64, L64, trunc, t64, lam, s, lmax):
    """L1-Max: ``1[correct] * clip(alpha * (n_gold - L) + 0.5, 0, 1)`` (alpha default 0.0003)."""
    factor = (_alpha(s, 0.0003) * (t64 - L64) + 0.5).clamp(0.0, 1.0)
    extra = {"mean_abs_target_gap": float((t64 - L64).abs().mean()),
             "frac_over_target": float((L64 > t64).to(torch.float64).mean())}
    return (r64 > CORRECT).to(torch.float64) * factor, extra


@register_shaper("efficient")
def efficient(r64, L64, trunc, t64, lam, s, lmax):
    """Efficient Reasoning (Arora & Zanette): correct response i of a group gets
    ``1 - alpha * sigmoid((L_i - mean_c) / (std_c + 1e-7))`` with mean_c and the population std_c over the
    group's correct responses (a row of [P, G]); incorrect responses get 0 (alpha default 0.1)."""
    correct = r64 > CORRECT
    c = correct.to(torch.float64)
    denom = c.sum(dim=1, keepdim=True).clamp_min(1.0)
    mean_c = (L64 * c).sum(dim=1, keepdim=True) / denom
    std_c = (((L64 - mean_c) ** 2) * c).sum(dim=1, keepdim=True).div(denom).sqrt()
    bonus = 1.0 - _alpha(s, 0.1) * torch.sigmoid((L64 - mean_c) / (std_c + 1e-7))
    shaped = torch.where(correct, bonus, torch.zeros_like(bonus))
    return shaped, {"frac_correct": float(c.mean()) if c.numel() else math.nan}


@register_shaper("overlong")
def overlong(r64, L64, trunc, t64, lam, s, lmax):
    """DAPO soft overlong punishment: ``r + min(-(L - (L_max - buffer)) / buffer * penalty, 0)``."""
    buffer = float(s.overlong_buffer)
    start = float(lmax) - buffer
    pen = (-(L64 - start) / buffer * float(s.overlong_penalty)).clamp_max(0.0)
    n = max(r64.numel(), 1)
    return r64 + pen, {"frac_in_overlong_buffer": float((L64 > start).sum()) / n,
                       "mean_overlong_penalty": float(pen.sum()) / n}
