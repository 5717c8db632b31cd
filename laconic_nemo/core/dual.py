"""The dual (lambda) step of LACONIC: projected gradient ascent on the Lagrange multiplier.

``lambda <- clip(lambda + eta * (mean_L / B - 1), floor, Lambda)``

The initial lambda is used as given: it may lie below the floor (the authors' scripts start at
``lambda_len_init = 0`` with ``lambda_floor = 1e-5``); the first dual step clips it into [floor, Lambda].

All arithmetic is in Python floats (IEEE float64) in a fixed order, so every data-parallel rank that
feeds the same all-reduced mean length gets the same lambda bit for bit.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from laconic_nemo.core.costs import check_budget

__all__ = ["DualController", "default_ceiling"]


def _finite(name: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {allowed}, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return v


def default_ceiling(budget: float, max_length: int) -> float:
    """The paper's default ceiling ``Lambda = B / (L_max - B)``.

    With 0/1 rewards, a correct response of length L_max has Lagrangian reward
    ``1 - lambda * (L_max - B) / B``, which stays >= 0 (the reward of an incorrect response inside the
    budget) exactly when ``lambda <= B / (L_max - B)``. Requires ``L_max > B``.
    """
    b = check_budget(budget)
    lmax = _finite("max_length", max_length, "a finite number of tokens > budget")
    if lmax <= b:
        raise ValueError(f"max_length must be > budget (got max_length={max_length!r}, budget={budget!r}): "
                         "the default ceiling B / (L_max - B) needs L_max > B")
    return b / (lmax - b)


class DualController:
    """Lagrange multiplier lambda with the projected dual step of LACONIC.

    Args:
        budget: B > 0, the token budget on the mean response length.
        eta: dual step size >= 0 (0 freezes lambda).
        ceiling: Lambda, the upper clip; None = ``B / (max_length - B)`` when max_length is given,
            otherwise no upper clip.
        max_length: L_max (> B), the generation limit; only used for the default ceiling.
        init: initial lambda, in [0, ceiling]; a value below ``floor`` is kept unclipped until the
            first update, which clips it into [floor, ceiling] (the authors' code starts at 0 with floor 1e-5).
        floor: lower clip of lambda, >= 0 (the paper uses 0, the authors' DeepScaleR script 1e-5).
    """

    def __init__(
        self,
        budget: float,
        eta: float,
        ceiling: float | None = None,
        max_length: int | None = None,
        init: float = 0.0,
        floor: float = 0.0,
    ) -> None:
        self.budget = check_budget(budget)
        self.eta = _finite("eta", eta, "a finite number >= 0")
        if self.eta < 0:
            raise ValueError(f"eta must be a finite number >= 0, got {eta!r}")
        self.floor = _finite("floor", floor, "a finite number >= 0")
        if self.floor < 0:
            raise ValueError(f"floor must be a finite number >= 0, got {floor!r}")
        self.max_length = None
        if max_length is not None:
            lmax = _finite("max_length", max_length, "a finite number of tokens > budget")
            if lmax <= self.budget:
                raise ValueError(f"max_length must be > budget (got max_length={max_length!r}, budget={budget!r})")
            self.max_length = lmax
        if ceiling is None:
            self.ceiling = default_ceiling(self.budget, self.max_length) if self.max_length is not None else math.inf
        else:
            self.ceiling = _finite("ceiling", ceiling, "a finite number >= floor")
        if self.ceiling < self.floor:
            raise ValueError(f"ceiling must be >= floor, got ceiling={self.ceiling!r} and floor={self.floor!r}")
        init_v = _finite("init", init, f"a finite number in [0, ceiling] = [0, {self.ceiling!r}]")
        if not (0.0 <= init_v <= self.ceiling):
            raise ValueError(f"init must be in [0, ceiling] = [0, {self.ceiling!r}] (below floor = {self.floor!r} "
                             f"is allowed: the first update clips it), got {init!r}")
        self._lam = init_v
        self.num_updates = 0

    @property
    def value(self) -> float:
        """The current lambda (a Python float)."""
        return self._lam

    def step_size(self, mean_length: float) -> float:
        """The unclipped increment ``eta * (mean_L / B - 1)`` for a given mean length."""
        ml = _finite("mean_length", mean_length, "a finite number of tokens >= 0")
        if ml < 0:
            raise ValueError(f"mean_length must be a finite number of tokens >= 0, got {mean_length!r}")
        return self.eta * (ml / self.budget - 1.0)

    def update(self, mean_length: float) -> float:
        """Apply one dual step with the mean response length of the WHOLE global batch; return the new lambda.

        ``lambda <- min(max(lambda + eta * (mean_L / B - 1), floor), ceiling)``.
        """
        lam = self._lam + self.step_size(mean_length)
        self._lam = min(max(lam, self.floor), self.ceiling)
        self.num_updates += 1
        return self._lam

    def state_dict(self) -> dict[str, Any]:
        """Plain Python scalars (floats round-trip exactly through pickle, torch.save and json).

        An infinite ceiling (no upper clip) is stored as None.
        """
        return {
            "lam": self._lam,
            "budget": self.budget,
            "eta": self.eta,
            "ceiling": None if math.isinf(self.ceiling) else self.ceiling,
            "floor": self.floor,
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore lambda (bit for bit) and the update count.

        With ``strict=True`` (default) a saved budget / eta / ceiling / floor that differs from this
        controller's raises ValueError naming the key. With ``strict=False`` the current settings are
        kept and the restored lambda is clipped into [floor, ceiling]. A state saved before the first update
        (``num_updates == 0``) may hold an initial lambda in [0, floor).
        """
        for key in ("lam", "budget", "eta", "ceiling", "floor"):
            if key not in state:
                raise ValueError(f"dual state_dict is missing key {key!r}")
        lam = _finite("lam", state["lam"], "a finite number")
        if strict:
            mine = self.state_dict()
            for key in ("budget", "eta", "ceiling", "floor"):
                saved = state[key]
                if (saved is None) != (mine[key] is None) or (saved is not None and float(saved) != mine[key]):
                    raise ValueError(f"dual state mismatch on {key!r}: checkpoint has {saved!r}, this run has "
                                     f"{mine[key]!r} (to keep this run's settings, name the laconic key in "
                                     "checkpoint.resume_allow_changes)")
            low = 0.0 if int(state.get("num_updates", 0)) == 0 else self.floor
            if not (low <= lam <= self.ceiling):
                raise ValueError(f"lam in checkpoint ({lam!r}) is outside [{low!r}, ceiling] = "
                                 f"[{low!r}, {self.ceiling!r}]")
            self._lam = lam
        else:
            self._lam = min(max(lam, self.floor), self.ceiling)
        self.num_updates = int(state.get("num_updates", 0))

    def __repr__(self) -> str:
        return (f"DualController(lam={self._lam!r}, budget={self.budget!r}, eta={self.eta!r}, "
                f"ceiling={self.ceiling!r}, floor={self.floor!r})")
