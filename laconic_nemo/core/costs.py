"""Length costs and the Lagrangian reward of LACONIC, elementwise (any shape: [P, G] in the trainer).

Notation as in the paper: ``L`` is the number of generated tokens of a response (thinking and answer,
EOS excluded; a response truncated at the generation limit counts as ``L_max``, its generated length),
``B`` is the token budget, ``lambda`` the Lagrange multiplier.

The formulas are :func:`linear_cost64` and :func:`clipped_cost64` (float64, no argument checks: the shapers call
them at every step with a budget checked once, at the config boundary); :func:`linear_cost` and
:func:`clipped_cost` are the same formulas for any caller, with the budget checked.
"""

from __future__ import annotations

import math

import torch

__all__ = ["clipped_cost", "linear_cost", "clipped_cost64", "linear_cost64", "lagrangian_reward", "length_penalty",
           "check_budget", "float_dtype_of", "cost_lengths", "per_prompt_cost64", "band_cost64"]


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


def cost_lengths(lengths: torch.Tensor, truncated: torch.Tensor, count_eos: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The lengths L the shaper and the dual step see, and the truncation flags to hand the shaper.

    Paper form (``count_eos=False``): L = generated tokens without EOS, a response cut at L_max counts
    L_max; the flags are the engine's ``truncated``.

    Authors' form (``laconic.count_eos: true``): L counts the EOS token too (EasyR1's response mask,
    ``verl/utils/torch_functional.py::get_response_mask``, keeps the first EOS), so L = lengths + 1 for a
    response that ended on EOS; the flags are None, i.e. the shaper's ``L >= L_max``: as in the authors'
    ``hit_cap`` (``actual_lengths == max_response_length``), a response whose EOS is the L_max-th token
    gets the hit penalty too.

    Args:
        lengths: [...] int, generated tokens without EOS (``GenerationOutput.lengths``).
        truncated: [...] bool, True where the response hit L_max without EOS.
        count_eos: count the EOS token.

    Returns:
        (L [...] int64, truncated [...] bool or None).
    """
    L = _as_lengths(lengths).to(torch.long)
    trunc = torch.as_tensor(truncated).to(torch.bool)
    if trunc.shape != L.shape:
        raise ValueError(f"truncated must have the shape of lengths {tuple(L.shape)}, got {tuple(trunc.shape)}")
    if not count_eos:
        return L, trunc
    return L + (~trunc).to(torch.long), None


def linear_cost64(lengths64: torch.Tensor, budget: float) -> torch.Tensor:
    """``c~ = (L - B) / B`` of float64 lengths [...], in float64 (B > 0: checked where it was read)."""
    return (lengths64 - budget) / budget


def clipped_cost64(lengths64: torch.Tensor, budget: float) -> torch.Tensor:
    """``c = max((L - B) / B, 0)`` of float64 lengths [...], in float64 (B > 0: checked where it was read)."""
    return linear_cost64(lengths64, budget).clamp_min(0.0)


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
    return linear_cost64(lengths.to(torch.float64), b).to(float_dtype_of(lengths))


def lagrangian_reward(rewards: torch.Tensor, costs: torch.Tensor, lam: float | torch.Tensor,
                      penalty_cap: float | None = None, hit_cap: float = 0.0,
                      truncated: torch.Tensor | None = None) -> torch.Tensor:
    """Lagrangian reward ``l = r - min(lambda * c, penalty_cap) - hit_cap * 1[truncated]``, elementwise.

    The paper's form is ``l = r - lambda * c`` (no cap, hit_cap 0); the cap and the hit penalty are the authors'
    code's (docs/algorithm.md).

    Args:
        rewards: tensor [...] of task rewards r ([P, G] in the trainer).
        costs: tensor [...] of costs c (same shape as rewards).
        lam: the multiplier lambda (a float, or a tensor broadcastable to the rewards' shape).
        penalty_cap: cap on the per-response penalty lambda * c; None = no cap.
        hit_cap: extra penalty for the responses flagged in ``truncated`` (bool, the rewards' shape).

    Returns:
        float tensor of the rewards' shape in the promoted floating dtype of rewards and costs.
    """
    rewards, costs = torch.as_tensor(rewards), torch.as_tensor(costs)
    if rewards.shape != costs.shape:
        raise ValueError(f"rewards and costs must have the same shape, got {tuple(rewards.shape)} and "
                         f"{tuple(costs.shape)}")
    if isinstance(lam, (int, float)) and not isinstance(lam, bool) and not math.isfinite(float(lam)):
        raise ValueError(f"lam must be finite, got {lam!r}")
    out_dtype = torch.promote_types(float_dtype_of(rewards), float_dtype_of(costs))
    return (rewards.to(torch.float64) - length_penalty(costs, lam, penalty_cap, hit_cap, truncated)).to(out_dtype)


def length_penalty(costs: torch.Tensor, lam: float | torch.Tensor, penalty_cap: float | None = None,
                   hit_cap: float = 0.0, truncated: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 penalty (the costs' shape) that :func:`lagrangian_reward` subtracts: ``min(lambda * c, cap) + hit_cap * 1[trunc]``."""
    lam64 = lam.to(torch.float64) if isinstance(lam, torch.Tensor) else float(lam)
    penalty = lam64 * costs.to(torch.float64)
    if penalty_cap is not None:
        penalty = penalty.clamp_max(penalty_cap)
    if hit_cap:
        penalty = penalty + hit_cap * truncated.to(torch.float64)
    return penalty


def per_prompt_cost64(lengths64: torch.Tensor, budgets64: torch.Tensor, linear: bool = False) -> torch.Tensor:
    """``c_i = max((L_i - B_i) / B_i, 0)`` (``linear``: without the clip), elementwise in float64 ([...] shapes)."""
    c = (lengths64 - budgets64) / budgets64
    return c if linear else c.clamp_min(0.0)


def band_cost64(lengths64: torch.Tensor, lower64: torch.Tensor | float) -> torch.Tensor:
    """The band's lower cost ``c_lo = max((B_lo - L) / B_lo, 0)``, elementwise in float64 ([...] shapes; ``lower64``
    the lower bounds B_lo > 0, a tensor of the lengths' shape or one number): 0 at or above B_lo, 1 at L = 0."""
    return ((lower64 - lengths64) / lower64).clamp_min(0.0)
