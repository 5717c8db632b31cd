"""Reward shapers: LACONIC and the baselines of the paper, each a map (task rewards, lengths) -> shaped rewards.

Every shaper is called once per GRPO step on the rollout batch (flat tensors [N], N = num_prompts * G,
each prompt's G responses contiguous) and returns ``(shaped_rewards [N], metrics)``; the trainer then
computes group advantages of the shaped rewards. After the policy step the trainer calls
``shaper.dual_update(global_mean_length)`` with the mean response length over the WHOLE global batch;
shapers without a dual variable implement it (and ``lam``, ``state_dict``, ``load_state_dict``) as
no-ops so the trainer treats all shapers alike.

Lengths: L is the number of generated tokens of a response (thinking and answer, EOS excluded). A
truncated response (it hit the generation limit L_max) is counted with its generated length, i.e. L_max.

Methods (``list_shapers()``):

- ``laconic``: ``r - min(lambda * max((L - B)/B, 0), penalty_cap) - hit_cap * 1[truncated]`` with an
  adaptive lambda (DualController). Paper form: penalty_cap=None, hit_cap=0, floor=0.
- ``linear``: the same with the linear cost ``(L - B)/B`` (paper ablation).
- ``fixed``: clipped cost with a constant lambda = lambda_init (no dual step).
- ``grpo``: the task reward unchanged (lambda = 0).
- ``l1_exact``: ``1[correct] - alpha * |n_gold - L|`` (alpha default 0.0003), per-sample targets n_gold.
- ``l1_max``: ``1[correct] * clip(alpha * (n_gold - L) + 0.5, 0, 1)`` (alpha default 0.0003).
- ``efficient`` (Arora & Zanette): correct -> ``1 - alpha * sigmoid((L - mean_c) / (std_c + 1e-7))`` with
  mean_c / std_c (population) over the CORRECT responses of the same prompt's group, incorrect -> 0
  (alpha default 0.1).
- ``overlong`` (DAPO soft overlong punishment): ``r + min(-(L - (L_max - buffer)) / buffer * penalty, 0)``.

``1[correct]`` is ``task_reward > correct_threshold`` (default 0.5: right for 0/1 accuracy and for the
authors' 0.9 * accuracy + 0.1 * format reward).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from laconic_nemo.core.advantages import check_group_size
from laconic_nemo.core.costs import check_budget, clipped_cost, float_dtype_of, linear_cost
from laconic_nemo.core.dual import DualController, default_ceiling

__all__ = [
    "RewardShaper",
    "GRPOShaper",
    "LaconicShaper",
    "LinearCostShaper",
    "FixedLambdaShaper",
    "L1ExactShaper",
    "L1MaxShaper",
    "EfficientShaper",
    "OverlongShaper",
    "CONFIG_KEYS",
    "get_shaper",
    "list_shapers",
    "shaper_from_config",
]

# Keys of the `laconic:` section of recipes/base.yaml, plus max_length (= rollout.max_new_tokens) and the
# correctness threshold of the indicator-based baselines. count_eos is read by the trainer (which lengths it
# hands the shaper, see core.costs.cost_lengths) and ignored here.
CONFIG_KEYS = (
    "shaper", "budget", "eta", "ceiling", "lambda_init", "floor", "controller", "kp", "kd", "penalty_cap", "hit_cap", "alpha",
    "overlong_buffer", "overlong_penalty", "max_length", "correct_threshold", "count_eos",
)


# --------------------------------------------------------------------------------------------------------------
# value checks that name the config key
# --------------------------------------------------------------------------------------------------------------
def _num(key: str, value: Any, allowed: str, *, low: float | None = None, low_open: bool = False,
         allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"laconic.{key} must be {allowed}, got {value!r}")
    v = float(value)
    if low is not None and (v < low or (low_open and v == low)):
        raise ValueError(f"laconic.{key} must be {allowed}, got {value!r}")
    return v


def _budget(value: Any, required: bool) -> float | None:
    if value is None and not required:
        return None
    try:
        return check_budget(value)
    except ValueError:
        raise ValueError(f"laconic.budget must be a finite number > 0 (tokens), got {value!r}") from None


def _max_length(value: Any, required: bool, why: str = "") -> float | None:
    if value is None:
        if required:
            raise ValueError(f"max_length (rollout.max_new_tokens) is required{why}, got None")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"max_length (rollout.max_new_tokens) must be a number of tokens > 0, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------------------------------------------
# base class
# --------------------------------------------------------------------------------------------------------------
class RewardShaper:
    """Base class. Subclasses implement ``_shape`` on float64 tensors.

    Args:
        budget: B (tokens) used for the monitoring metrics frac_over_budget / mean_cost; required by the
            Lagrangian shapers, optional elsewhere (metrics are NaN without it).
        max_length: L_max = rollout.max_new_tokens; when given, lengths above it are rejected and
            ``truncated=None`` is read as ``L >= L_max``.
        correct_threshold: a response is correct when its task reward exceeds this.
    """

    name = "base"
    adaptive = False
    needs_targets = False

    def __init__(self, budget: float | None = None, max_length: float | None = None,
                 correct_threshold: float = 0.5) -> None:
        self.budget = _budget(budget, required=False)
        self.max_length = _max_length(max_length, required=False)
        self.correct_threshold = _num("correct_threshold", correct_threshold, "a finite number")

    # ---- dual interface (no-ops for non-adaptive shapers) ----
    @property
    def lam(self) -> float:
        """Current lambda (0.0 for shapers without a Lagrange multiplier)."""
        return 0.0

    def dual_update(self, global_mean_length: float) -> float:
        """Dual step with the mean length over the whole global batch; returns lambda (no-op here)."""
        v = float(global_mean_length)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"global_mean_length must be a finite number of tokens >= 0, got {global_mean_length!r}")
        return self.lam

    def state_dict(self) -> dict[str, Any]:
        return {"shaper": self.name}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        saved = state.get("shaper")
        if saved != self.name:
            raise ValueError(f"shaper state mismatch on 'shaper': checkpoint has {saved!r}, this run has {self.name!r}")

    # ---- shaping ----
    def __call__(self, rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor | None = None,
                 group_size: int = 1, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        return self.shape(rewards, lengths, truncated, group_size, targets)

    def shape(self, rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor | None = None,
              group_size: int = 1, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Shape one rollout batch.

        Args:
            rewards: [N] task rewards r (unshaped).
            lengths: [N] generated tokens per response, EOS excluded; a truncated response counts as
                L_max (its generated length).
            truncated: [N] bool, True where the response hit L_max; None = ``lengths >= max_length`` if
                max_length is known, else all False.
            group_size: G; N must be divisible by G, each prompt's G responses contiguous.
            targets: [N] per-sample target lengths n_gold (l1_exact / l1_max only).

        Returns:
            shaped rewards [N] (rewards' float dtype) and a dict of Python-float metrics: mean_length,
            frac_over_budget, frac_truncated, mean_cost, lambda, task_reward_mean, shaped_reward_mean
            and method-specific entries.
        """
        r = torch.as_tensor(rewards)
        if r.dim() != 1:
            raise ValueError(f"rewards must be a flat tensor [N], got shape {tuple(r.shape)}")
        n = r.numel()
        check_group_size(n, group_size)
        L = torch.as_tensor(lengths)
        if L.shape != r.shape:
            raise ValueError(f"lengths must have the shape of rewards {tuple(r.shape)}, got {tuple(L.shape)}")
        out_dtype = float_dtype_of(r)
        r64 = r.to(torch.float64)
        L64 = L.to(torch.float64)
        if not torch.isfinite(r64).all():
            raise ValueError("rewards must be finite (found NaN or inf)")
        if not torch.isfinite(L64).all() or (L64 < 0).any():
            raise ValueError("lengths must be finite and >= 0")
        if self.max_length is not None and (L64 > self.max_length).any():
            raise ValueError(f"lengths must be <= max_length ({self.max_length:g}); a truncated response counts "
                             f"as max_length, got max {float(L64.max()):g}")
        if truncated is None:
            trunc = L64 >= self.max_length if self.max_length is not None else torch.zeros_like(L64, dtype=torch.bool)
        else:
            trunc = torch.as_tensor(truncated)
            if trunc.shape != r.shape or trunc.dtype != torch.bool:
                raise ValueError(f"truncated must be a bool tensor of shape {tuple(r.shape)}, got "
                                 f"{trunc.dtype} {tuple(trunc.shape)}")
        t64 = None
        if self.needs_targets:
            if targets is None:
                raise ValueError(f"shaper {self.name!r} needs per-sample target lengths (targets [N], n_gold)")
            t64 = torch.as_tensor(targets).to(torch.float64)
            if t64.shape != r.shape or not torch.isfinite(t64).all() or (t64 < 0).any():
                raise ValueError(f"targets must be finite lengths >= 0 of shape {tuple(r.shape)}")
        shaped64, extra = self._shape(r64, L64, trunc, group_size, t64)
        metrics = self._common_metrics(r64, L64, trunc, shaped64)
        metrics.update(extra)
        return shaped64.to(out_dtype), metrics

    def _cost(self, L64: torch.Tensor) -> torch.Tensor | None:
        """The cost used for the mean_cost metric (clipped cost w.r.t. B, if B is known)."""
        return None if self.budget is None else clipped_cost(L64, self.budget)

    def _common_metrics(self, r64, L64, trunc, shaped64) -> dict[str, float]:
        n = max(r64.numel(), 1)
        cost = self._cost(L64)
        return {
            "mean_length": float(L64.sum()) / n,
            "frac_over_budget": float((L64 > self.budget).sum()) / n if self.budget is not None else math.nan,
            "frac_truncated": float(trunc.sum()) / n,
            "mean_cost": float(cost.sum()) / n if cost is not None else math.nan,
            "lambda": self.lam,
            "task_reward_mean": float(r64.sum()) / n,
            "shaped_reward_mean": float(shaped64.sum()) / n,
        }

    def _shape(self, r64, L64, trunc, group_size, t64) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def _correct(self, r64: torch.Tensor) -> torch.Tensor:
        return r64 > self.correct_threshold

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lam={self.lam!r}, budget={self.budget!r})"


