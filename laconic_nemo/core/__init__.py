"""The LACONIC mathematics, torch only: length costs, the Lagrangian reward, group advantages, the dual
(lambda) controller and the reward shapers of LACONIC and its baselines.

Nothing here imports megatron-core, NeMo or vLLM.
"""

from laconic_nemo.core.advantages import ADVANTAGE_STD, group_advantages
from laconic_nemo.core.costs import clipped_cost, cost_lengths, lagrangian_reward, linear_cost
from laconic_nemo.core.dual import DualController, default_ceiling
from laconic_nemo.core.shapers import (
    CONFIG_KEYS,
    EfficientShaper,
    FixedLambdaShaper,
    GRPOShaper,
    L1ExactShaper,
    L1MaxShaper,
    LaconicShaper,
    LinearCostShaper,
    OverlongShaper,
    RewardShaper,
    get_shaper,
    list_shapers,
    shaper_from_config,
)

__all__ = [
    "ADVANTAGE_STD",
    "CONFIG_KEYS",
    "DualController",
    "EfficientShaper",
    "FixedLambdaShaper",
    "GRPOShaper",
    "L1ExactShaper",
    "L1MaxShaper",
    "LaconicShaper",
    "LinearCostShaper",
    "OverlongShaper",
    "RewardShaper",
    "clipped_cost",
    "cost_lengths",
    "default_ceiling",
    "get_shaper",
    "group_advantages",
    "lagrangian_reward",
    "linear_cost",
    "list_shapers",
    "shaper_from_config",
]
