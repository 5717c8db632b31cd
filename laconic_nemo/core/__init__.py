"""The LACONIC mathematics, torch only: length costs, the Lagrangian reward, group advantages, the dual
(lambda) controller and the reward shapers of LACONIC and its baselines (docs/algorithm.md).

Nothing here imports megatron-core, NeMo or vLLM.
"""

from laconic_nemo.core.advantages import ADVANTAGE_STD, group_advantages
from laconic_nemo.core.costs import clipped_cost, cost_lengths, lagrangian_reward, length_penalty, linear_cost
from laconic_nemo.core.dual import (
    DualController,
    check_dual,
    default_ceiling,
    load_shaper_state,
    next_lambda,
    shaper_state,
)
from laconic_nemo.core.shapers import SHAPERS, Shaper, register_shaper, shaping_metrics

__all__ = [
    "ADVANTAGE_STD", "SHAPERS", "DualController", "Shaper", "check_dual", "clipped_cost", "cost_lengths",
    "default_ceiling", "group_advantages", "lagrangian_reward", "length_penalty", "linear_cost", "load_shaper_state",
    "next_lambda", "register_shaper", "shaper_state", "shaping_metrics",
]
