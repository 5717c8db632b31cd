"""The dual (lambda) step of LACONIC: projected gradient ascent on the Lagrange multiplier.

``lambda <- clip(lambda + eta * (mean_L / B - 1), floor, Lambda)``   (controller ``integral``, the paper)

Controller ``pid`` (PID Lagrangian, Stooke, Achiam and Abbeel 2020, Algorithm 2) on the same error
``e_t = mean_L_t / B - 1``, with ``ki = eta``:

``I_t = clip(I_{t-1} + ki * e_t, floor, Lambda)`` (held when lambda sits at a clip and e_t pushes further into it),
``lambda_t = clip(I_t + kp * e_t + kd * (e_t - e_{t-1}), floor, Lambda)``, ``I_0 = lambda_init``, and the
derivative term is 0 at the first step. The integral term I is kept in lambda units so that ``kp = kd = 0``
gives the integral controller bit for bit. Anti-windup: clipping I into [floor, Lambda] is Stooke et al.'s
``I <- (I + Delta)_+`` with the ceiling added; holding I while lambda is saturated (conditional integration)
stops the P and D terms from winding I up against a clip. Unlike Stooke et al.'s one-sided derivative
``(J_C - J_C,prev)_+``, the derivative is two-sided: a length that falls fast lowers lambda before it
undershoots B.

A lower bound (``bound="lower"``, the band constraint's lambda_lo, :class:`~laconic_nemo.core.band.LowerBound`)
has the error of the other sign, ``e = 1 - mean_L / B``: ``lambda <- clip(lambda + eta * (1 - mean_L / B), floor,
Lambda)`` rises while the mean length is BELOW its bound B.

The initial lambda is used as given: it may lie below the floor (the authors' scripts start at
``lambda_len_init = 0`` with ``lambda_floor = 1e-5``); the first dual step clips it into [floor, Lambda].

All arithmetic is in Python floats (IEEE float64) in a fixed order, so every data-parallel rank that
feeds the same all-reduced mean length gets the same lambda bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["BOUNDS", "CONTROLLERS", "DualController", "DualSettingError", "DualSettings", "check_dual", "default_ceiling", "dual_state_problem",
           "load_shaper_state", "next_lambda", "shaper_problem", "shaper_state"]

CONTROLLERS = ("integral", "pid")
BOUNDS = ("upper", "lower")  # the constraint mean_L <= B (the paper's) or mean_L >= B (a band's lower bound)
# the settings among a controller's saved state (DualController.state_dict), in its order
STATE_SETTINGS = ("budget", "eta", "ceiling", "floor", "controller", "kp", "kd")


class DualSettingError(ValueError):
    """A controller setting out of range: ``key`` (the argument), ``value`` and the ``allowed`` range."""

    def __init__(self, key: str, value: Any, allowed: str):
        super().__init__(f"{key} must be {allowed}, got {value!r}")
        self.key, self.value, self.allowed = key, value, allowed


def _finite(key: str, value: Any, allowed: str, low: float | None = None) -> float:
    try:
        v = math.nan if isinstance(value, (bool, str)) else float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not math.isfinite(v) or (low is not None and v < low):
        raise DualSettingError(key, value, allowed)
    return v


def default_ceiling(budget: float, max_length: float) -> float:
    """The paper's default ceiling ``Lambda = B / (L_max - B)``.

    With 0/1 rewards, a correct response of length L_max has Lagrangian reward
    ``1 - lambda * (L_max - B) / B``, which stays >= 0 (the reward of an incorrect response inside the
    budget) exactly when ``lambda <= B / (L_max - B)``. Requires ``L_max > B`` (:func:`check_dual`).
    """
    if not max_length > budget:
        raise DualSettingError("max_length", max_length, f"> budget = {budget!r} (the default ceiling B / (L_max - B) "
                                                         "needs L_max > B)")
    return budget / (max_length - budget)


def check_dual(budget: float, eta: float, ceiling: float | None, floor: float, init: float, controller: str,
               kp: float, kd: float, max_length: float | None) -> float:
    """Check the controller's settings (the config boundary calls it too); return the ceiling Lambda (inf: none).

    Raises :class:`DualSettingError` naming the argument and its allowed range."""
    if _finite("budget", budget, "a finite number > 0 (tokens)") <= 0:
        raise DualSettingError("budget", budget, "a finite number > 0 (tokens)")
    if controller not in CONTROLLERS:
        raise DualSettingError("controller", controller, f"one of {', '.join(CONTROLLERS)}")
    for key, v in (("kp", kp), ("kd", kd)):
        _finite(key, v, "a finite number >= 0", low=0.0)
        if v != 0 and controller == "integral":
            raise DualSettingError(key, v, "0 unless controller = 'pid' (the integral controller has only eta)")
    _finite("eta", eta, "a finite number >= 0", low=0.0)
    _finite("floor", floor, "a finite number >= 0", low=0.0)
    if max_length is not None:
        _finite("max_length", max_length, f"a finite number of tokens > budget = {budget!r}")
    if ceiling is None:
        ceiling = default_ceiling(budget, max_length) if max_length is not None else math.inf
    else:
        _finite("ceiling", ceiling, "a finite number >= floor")
        if ceiling < floor:
            raise DualSettingError("ceiling", ceiling, f">= floor = {floor!r}")
    _finite("init", init, f"a finite number in [0, ceiling] = [0, {ceiling!r}]")
    if not 0.0 <= init <= ceiling:
        raise DualSettingError("init", init, f"in [0, ceiling] = [0, {ceiling!r}] (below floor = {floor!r} is "
                                             "allowed: the first update clips it)")
    return float(ceiling)


@dataclass(frozen=True)
class DualSettings:
    """The settings of a Lagrange multiplier's controller, named as the recipe's ``laconic:`` keys: the one place
    they are spelled out. The config hands them over (``LaconicConfig.dual``), the shapers build lambda's controller
    from them (:func:`~laconic_nemo.core.shapers.lambda_controller`), the budget classes one controller per class,
    and the framework plug-ins' settings are a subclass (``integrations.common.LaconicSettings``).

    budget: B > 0 (tokens). eta: the dual step >= 0. ceiling: Lambda (None: ``B / (max_length - B)`` when
    max_length is given, else no upper clip). max_length: L_max. lambda_init: the initial lambda. floor: the lower
    clip. controller: ``integral`` or ``pid`` with the gains kp, kd (:class:`DualController`)."""

    budget: float
    eta: float
    ceiling: float | None = None
    max_length: float | None = None
    lambda_init: float = 0.0
    floor: float = 0.0
    controller: str = "integral"
    kp: float = 0.0
    kd: float = 0.0

    @classmethod
    def of(cls, section: Any, max_length: float | None) -> "DualSettings":
        """The controller settings of ``section`` (the ``laconic:`` section, or any object with these names) with
        L_max = ``max_length``."""
        names = [f.name for f in dataclasses.fields(DualSettings) if f.name != "max_length"]
        return DualSettings(**{n: getattr(section, n) for n in names}, max_length=max_length)

    def check(self) -> float:
        """:func:`check_dual` of these settings: the ceiling Lambda (inf: none), or :class:`DualSettingError`."""
        return check_dual(self.budget, self.eta, self.ceiling, self.floor, self.lambda_init, self.controller, self.kp,
                          self.kd, self.max_length)

    def build(self) -> "DualController":
        """A fresh controller with these settings (lambda = lambda_init)."""
        return DualController(self.budget, self.eta, ceiling=self.ceiling, max_length=self.max_length,
                              init=self.lambda_init, floor=self.floor, controller=self.controller, kp=self.kp,
                              kd=self.kd)


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
        controller: ``integral`` (the paper's step) or ``pid`` (module docstring); eta is the integral gain ki.
        kp: proportional gain >= 0 (pid only; lambda per unit of relative error mean_L / B - 1).
        kd: derivative gain >= 0 (pid only).
        bound: ``upper`` (the constraint mean_L <= B, error ``mean_L / B - 1``) or ``lower`` (mean_L >= B, error
            ``1 - mean_L / B``: lambda rises while the length is below B).
    """

    def __init__(
        self,
        budget: float,
        eta: float,
        ceiling: float | None = None,
        max_length: int | None = None,
        init: float = 0.0,
        floor: float = 0.0,
        controller: str = "integral",
        kp: float = 0.0,
        kd: float = 0.0,
        bound: str = "upper",
    ) -> None:
        self.ceiling = check_dual(budget, eta, ceiling, floor, init, controller, kp, kd, max_length)
        if bound not in BOUNDS:
            raise DualSettingError("bound", bound, f"one of {', '.join(BOUNDS)}")
        self.bound = bound
        self.budget, self.eta, self.floor = float(budget), float(eta), float(floor)
        self.controller, self.kp, self.kd = controller, float(kp), float(kd)
        self.max_length = None if max_length is None else float(max_length)
        init_v = float(init)
        self._lam = init_v
        self.num_updates = 0
        self._integral = init_v          # pid: the integral term I, in lambda units
        self._prev_error: float | None = None  # pid: e_{t-1}; None before the first update

    @property
    def value(self) -> float:
        """The current lambda (a Python float)."""
        return self._lam

    def error(self, mean_length: float) -> float:
        """The constraint's error: ``mean_L / B - 1`` (upper bound), ``1 - mean_L / B`` (lower bound)."""
        ml = _finite("mean_length", mean_length, "a finite number of tokens >= 0", low=0.0)
        return ml / self.budget - 1.0 if self.bound == "upper" else 1.0 - ml / self.budget

    def step_size(self, mean_length: float) -> float:
        """The unclipped increment ``eta * e`` for a given mean length (e: :meth:`error`)."""
        return self.eta * self.error(mean_length)

    def update(self, mean_length: float) -> float:
        """Apply one dual step with the mean response length of the WHOLE global batch; return the new lambda.

        ``lambda <- min(max(lambda + eta * (mean_L / B - 1), floor), ceiling)``.
        """
        if self.controller == "pid":
            return self._pid_update(mean_length)
        lam = self._lam + self.step_size(mean_length)
        self._lam = min(max(lam, self.floor), self.ceiling)
        self.num_updates += 1
        return self._lam

    def _pid_update(self, mean_length: float) -> float:
        err = self.error(mean_length)
        deriv = 0.0 if self._prev_error is None else err - self._prev_error
        lam_prev = self._lam
        if (lam_prev >= self.ceiling and err > 0.0) or (lam_prev <= self.floor and err < 0.0):
            integral = min(max(self._integral, self.floor), self.ceiling)  # held (conditional integration)
        else:
            integral = min(max(self._integral + self.eta * err, self.floor), self.ceiling)
        lam = integral + self.kp * err + self.kd * deriv
        self._integral = integral
        self._prev_error = err
        self._lam = min(max(lam, self.floor), self.ceiling)
        self.num_updates += 1
        return self._lam

    @property
    def integral(self) -> float:
        """The integral term I of the pid controller (equals lambda for the integral controller)."""
        return self._integral if self.controller == "pid" else self._lam

    def state_dict(self) -> dict[str, Any]:
        """Plain Python scalars (floats round-trip exactly through pickle, torch.save and json).

        An infinite ceiling (no upper clip) is stored as None. The pid controller adds its integral term and
        previous error (None before the first update).
        """
        state = {
            "lam": self._lam,
            "budget": self.budget,
            "eta": self.eta,
            "ceiling": None if math.isinf(self.ceiling) else self.ceiling,
            "floor": self.floor,
            "num_updates": self.num_updates,
            "controller": self.controller,
            "kp": self.kp,
            "kd": self.kd,
        }
        if self.controller == "pid":
            state.update(integral=self._integral, prev_error=self._prev_error)
        if self.bound != "upper":  # an upper bound's state is the one saved before lower bounds existed
            state["bound"] = self.bound
        return state

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore lambda (bit for bit) and the update count.

        With ``strict=True`` (default) a saved budget / eta / ceiling / floor that differs from this
        controller's raises ValueError naming the key. With ``strict=False`` the current settings are
        kept and the restored lambda is clipped into [floor, ceiling]. A state saved before the first update
        (``num_updates == 0``) may hold an initial lambda in [0, floor). A state without ``controller`` (saved
        before the pid controller existed) is an integral controller's with kp = kd = 0.
        """
        problem = dual_state_problem(state)
        if problem is not None:
            key, value, allowed = problem
            raise ValueError(f"dual state_dict key {key!r} = {value!r} is invalid: allowed {allowed}")
        state = {"controller": "integral", "kp": 0.0, "kd": 0.0, "bound": "upper", **state}
        if state["bound"] != self.bound:  # never carried over: the multiplier prices the other side
            raise ValueError(f"dual state mismatch on 'bound': checkpoint has {state['bound']!r}, this run has "
                             f"{self.bound!r}")
        lam = float(state["lam"])
        if strict:
            mine = self.state_dict()
            if state["controller"] != self.controller:
                raise ValueError(f"dual state mismatch on 'controller': checkpoint has {state['controller']!r}, this "
                                 f"run has {self.controller!r}")
            for key in (k for k in STATE_SETTINGS if k != "controller"):  # the controller: just above
                saved = state[key]
                if (saved is None) != (mine[key] is None) or (saved is not None and float(saved) != mine[key]):
                    raise ValueError(f"dual state mismatch on {key!r}: checkpoint has {saved!r}, this run has "
                                     f"{mine[key]!r} (to keep this run's settings, name the laconic key in "
                                     "checkpoint.resume_allow_changes)")
            self._lam = lam  # inside [floor, ceiling], the saved ones and so this run's (dual_state_problem)
        else:
            self._lam = min(max(lam, self.floor), self.ceiling)
        self.num_updates = int(state.get("num_updates", 0))
        if self.controller == "pid":
            if state["controller"] == "pid":
                self._integral = float(state["integral"])
                prev = state["prev_error"]
                self._prev_error = None if prev is None else float(prev)
            else:  # switching from an integral checkpoint (strict=False): lambda seeds the integral term
                self._integral, self._prev_error = self._lam, None
            if not strict:
                self._integral = min(max(self._integral, self.floor), self.ceiling)

    def __repr__(self) -> str:
        return (f"DualController(lam={self._lam!r}, budget={self.budget!r}, eta={self.eta!r}, "
                f"ceiling={self.ceiling!r}, floor={self.floor!r}, controller={self.controller!r}, kp={self.kp!r}, "
                f"kd={self.kd!r}, bound={self.bound!r})")


_MISSING = object()


def dual_state_problem(state: Any) -> tuple[str, Any, str] | None:
    """What is wrong with a saved controller state (:meth:`DualController.state_dict`, read back from a checkpoint):
    ``(key, value, allowed)`` for the first key that is missing or holds a value of the wrong type or range
    (``value`` is the string ``"(missing)"`` for a missing key; key ``""``: the state itself), or None.

    Only the state's own values are checked (a number where a number belongs, finite, in range); whether they
    match a controller's settings is :meth:`DualController.load_state_dict`'s business."""
    if not isinstance(state, Mapping):
        return "", state, "a mapping of the controller's state (lam, budget, eta, ceiling, floor, ...)"

    def number(key: str, allowed: str, low: float | None = None, positive: bool = False, optional: bool = False):
        value = state.get(key, _MISSING)
        if value is _MISSING:
            return None if optional else (key, "(missing)", allowed)
        try:
            v = _finite(key, value, allowed, low=low)
        except DualSettingError:
            return key, value, allowed
        return (key, value, allowed) if positive and v <= 0 else None

    problem = (number("lam", "a finite number")
               or number("budget", "a finite number > 0", positive=True)
               or number("eta", "a finite number >= 0", low=0.0)
               or number("floor", "a finite number >= 0", low=0.0)
               or (None if state.get("ceiling", _MISSING) is None else
                   number("ceiling", "a finite number >= 0, or null (no upper clip)", low=0.0))
               or number("kp", "a finite number >= 0", low=0.0, optional=True)
               or number("kd", "a finite number >= 0", low=0.0, optional=True))
    if problem is not None:
        return problem
    n = state.get("num_updates", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        return "num_updates", n, "an integer >= 0"
    if state.get("bound", "upper") not in BOUNDS:
        return "bound", state["bound"], f"one of {', '.join(BOUNDS)}"
    controller = state.get("controller", "integral")
    if controller not in CONTROLLERS:
        return "controller", controller, f"one of {', '.join(CONTROLLERS)}"
    if controller == "pid":
        problem = number("integral", "a finite number")
        if problem is None and state.get("prev_error", _MISSING) is not None:
            problem = number("prev_error", "a finite number, or null before the first update")
        if problem is not None:
            return problem
    return _range_problem(state, n, controller)


def _range_problem(state: Mapping[str, Any], num_updates: int, controller: str) -> tuple[str, Any, str] | None:
    """A multiplier of a saved controller state outside the range its own settings allow (every update clips it into
    [floor, ceiling]; before the first update lambda may lie in [0, floor), :class:`DualController`): lam, and the pid
    controller's integral term. The numbers are already checked to be finite."""
    floor, ceiling = float(state["floor"]), state.get("ceiling")
    top = math.inf if ceiling is None else float(ceiling)
    if top < floor:
        return "ceiling", ceiling, f"a finite number >= floor = {floor!r}, or null (no upper clip)"
    low = 0.0 if num_updates == 0 else floor
    for key in ("lam", "integral") if controller == "pid" else ("lam",):
        v = float(state[key])
        if not low <= v <= top:
            if num_updates:
                return key, state[key], (f"a number in [floor, ceiling] = [{low!r}, {top!r}] (the state's own floor "
                                         "and ceiling: every dual step clips it into them)")
            return key, state[key], (f"a number in [0, ceiling] = [0.0, {top!r}] (the state's own ceiling; before its "
                                     f"first update it may lie below floor = {floor!r})")
    return None


