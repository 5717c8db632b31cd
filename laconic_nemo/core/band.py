"""The band constraint: a budget the policy uses, not only respects (docs/algorithm.md, "The band").

The paper's constraint is one-sided: a class whose length sits below its budget B is slack, its multiplier falls
to 0 and nothing asks the policy to spend the budget it was granted. The band adds, per budget class, a lower
bound ``B_lo = rho B`` (``laconic.band`` = rho in (0, 1)) beside the upper bound B, each with its own multiplier
moved by the same projected dual step from the class's GLOBAL length ratio ``x = (1 / n) sum_i L_i / B_i`` (all
its responses of the global batch; ``mean_L / B`` for a class of one budget):

``lambda_hi <- clip(lambda_hi + eta (x - 1), floor, Lambda)``            (the class's multiplier, as without band)

``lambda_lo <- clip(lambda_lo + eta_lo (1 - x / rho), 0, Lambda_lo)``   (``= eta_lo (1 - mean_L / B_lo)``)

and response i of the class is rewarded

``l_i = r_i - lambda_hi max((L_i - B_i) / B_i, 0) - lambda_lo max((B_lo,i - L_i) / B_lo,i, 0)``.

Inside the band (``rho <= x <= 1``) both errors are negative and both multipliers fall to 0. eta_lo and
Lambda_lo default to the class's own eta and Lambda (``laconic.band_eta``, ``laconic.band_ceiling``: null); the
lower cost is at most 1 (at L = 0), so ``Lambda_lo <= 1`` keeps a correct response of any length worth at least
an incorrect one inside the band under 0/1 rewards, as the paper's Lambda does for the upper cost.

A run without per-prompt budgets has one class, its budget ``laconic.budget``: its lambda_lo reads the global
mean length. :class:`Band` holds the settings, :class:`LowerBound` one class's lambda_lo; the budget classes
(:class:`~laconic_nemo.core.constraints.BudgetClasses`) hold one per class and save it under the class's key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from laconic_nemo.core.costs import band_cost64
from laconic_nemo.core.dual import DualController, DualSettingError, dual_state_problem

__all__ = ["Band", "LowerBound", "band_state_problem"]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Band:
    """The band's settings: rho (``B_lo = rho B``, in (0, 1)), eta_lo (None: the class's eta) and Lambda_lo (None:
    the class's Lambda). Raises ValueError naming the ``laconic.band*`` key."""

    rho: float
    eta: float | None = None
    ceiling: float | None = None

    def __post_init__(self) -> None:
        if not (_number(self.rho) and 0.0 < self.rho < 1.0):
            raise ValueError(f"laconic.band must be a number in (0, 1) (B_lo = band * B) or null, got {self.rho!r}")
        for key, v in (("band_eta", self.eta), ("band_ceiling", self.ceiling)):
            if v is not None and not (_number(v) and v >= 0):
                raise ValueError(f"laconic.{key} must be a finite number >= 0 or null, got {v!r}")

    @classmethod
    def of(cls, section: Any) -> "Band | None":
        """The band of a ``laconic:`` section (``band``, ``band_eta``, ``band_ceiling``), None where band is null."""
        rho = getattr(section, "band", None)
        if rho is None:
            return None
        return cls(rho, getattr(section, "band_eta", None), getattr(section, "band_ceiling", None))

    def lower(self, eta: float, ceiling: float | None) -> "LowerBound":
        """One class's lower bound, eta_lo and Lambda_lo defaulting to ``eta`` and ``ceiling`` (the class's; None
        or inf: no upper clip)."""
        lam_ceiling = self.ceiling if self.ceiling is not None else ceiling
        if lam_ceiling is not None and math.isinf(lam_ceiling):
            lam_ceiling = None
        return LowerBound(self.rho, self.eta if self.eta is not None else eta, lam_ceiling)


class LowerBound:
    """The lower bound of one budget class: rho, and lambda_lo with its dual step on the class's length ratio x,
    ``lambda_lo <- clip(lambda_lo + eta (1 - x / rho), 0, ceiling)`` (a lower-bound
    :class:`~laconic_nemo.core.dual.DualController` whose bound is rho and which reads x)."""

    def __init__(self, rho: float, eta: float, ceiling: float | None):
        self.rho = float(rho)
        try:
            self.dual = DualController(self.rho, eta, ceiling=ceiling, floor=0.0, init=0.0, bound="lower")
        except DualSettingError as exc:
            key = {"eta": "band_eta", "ceiling": "band_ceiling"}.get(exc.key, exc.key)
            raise ValueError(f"laconic.{key} must be {exc.allowed}, got {exc.value!r}") from None

    @property
    def value(self) -> float:
        """lambda_lo of the next step."""
        return self.dual.value

    @property
    def ceiling(self) -> float:
        return self.dual.ceiling

    @property
    def eta(self) -> float:
        return self.dual.eta

    def cost64(self, lengths64: torch.Tensor, budgets64: torch.Tensor | float) -> torch.Tensor:
        """[...] float64 ``max((B_lo - L) / B_lo, 0)`` with ``B_lo = rho B`` (budgets: [...] or one number)."""
        return band_cost64(lengths64, self.rho * budgets64)

    def update(self, ratio: float) -> float:
        """The dual step on the class's global length ratio x (``mean_L / B``); returns lambda_lo."""
        return self.dual.update(ratio)

    def state_dict(self) -> dict[str, Any]:
        return {"rho": self.rho, "dual": self.dual.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore lambda_lo; with ``strict`` a saved rho, eta or ceiling other than this run's is a ValueError
        naming it (without: this run's settings are kept and lambda_lo clipped into them)."""
        problem = band_state_problem(state)
        if problem is not None:
            key, value, allowed = problem
            raise ValueError(f"band state key {key or '(the state)'} = {value!r} is invalid: allowed {allowed}")
        if strict and float(state["rho"]) != self.rho:
            raise ValueError(f"band state mismatch on 'rho' (laconic.band): checkpoint has {state['rho']!r}, this run "
                             f"has {self.rho!r}")
        saved = dict(state["dual"])
        if not strict:  # the controller's bound is rho: a band of another rho carries lambda_lo over
            saved["budget"] = self.rho
        self.dual.load_state_dict(saved, strict=strict)


def band_state_problem(state: Any) -> tuple[str, Any, str] | None:
    """What is wrong with a saved :meth:`LowerBound.state_dict`: ``(key, value, allowed)``, or None."""
    if not isinstance(state, Mapping):
        return "", state, "a mapping {rho, dual}"
    rho = state.get("rho", "(missing)")
    if not (_number(rho) and 0.0 < rho < 1.0):
        return "rho", rho, "a number in (0, 1)"
    dual = state.get("dual")
    problem = dual_state_problem(dual)
    if problem is not None:
        return (f"dual.{problem[0]}" if problem[0] else "dual"), problem[1], problem[2]
    if dual.get("bound") != "lower":
        return "dual.bound", dual.get("bound", "(missing)"), "'lower' (the band's multiplier prices the lower bound)"
    return None