class GRPOShaper(RewardShaper):
    """Plain GRPO: the task reward, no length term (lambda = 0)."""

    name = "grpo"

    def _shape(self, r64, L64, trunc, group_size, t64):
        return r64.clone(), {}


class _LagrangianShaper(RewardShaper):
    """``r - min(lambda * c(L), penalty_cap) - hit_cap * 1[truncated]``; subclasses fix c and how lambda moves."""

    cost_fn: Callable[[torch.Tensor, float], torch.Tensor] = staticmethod(clipped_cost)

    def __init__(self, budget: float, max_length: float | None = None, penalty_cap: float | None = None,
                 hit_cap: float = 0.0, correct_threshold: float = 0.5) -> None:
        super().__init__(_budget(budget, required=True), max_length, correct_threshold)
        self.penalty_cap = _num("penalty_cap", penalty_cap, "null or a finite number > 0", low=0.0, low_open=True,
                                allow_none=True)
        self.hit_cap = _num("hit_cap", hit_cap if hit_cap is not None else 0.0, "a finite number >= 0", low=0.0)

    def _cost(self, L64):
        return type(self).cost_fn(L64, self.budget)

    def _shape(self, r64, L64, trunc, group_size, t64):
        cost = self._cost(L64)
        penalty = self.lam * cost
        extra: dict[str, float] = {}
        n = max(r64.numel(), 1)
        if self.penalty_cap is not None:
            extra["frac_penalty_capped"] = float((penalty > self.penalty_cap).sum()) / n
            penalty = penalty.clamp_max(self.penalty_cap)
        if self.hit_cap:
            penalty = penalty + self.hit_cap * trunc.to(torch.float64)
        extra["mean_penalty"] = float(penalty.sum()) / n
        return r64 - penalty, extra