def shaper_problem(state: Any) -> tuple[str, Any, str] | None:
    """What is wrong with a saved :func:`shaper_state`: ``(key, value, allowed)`` with the key relative to the shaper
    entry (``dual.lam``), or None (as :func:`dual_state_problem`)."""
    if not isinstance(state, Mapping):
        return "", state, "a mapping with the shaper's name (and its controller's state)"
    if not isinstance(state.get("shaper"), str):
        return "shaper", state.get("shaper", "(missing)"), "the shaper's name"
    if "dual" in state:
        problem = dual_state_problem(state["dual"])
        if problem is not None:
            return (f"dual.{problem[0]}" if problem[0] else "dual"), problem[1], problem[2]
    return None


def next_lambda(dual: DualController | None, lam: float, global_mean_length: float) -> float:
    """The trainer's dual step: ``dual.update(mean_L)``, or the constant ``lam`` of a shaper without a controller.

    ``global_mean_length``: the mean response length over the WHOLE global batch (finite, >= 0)."""
    _finite("global_mean_length", global_mean_length, "a finite number of tokens >= 0", low=0.0)
    return lam if dual is None else dual.update(global_mean_length)


def shaper_state(shaper: str, dual: DualController | None) -> dict[str, Any]:
    """The ``shaper`` entry of trainer_state.json: the shaper's name and, with a controller, its state."""
    return {"shaper": shaper} if dual is None else {"shaper": shaper, "dual": dual.state_dict()}


def load_shaper_state(shaper: str, dual: DualController | None, state: Mapping[str, Any], strict: bool = True) -> None:
    """Restore :func:`shaper_state` into ``dual``; the saved shaper must be this run's."""
    if state.get("shaper") != shaper:
        raise ValueError(f"shaper state mismatch on 'shaper': checkpoint has {state.get('shaper')!r}, this run has "
                         f"{shaper!r}")
    if dual is not None:
        if "dual" not in state:
            raise ValueError(f"shaper state for {shaper!r} is missing key 'dual'")
        dual.load_state_dict(state["dual"], strict=strict)
