"""Group-normalised advantages of GRPO (step 5 of LACONIC), on rewards grouped [P, G] (prompts x group)."""

from __future__ import annotations

import math

import torch

from laconic_nemo.core.costs import float_dtype_of

__all__ = ["group_advantages", "as_groups", "ADVANTAGE_STD"]

# How the group's spread is measured: the population std (divide by G) or the unbiased sample std
# (divide by G - 1, ``torch.std``'s default, used by EasyR1 / veRL's GRPO and so by the authors' runs).
ADVANTAGE_STD = ("unbiased", "population")


def as_groups(values: torch.Tensor | list | tuple, group_size: int) -> torch.Tensor:
    """A flat batch [P * G] (each prompt's G responses contiguous) as its groups [P, G] (a view where possible).

    The one place where a flat layout meets the core's grouped one: ``group_size`` must be an int >= 1 dividing
    the batch."""
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor(values)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if values.dim() != 1:
        raise ValueError(f"values must be a flat tensor [num_prompts * group_size], got shape {tuple(values.shape)}")
    if values.numel() % group_size != 0:
        raise ValueError(f"the number of responses ({values.numel()}) must be divisible by group_size ({group_size}): "
                         "each prompt's G responses must be contiguous")
    return values.view(-1, group_size)


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, leave_one_out: bool = False,
                     std: str = "population") -> torch.Tensor:
    """Per-response advantage ``A_i = (l_i - mean_group(l)) / (std_group(l) + eps)``.

    ``std_group`` is the POPULATION standard deviation of the group (divide by G) with
    ``std="population"``, the unbiased sample standard deviation (divide by G - 1, as ``torch.std``
    in EasyR1's ``compute_grpo_outcome_advantage``) with ``std="unbiased"``; the unbiased form
    makes advantages smaller by ``sqrt((G - 1) / G)`` (eps aside).
    Groups whose members are all equal (zero spread) get exactly ``A = 0``.

    With ``leave_one_out=True`` the baseline of response i is the mean of the OTHER G - 1 members,
    ``A_i = (l_i - mean_{j != i} l_j) / (std_group(l) + eps)``; since ``l_i - mean_{j != i} l_j =
    G / (G - 1) * (l_i - mean_group(l))`` this is the default advantage scaled by ``G / (G - 1)``
    (needs G >= 2).

    Computed in float64; the advantages still sum to zero over each group (up to rounding).

    Args:
        rewards: [P, G] (shaped) rewards, one row per prompt (:func:`as_groups` turns a flat batch into rows).
        eps: >= 0, added to the group std (``grpo.advantage_eps``).
        leave_one_out: use the leave-one-out mean as baseline (``grpo.leave_one_out``).
        std: "population" (divide by G) or "unbiased" (divide by G - 1; needs G >= 2) (``grpo.advantage_std``).

    Returns:
        tensor [P, G] in the input's float dtype (default float dtype for integer input).
    """
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be grouped [P, G] (as_groups of a flat batch), got shape "
                         f"{tuple(rewards.shape)}")
    if rewards.dtype == torch.bool or rewards.is_complex():
        raise ValueError(f"rewards must be a real integer or float tensor, got dtype {rewards.dtype}")
    G = rewards.shape[1]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if std not in ADVANTAGE_STD:
        raise ValueError(f"std (grpo.advantage_std) must be one of {ADVANTAGE_STD}, got {std!r}")
    if std == "unbiased" and G < 2:
        raise ValueError(f"std='unbiased' needs group_size >= 2, got group_size={G}")
    if leave_one_out and G < 2:
        raise ValueError(f"leave_one_out needs group_size >= 2, got group_size={G}")
    out_dtype = float_dtype_of(rewards)
    if rewards.numel() == 0:
        return torch.zeros(rewards.shape, dtype=out_dtype, device=rewards.device)
    r = rewards.detach().to(torch.float64)
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite (found NaN or inf)")
    mean = r.mean(dim=1, keepdim=True)
    centered = r - mean
    dof = G - 1 if std == "unbiased" else G
    spread = (centered.square().sum(dim=1, keepdim=True) / dof).sqrt()
    if leave_one_out:
        centered = centered * (G / (G - 1))
    adv = centered / (spread + eps)
    # Exact zero for groups with no spread (the mean of equal floats can differ from them by rounding).
    flat = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))
    return adv.masked_fill(flat, 0.0).to(out_dtype)
