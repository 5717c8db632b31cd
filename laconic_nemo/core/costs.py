"""Length costs and the Lagrangian reward of LACONIC.

Notation as in the paper: ``L`` is the number of generated tokens of a response (thinking and answer,
EOS excluded; a response truncated at the generation limit counts as ``L_max``, its generated length),
``B`` is the token budget, ``lambda`` the Lagrange multiplier.
"""

from __future__ import annotations

import math

import torch

__all__ = ["clipped_cost", "linear_cost", "lagrangian_reward", "check_budget", "float_dtype_of"]


def check_budget(budget: float, name: str = "budget") -> float:
    """Return ``budget`` as a Python float after checking it is a finite number > 0."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"{name} must be a finite number > 0 (tokens), got {budget!r}")
    value = float(budget)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0 (tokens), got {budget!r}")
    return value


def float_dtype_of(t: torch.Tensor) -> torch.dtype:
    """The floating dtype a result derived from ``t`` is returned in: ``t``'s own if floating, else the default."""
    return t.dtype if t.is_floating_point() else torch.get_default_dtype()


def _as_lengths(lengths: torch.Tensor | list | tuple) -> torch.Tensor:
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(lengths)
    if lengths.is_complex() or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be a real integer or float tensor, got dtype {lengths.dtype}")
    return lengths


def clipped_cost(lengths: torch.Tensor, budget: float) -> torch.Tensor:
    """Clipped length cost ``c = max((L - B) / B, 0)``, elementwise (zero inside the budget).

    Args:
        lengths: tensor [...] of response lengths L in tokens (int or float).
        budget: B > 0, tokens.

    Returns:
        float tensor [...] (the input's float dtype, or the default float dtype for integer input).
    """
    return linear_cost(lengths, budget).clamp_min(0.0)


def linear_cost(lengths: torch.Tensor, budget: float) -> torch.Tensor:
    """Linear (unclipped) length cost ``c~ = (L - B) / B`` of the paper's cost ablation.

    Negative for responses shorter than B, so with lambda > 0 shorter is always better.

    Args:
        lengths: tensor [...] of response lengths L in tokens.
        budget: B > 0, tokens.

    Returns:
        float tensor [...] (the input's float dtype, or the default float dtype for integer input).
    """
    b = check_budget(budget)
    lengths = _as_lengths(lengths)
    out_dtype = float_dtype_of(lengths)
    return ((lengths.to(torch.float64) - b) / b).to(out_dtype)


def lagrangian_reward(rewards: torch.Tensor, costs: torch.Tensor, lam: float | torch.Tensor) -> torch.Tensor:
    """Lagrangian reward ``l = r - lambda * c``, elementwise.

    Args:
        rewards: tensor [N] of task rewards r.
        costs: tensor [N] of costs c (same shape as rewards).
        lam: the multiplier lambda (a float, or a tensor broadcastable to [N]).

    Returns:
        float tensor [N] in the promoted floating dtype of rewards and costs.
    """
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards)
    if not isinstance(costs, torch.Tensor):
        costs = torch.as_tensor(costs)
    if rewards.shape != costs.shape:
        raise ValueError(f"rewards and costs must have the same shape, got {tuple(rewards.shape)} and "
                         f"{tuple(costs.shape)}")
    if isinstance(lam, (int, float)) and not isinstance(lam, bool) and not math.isfinite(float(lam)):
        raise ValueError(f"lam must be finite, got {lam!r}")
    out_dtype = torch.promote_types(float_dtype_of(rewards), float_dtype_of(costs))
    lam64 = lam.to(torch.float64) if isinstance(lam, torch.Tensor) else float(lam)
    return (rewards.to(torch.float64) - lam64 * costs.to(torch.float64)).to(out_dtype)
