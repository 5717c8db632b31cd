"""The LACONIC mathematics, torch only: length costs, the Lagrangian reward, group advantages, the dual
(lambda) controller and the reward shapers of LACONIC and its baselines (docs/algorithm.md), on batches grouped
[P, G] (prompts x group).

Nothing here imports megatron-core, NeMo or vLLM.
"""

from laconic_nemo.core.advantages import ADVANTAGE_STD, as_groups, group_advantages
from laconic_nemo.core.band import Band, LowerBound, band_state_problem
from laconic_nemo.core.constraints import (
    BudgetClasses,
    CarryOver,
    Constraints,
    ConstraintStateMismatch,
    TailConstraint,
    class_report,
    classes_state_problem,
    local_counts,
    per_prompt_cost64,
    reasoning_lengths,
    report_counts,
    tail_state_problem,
)
from laconic_nemo.core.costs import (
    band_cost64,
    clipped_cost,
    clipped_cost64,
    cost_lengths,
    lagrangian_reward,
    length_penalty,
    linear_cost,
    linear_cost64,
)
from laconic_nemo.core.dual import (
    DualController,
    DualSettings,
    check_dual,
    default_ceiling,
    dual_state_problem,
    load_shaper_state,
    next_lambda,
    shaper_problem,
    shaper_state,
)
from laconic_nemo.core.shapers import (
    CORRECT,
    SHAPERS,
    Shaper,
    constant_lambda,
    lambda_controller,
    register_shaper,
    shape,
    shaping_metrics,
)

__all__ = [
    "ADVANTAGE_STD", "CORRECT", "Band", "BudgetClasses", "LowerBound", "band_cost64", "band_state_problem", "CarryOver", "ConstraintStateMismatch", "Constraints",
    "TailConstraint", "class_report", "classes_state_problem", "dual_state_problem", "shaper_problem",
    "tail_state_problem", "local_counts", "report_counts", "per_prompt_cost64", "reasoning_lengths", "SHAPERS",
    "DualController", "DualSettings", "Shaper", "as_groups", "check_dual", "clipped_cost", "clipped_cost64",
    "constant_lambda", "cost_lengths", "default_ceiling", "group_advantages", "lagrangian_reward", "lambda_controller",
    "length_penalty", "linear_cost", "linear_cost64", "load_shaper_state", "next_lambda", "register_shaper", "shape",
    "shaper_state", "shaping_metrics",
]
