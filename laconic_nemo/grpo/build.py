"""What a run builds before its first step that needs no GPU, in one place for the trainer and `plan`.

The trainer (:class:`~laconic_nemo.grpo.trainer.GRPOTrainer`) takes its shaper (and lambda controller),
advantage and loss settings from here, the entry points their math reward; ``laconic-nemo plan`` calls
:func:`build_step_one`, which builds the same objects on CPU (plus the tokenizer and one rendered prompt
when their paths exist here), so a recipe that `plan` accepts does not fail in one of these constructors
after the cluster has allocated its GPUs.
"""

from __future__ import annotations

from typing import Any

from laconic_nemo.config import Config
from laconic_nemo.core import SHAPERS, DualController, Shaper


def build_shaper(cfg: Config) -> Shaper:
    """The recipe's reward shaper (a registered function and its ``laconic:`` settings); the recipe was checked at
    load time, :func:`needs_targets_range` aside."""
    lc = cfg.laconic
    if SHAPERS[lc.shaper].needs_targets and cfg.data.target_length_range is None:
        raise ValueError(f"laconic.shaper = {lc.shaper} needs per-prompt target lengths: "
                         "set data.target_length_range = [min, max]")
    return Shaper(lc.shaper, budget=lc.budget, max_length=cfg.rollout.max_new_tokens, penalty_cap=lc.penalty_cap,
                  hit_cap=lc.hit_cap, alpha=lc.alpha, overlong_buffer=lc.overlong_buffer,
                  overlong_penalty=lc.overlong_penalty)


def build_dual(cfg: Config) -> DualController | None:
    """The lambda controller of an adaptive shaper (laconic, linear); None for the others."""
    lc = cfg.laconic
    if SHAPERS[lc.shaper].lam != "dual":
        return None
    return DualController(lc.budget, lc.eta, ceiling=lc.ceiling, max_length=cfg.rollout.max_new_tokens,
                          init=lc.lambda_init, floor=lc.floor, controller=lc.controller, kp=lc.kp, kd=lc.kd)


def constant_lambda(cfg: Config) -> float:
    """lambda of a shaper without a controller: laconic.lambda_init for ``fixed``, 0 for the others."""
    return cfg.laconic.lambda_init if SHAPERS[cfg.laconic.shaper].lam == "fixed" else 0.0


def advantage_settings(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of :func:`laconic_nemo.core.group_advantages` from ``grpo:``."""
    g = cfg.grpo
    return {"eps": float(g.advantage_eps), "leave_one_out": bool(g.leave_one_out), "std": str(g.advantage_std)}


def loss_settings(cfg: Config) -> dict[str, Any]:
    """Keyword arguments of :func:`laconic_nemo.grpo.loss.make_grpo_loss_fn` from ``grpo:`` (without the
    per-minibatch global token / sequence counts)."""
    g = cfg.grpo
    return {
        "clip_eps": float(g.clip_eps),
        "clip_eps_high": None if g.clip_eps_high is None else float(g.clip_eps_high),
        "clip_dual": None if g.clip_dual is None else float(g.clip_dual),
        "kl_beta": float(g.kl_beta),
        "aggregation": str(g.loss_aggregation),
    }