class LaconicShaper(_LagrangianShaper):
    """LACONIC: clipped cost, adaptive lambda (owns a DualController).

    Args:
        budget: B > 0.
        eta: dual step size >= 0.
        ceiling: Lambda; None = B / (max_length - B) (needs max_length > B) when max_length is given.
        lambda_init: initial lambda, in [0, ceiling]; below ``floor`` it is used unclipped for the first
            step and clipped by the first dual update (authors' scripts: 0 with floor 1e-5).
        floor: lower clip of lambda >= 0 (authors' DeepScaleR script: 1e-5).
        penalty_cap: cap on the per-response penalty lambda * c (authors' code: 0.4); None = no cap.
        hit_cap: extra penalty for truncated responses (authors' code: 0.1); 0 = none.
        max_length: L_max.
        controller, kp, kd: the lambda controller, ``integral`` (paper) or ``pid`` with gains kp, ki = eta, kd
            (see :mod:`laconic_nemo.core.dual`).
    """

    name = "laconic"
    adaptive = True

    def __init__(self, budget: float, eta: float = 0.002, ceiling: float | None = None, lambda_init: float = 0.0,
                 floor: float = 0.0, penalty_cap: float | None = None, hit_cap: float = 0.0,
                 max_length: float | None = None, correct_threshold: float = 0.5, controller: str = "integral",
                 kp: float = 0.0, kd: float = 0.0) -> None:
        super().__init__(budget, max_length, penalty_cap, hit_cap, correct_threshold)
        if controller not in ("integral", "pid"):
            raise ValueError(f"laconic.controller must be integral or pid, got {controller!r}")
        kp = _num("kp", kp if kp is not None else 0.0, "a finite number >= 0", low=0.0)
        kd = _num("kd", kd if kd is not None else 0.0, "a finite number >= 0", low=0.0)
        if controller == "integral" and (kp or kd):
            raise ValueError(f"laconic.kp = {kp!r} and laconic.kd = {kd!r} need laconic.controller = pid "
                             "(the integral controller has only eta)")
        eta = _num("eta", eta, "a finite number >= 0", low=0.0)
        floor = _num("floor", floor if floor is not None else 0.0, "a finite number >= 0", low=0.0)
        if ceiling is None:
            if self.max_length is not None:
                if self.max_length <= self.budget:
                    raise ValueError(f"max_length (rollout.max_new_tokens) must be > laconic.budget for the default "
                                     f"ceiling B / (L_max - B); got max_length={self.max_length:g}, "
                                     f"budget={self.budget:g} (or set laconic.ceiling)")
                ceil = default_ceiling(self.budget, self.max_length)
            else:
                ceil = math.inf
        else:
            ceil = _num("ceiling", ceiling, "null or a finite number >= laconic.floor", low=0.0)
        if ceil < floor:
            raise ValueError(f"laconic.ceiling must be >= laconic.floor, got ceiling={ceil!r}, floor={floor!r}")
        lam0 = _num("lambda_init", lambda_init if lambda_init is not None else 0.0, "a finite number")
        if not 0.0 <= lam0 <= ceil:
            raise ValueError(f"laconic.lambda_init must be in [0, ceiling] = [0, {ceil!r}] (below laconic.floor is "
                             f"allowed: the first dual step clips it), got {lambda_init!r}")
        self.dual = DualController(self.budget, eta, ceiling=ceil if math.isfinite(ceil) else None,
                                   init=lam0, floor=floor, controller=controller, kp=kp, kd=kd)

    @property
    def lam(self) -> float:
        return self.dual.value

    def dual_update(self, global_mean_length: float) -> float:
        super().dual_update(global_mean_length)
        return self.dual.update(global_mean_length)

    def state_dict(self) -> dict[str, Any]:
        return {"shaper": self.name, "dual": self.dual.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        super().load_state_dict(state, strict)
        if "dual" not in state:
            raise ValueError(f"shaper state for {self.name!r} is missing key 'dual'")
        self.dual.load_state_dict(state["dual"], strict=strict)


class LinearCostShaper(LaconicShaper):
    """Ablation: linear cost ``(L - B)/B`` (negative under budget), adaptive lambda."""

    name = "linear"
    cost_fn = staticmethod(linear_cost)


class FixedLambdaShaper(_LagrangianShaper):
    """Ablation: clipped cost with a constant lambda (= lambda_init), no dual step."""

    name = "fixed"

    def __init__(self, budget: float, lambda_init: float = 0.0, penalty_cap: float | None = None,
                 hit_cap: float = 0.0, max_length: float | None = None, correct_threshold: float = 0.5) -> None:
        super().__init__(budget, max_length, penalty_cap, hit_cap, correct_threshold)
        self._lam = _num("lambda_init", lambda_init if lambda_init is not None else 0.0,
                         "a finite number >= 0 (the constant lambda of the fixed shaper)", low=0.0)

    @property
    def lam(self) -> float:
        return self._lam


class _AlphaShaper(RewardShaper):
    """A shaper with one coefficient ``alpha`` (null = the method's ``default_alpha``)."""

    default_alpha = 1.0

    def __init__(self, alpha: float | None = None, budget: float | None = None, max_length: float | None = None,
                 correct_threshold: float = 0.5) -> None:
        super().__init__(budget, max_length, correct_threshold)
        self.alpha = _num("alpha", alpha if alpha is not None else self.default_alpha, "null or a finite number > 0",
                          low=0.0, low_open=True)


class L1ExactShaper(_AlphaShaper):
    """L1-Exact: ``1[correct] - alpha * |n_gold - L|`` with per-sample targets n_gold."""

    name = "l1_exact"
    needs_targets = True
    default_alpha = 0.0003

    def _shape(self, r64, L64, trunc, group_size, t64):
        gap = (t64 - L64).abs()
        return self._correct(r64).to(torch.float64) - self.alpha * gap, {"mean_abs_target_gap": float(gap.mean())}


class L1MaxShaper(L1ExactShaper):
    """L1-Max: ``1[correct] * clip(alpha * (n_gold - L) + 0.5, 0, 1)``."""

    name = "l1_max"

    def _shape(self, r64, L64, trunc, group_size, t64):
        factor = (self.alpha * (t64 - L64) + 0.5).clamp(0.0, 1.0)
        extra = {"mean_abs_target_gap": float((t64 - L64).abs().mean()),
                 "frac_over_target": float((L64 > t64).to(torch.float64).mean())}
        return self._correct(r64).to(torch.float64) * factor, extra


class EfficientShaper(_AlphaShaper):
    """Efficient Reasoning (Arora & Zanette): length-normalised bonus among the correct responses of a group.

    Correct response i of prompt q: ``1 - alpha * sigmoid((L_i - mean_c) / (std_c + 1e-7))`` with mean_c and
    the population std_c over the correct responses of q's group; incorrect responses get 0.
    """

    name = "efficient"
    default_alpha = 0.1
    std_eps = 1e-7

    def _shape(self, r64, L64, trunc, group_size, t64):
        correct = self._correct(r64).view(-1, group_size)
        c = correct.to(torch.float64)
        Lg = L64.view(-1, group_size)
        n_c = c.sum(dim=1, keepdim=True)
        denom = n_c.clamp_min(1.0)
        mean_c = (Lg * c).sum(dim=1, keepdim=True) / denom
        std_c = (((Lg - mean_c) ** 2) * c).sum(dim=1, keepdim=True).div(denom).sqrt()
        bonus = 1.0 - self.alpha * torch.sigmoid((Lg - mean_c) / (std_c + self.std_eps))
        shaped = torch.where(correct, bonus, torch.zeros_like(bonus)).view(-1)
        return shaped, {"frac_correct": float(c.mean()) if c.numel() else math.nan}


class OverlongShaper(RewardShaper):
    """DAPO soft overlong punishment: ``r + min(-(L - (L_max - buffer)) / buffer * penalty, 0)``."""

    name = "overlong"

    def __init__(self, max_length: float, overlong_buffer: int = 512, overlong_penalty: float = 1.0,
                 budget: float | None = None, correct_threshold: float = 0.5) -> None:
        super().__init__(budget, _max_length(max_length, required=True, why=" by the overlong shaper"),
                         correct_threshold)
        self.buffer = _num("overlong_buffer", overlong_buffer, f"a number of tokens in (0, max_length={self.max_length:g}]",
                           low=0.0, low_open=True)
        if self.buffer > self.max_length:
            raise ValueError(f"laconic.overlong_buffer must be a number of tokens in (0, max_length="
                             f"{self.max_length:g}], got {overlong_buffer!r}")
        self.penalty = _num("overlong_penalty", overlong_penalty, "a finite number >= 0", low=0.0)

    def _shape(self, r64, L64, trunc, group_size, t64):
        start = self.max_length - self.buffer
        pen = (-(L64 - start) / self.buffer * self.penalty).clamp_max(0.0)
        n = max(r64.numel(), 1)
        return r64 + pen, {"frac_in_overlong_buffer": float((L64 > start).sum()) / n, "mean_overlong_penalty":
                           float(pen.sum()) / n}


# --------------------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------------------
_REGISTRY: dict[str, tuple[type[RewardShaper], tuple[str, ...]]] = {
    "laconic": (LaconicShaper, ("budget", "eta", "ceiling", "lambda_init", "floor", "penalty_cap", "hit_cap",
                                "max_length", "correct_threshold", "controller", "kp", "kd")),
    "linear": (LinearCostShaper, ("budget", "eta", "ceiling", "lambda_init", "floor", "penalty_cap", "hit_cap",
                                  "max_length", "correct_threshold", "controller", "kp", "kd")),
    "fixed": (FixedLambdaShaper, ("budget", "lambda_init", "penalty_cap", "hit_cap", "max_length",
                                  "correct_threshold")),
    "grpo": (GRPOShaper, ("budget", "max_length", "correct_threshold")),
    "l1_exact": (L1ExactShaper, ("alpha", "budget", "max_length", "correct_threshold")),
    "l1_max": (L1MaxShaper, ("alpha", "budget", "max_length", "correct_threshold")),
    "efficient": (EfficientShaper, ("alpha", "budget", "max_length", "correct_threshold")),
    "overlong": (OverlongShaper, ("max_length", "overlong_buffer", "overlong_penalty", "budget",
                                  "correct_threshold")),
}


def list_shapers() -> list[str]:
    """Names accepted by ``get_shaper`` (and ``laconic.shaper``)."""
    return list(_REGISTRY)


def get_shaper(name: str, **config: Any) -> RewardShaper:
    """Build the shaper ``name`` from config keys of the ``laconic:`` section (plus max_length).

    Keys that the method does not use are accepted and ignored (one config section serves every method);
    unknown keys and bad values raise ValueError naming the key.
    """
    if name not in _REGISTRY:
        raise ValueError(f"laconic.shaper must be one of {list_shapers()}, got {name!r}")
    for key in config:
        if key not in CONFIG_KEYS:
            raise ValueError(f"unknown shaper config key {key!r}; allowed keys: {list(CONFIG_KEYS)}")
    if "shaper" in config and config["shaper"] != name:
        raise ValueError(f"laconic.shaper={config['shaper']!r} conflicts with the requested shaper {name!r}")
    cls, keys = _REGISTRY[name]
    kwargs = {k: config[k] for k in keys if k in config}
    return cls(**kwargs)


def shaper_from_config(laconic_cfg: Mapping[str, Any], max_length: int) -> RewardShaper:
    """Build the shaper from the ``laconic:`` config section and ``max_length = rollout.max_new_tokens``."""
    if not isinstance(laconic_cfg, Mapping):
        try:  # OmegaConf DictConfig and similar
            laconic_cfg = dict(laconic_cfg)
        except (TypeError, ValueError):
            raise ValueError(f"laconic config must be a mapping, got {type(laconic_cfg).__name__}") from None
    cfg = {str(k): laconic_cfg[k] for k in laconic_cfg}
    if "shaper" not in cfg:
        raise ValueError(f"laconic.shaper is required; one of {list_shapers()}")
    name = cfg.pop("shaper")
    if "max_length" in cfg and cfg["max_length"] != max_length:
        raise ValueError(f"max_length given twice with different values: laconic.max_length={cfg['max_length']!r}, "
                         f"argument {max_length!r}")
    cfg["max_length"] = max_length
    return get_shaper(name, **cfg)
