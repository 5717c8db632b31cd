"""What the framework plug-ins share: the LACONIC settings, the Lagrangian reward of one batch and the Lagrange
multipliers with their checkpoint format.

This is the one module of :mod:`laconic_nemo.integrations` that imports :mod:`laconic_nemo.core`; the TRL, verl and
NeMo-RL adapters call the formulas only through :class:`LaconicState`, so none of them spells out a cost, a reward
or a dual step.

State format (what each framework's checkpoint holds, JSON-safe plain scalars)::

    {"format": "laconic-multipliers/1",
     "multipliers": {"length": DualController.state_dict()}}

``multipliers`` is keyed by constraint name: ``length`` (the paper's lambda on the mean response length) and, with
the band (``band`` = rho, :mod:`laconic_nemo.core.band`), ``length_lo``, the lower bound's lambda_lo on the same
mean length (``B_lo = rho B``; a lower-bound controller, its state's ``bound`` is ``lower``). A constraint added
later is one more key: a checkpoint that holds fewer multipliers than the run restores
those it holds and leaves the others at their initial value, so adding a constraint never breaks resume.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from laconic_nemo.core import SHAPERS, Band, DualController, lambda_controller, shape
from laconic_nemo.core.dual import DualSettingError, DualSettings

__all__ = ["BAND_METRICS", "LENGTH", "LENGTH_LO", "STATE_FORMAT", "LaconicSettings", "LaconicState", "dual_shapers"]

STATE_FORMAT = "laconic-multipliers/1"
LENGTH = "length"  # the multiplier of the mean-length constraint (the paper's lambda)
LENGTH_LO = "length_lo"  # the band's lower bound on the mean length (lambda_lo)
BAND_METRICS = ("lambda_lo", "mean_band_penalty")  # the batch metrics the band adds (LaconicState.lagrangian_reward)


def dual_shapers() -> tuple[str, ...]:
    """The registered shapers whose lambda comes from the dual step (``laconic``, ``linear``): the ones a plug-in
    offers. The others either have no multiplier or need the whole group at once (``efficient``)."""
    return tuple(name for name, fn in SHAPERS.items() if fn.lam == "dual")


@dataclass(frozen=True)
class LaconicSettings(DualSettings):
    """The LACONIC settings of a plug-in, named as the ``laconic:`` keys of a recipe (docs/algorithm.md): the
    controller's (:class:`~laconic_nemo.core.dual.DualSettings`: budget B in tokens, eta, ceiling Lambda (None:
    B / (max_length - B) when max_length is given, else no upper clip), max_length L_max (a response of that length
    counts as truncated), lambda_init, floor, controller / kp / kd: ``integral`` (the paper) or ``pid``) and the
    shaper's: shaper ``laconic`` (clipped cost) or ``linear`` (the cost ablation), penalty_cap / hit_cap (the
    authors' code knobs) and the band's (:class:`~laconic_nemo.core.band.Band`): band (rho: a lower bound
    ``B_lo = rho B`` on the mean length beside B, with its own multiplier; None: the paper's one-sided constraint),
    band_eta (None: eta) and band_ceiling (None: the ceiling Lambda).
    """

    shaper: str = "laconic"
    penalty_cap: float | None = None
    hit_cap: float = 0.0
    band: float | None = None
    band_eta: float | None = None
    band_ceiling: float | None = None

    def __post_init__(self) -> None:
        allowed = dual_shapers()
        if self.shaper not in allowed:
            raise ValueError(f"laconic.shaper must be one of {', '.join(allowed)} (the shapers with a dual step), "
                             f"got {self.shaper!r}")
        if self.penalty_cap is not None and not (isinstance(self.penalty_cap, (int, float)) and self.penalty_cap > 0):
            raise ValueError(f"laconic.penalty_cap must be a number > 0 or null, got {self.penalty_cap!r}")
        if isinstance(self.hit_cap, bool) or not isinstance(self.hit_cap, (int, float)) or not self.hit_cap >= 0:
            raise ValueError(f"laconic.hit_cap must be a number >= 0, got {self.hit_cap!r}")
        Band.of(self)  # ValueError naming laconic.band / band_eta / band_ceiling
        try:
            self.controller_for()
        except DualSettingError as e:  # names the controller's argument; say which settings key it is
            key = {"init": "lambda_init"}.get(e.key, e.key)
            raise ValueError(f"laconic.{key} must be {e.allowed}, got {e.value!r}") from None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "laconic") -> LaconicSettings:
        """Build from a config section (a dict, an OmegaConf node); an unknown key is refused by name."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown config key '{where}.{unknown[0]}' (known keys here: {', '.join(known)})")
        for key in ("budget", "eta"):
            if key not in values:
                raise ValueError(f"config key '{where}.{key}' is required")
        try:
            return cls(**{k: values[k] for k in known if k in values})
        except ValueError as e:  # the checks name laconic.<key>: name the section the values came from
            message = str(e)
            raise ValueError(where + message[len("laconic"):] if message.startswith("laconic.") else message) from None

    def controller_for(self) -> DualController:
        """A fresh controller of the length multiplier (checks every setting)."""
        return lambda_controller(self, self.max_length)


class LaconicState:
    """The Lagrange multipliers of one run and the Lagrangian reward they price.

    Every process of a data-parallel run holds one; fed the same global mean length, they stay equal bit for bit
    (the dual step is float64 Python arithmetic in a fixed order, core/dual.py).
    """

    def __init__(self, settings: LaconicSettings):
        self.settings = settings
        length = settings.controller_for()
        self.multipliers: dict[str, DualController] = {LENGTH: length}
        band = Band.of(settings)
        self.band = None if band is None else band.lower(length.eta, length.ceiling)  # lambda_lo, or None
        if self.band is not None:
            self.multipliers[LENGTH_LO] = self.band.dual

    @property
    def lam(self) -> float:
        """The current lambda of the length constraint."""
        return self.multipliers[LENGTH].value

    @property
    def num_steps(self) -> int:
        """Dual steps taken so far (restored with the state)."""
        return self.multipliers[LENGTH].num_updates

    def lagrangian_reward(self, rewards: torch.Tensor | Sequence[float], lengths: torch.Tensor | Sequence[int],
                          truncated: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """``r - min(lambda * c(L), penalty_cap) - hit_cap * 1[truncated]`` with the current lambda (with the band,
        minus ``lambda_lo max((B_lo - L) / B_lo, 0)`` too).

        Args:
            rewards: [N] task rewards r. lengths: [N] response lengths L in tokens.
            truncated: [N] bool, True where the response hit L_max; None = ``L >= max_length``.

        Returns:
            float64 tensor [N] and the shaper's batch metrics (Python floats: mean_length, frac_over_budget,
            mean_cost, mean_penalty, ..., with the band :data:`BAND_METRICS`: lambda_lo and mean_band_penalty)
            over these N responses.
        """
        r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1, 1)
        L = torch.as_tensor(lengths).reshape(-1, 1)
        # The Lagrangian shapers price each response alone; the group enters only the framework's advantage,
        # so the batch is handed over as N groups of one ([N, 1]).
        trunc = None if truncated is None else torch.as_tensor(truncated).reshape(-1, 1)
        s = self.settings
        band = None if self.band is None else self.band.value * self.band.cost64(L.to(torch.float64), s.budget)
        shaped, metrics = shape(s, r, L, self.lam, truncated=trunc, band_penalty=band,
                                max_length=None if s.max_length is None else float(s.max_length))
        if self.band is not None:
            metrics["lambda_lo"] = self.band.value
        return shaped.view(-1), metrics

    def dual_step(self, global_mean_length: float) -> float:
        """One dual step of every multiplier with the mean response length of the WHOLE global batch (the band's
        lambda_lo on ``mean_L / B``); the new lambda."""
        if isinstance(global_mean_length, bool) or not math.isfinite(float(global_mean_length)):
            raise ValueError(f"global_mean_length must be a finite number of tokens, got {global_mean_length!r}")
        if self.band is not None:
            self.band.update(float(global_mean_length) / float(self.settings.budget))
        return self.multipliers[LENGTH].update(float(global_mean_length))

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state (module docstring)."""
        return {"format": STATE_FORMAT, "multipliers": {k: c.state_dict() for k, c in self.multipliers.items()}}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> list[str]:
        """Restore the multipliers this run has from ``state``; return the names restored.

        A multiplier of this run that ``state`` lacks keeps its initial value (a constraint added after that
        checkpoint). With ``strict`` a multiplier of ``state`` that this run does not define, or a controller
        setting that differs (budget, eta, ceiling, floor, gains), raises ValueError naming it; without, the
        unknown multiplier is ignored and the restored lambda is clipped into this run's [floor, ceiling].
        """
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"not a LACONIC multiplier state: format {found!r}, expected {STATE_FORMAT!r}")
        saved = state.get("multipliers")
        if not isinstance(saved, Mapping):
            raise ValueError("LACONIC multiplier state is missing key 'multipliers'")
        extra = sorted(set(saved) - set(self.multipliers))
        if extra and strict:
            raise ValueError(f"checkpoint holds multiplier {extra[0]!r} that this run does not define (this run: "
                             f"{', '.join(self.multipliers)})")
        restored = []
        for name, controller in self.multipliers.items():
            if name in saved:
                try:
                    controller.load_state_dict(saved[name], strict=strict)
                except ValueError as e:  # the core's hint names the project's own resume key: not this one
                    reason = str(e).split(" (to keep this run's settings")[0]
                    raise ValueError(f"multiplier {name!r}: {reason} (to keep this run's settings, restore with "
                                     "strict=False)") from None
                restored.append(name)
        return restored
