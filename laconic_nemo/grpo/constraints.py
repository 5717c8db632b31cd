"""The run's constraints beyond the mean, built from its config, and their state across a resume.

:func:`build_constraints` builds what the trainer (and ``plan``) build from a config
(:class:`laconic_nemo.core.constraints.Constraints`). :func:`restore_constraints` loads a checkpoint's multipliers into
them: lambda's controller, each class by its key (its budget or bin), the tail constraint by its B_tail and q; a
class or tail constraint that differs from the checkpoint's, or lambda's controller where the checkpoint has none
(it trained with per-prompt budgets), is refused naming the keys and the checkpoint, unless the
``checkpoint.resume_allow_changes`` entries (``class:...``, ``tail:...``, ``lambda:reset``;
:class:`~laconic_nemo.core.CarryOver`) say how to carry it over. The pre-flight runs the same restore on freshly built constraints
(:func:`restore_resume_state`), so ``train`` refuses before any rank starts what a rank would refuse; a refusal names
one ``checkpoint.resume_allow_changes`` list that accepts the whole change.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from laconic_nemo.config import Config, defaults, to_dict
from laconic_nemo.core.constraint_state import load_lambda_state
from laconic_nemo.core.constraints import (
    BudgetClasses,
    CarryOver,
    Constraints,
    ConstraintStateMismatch,
)
from laconic_nemo.grpo.resume import ResumeError, change_allowed, check_resume_config, config_differences

# the config keys that decide the budget classes and the tail constraint (named with the carry-over entries when
# a resume refuses a difference, so that one override accepts the whole change)
CLASS_KEYS = ("data.target_lengths", "data.target_length_range", "data.budget_key", "data.train_files",
              "data.synthetic.budgets_by_terms", "laconic.budget_classes", "laconic.per_prompt_budget")
TAIL_KEYS = ("laconic.tail_budget", "laconic.tail_share")


def run_budgets(cfg: Config) -> list[float] | None:
    """Every budget a prompt of the run can have: the stated targets, else the prompts' B_i read from
    ``data.budget_key`` (the math data files' rows, or the synthetic task's rows, which carry
    ``data.synthetic.budgets_by_terms``'s budget of each problem); None without per-prompt budgets."""
    lc, d = cfg.laconic, cfg.data
    if not lc.per_prompt_budget:
        return None
    stated = d.stated_budgets()
    if stated is not None:
        return [float(b) for b in stated]
    from laconic_nemo.data.datasets import prompt_budgets, row_budgets

    if d.kind == "synthetic":
        return row_budgets(synthetic_rows(cfg), str(d.budget_key), d.budget_missing, lc.budget,
                           cfg.rollout.max_new_tokens)
    return prompt_budgets(list(d.train_files), str(d.budget_key), d.budget_missing, lc.budget,
                          cfg.rollout.max_new_tokens)


def synthetic_rows(cfg: Config) -> list[dict]:
    """The synthetic task's data rows of the run (``SyntheticTask.rows``: the problems the trainer draws, each with
    its budget under ``data.budget_key`` when one is set)."""
    import dataclasses

    from laconic_nemo.data.synthetic import SyntheticTask

    d = cfg.data
    key = d.budget_key
    return SyntheticTask(**dataclasses.asdict(d.synthetic)).rows(d.num_prompts, cfg.run.seed, key)


def build_constraints(cfg: Config, budgets: Sequence[float] | None = None, marker: Sequence[int] | None = None
                      ) -> Constraints:
    """The run's constraints (:class:`~laconic_nemo.core.constraints.Constraints`: lambda's controller, the budget
    classes of ``budgets``, the tail constraint, the marker's token ids ``marker``) from ``cfg.laconic`` with
    L_max = ``rollout.max_new_tokens``; what the trainer and ``plan`` both build."""
    return Constraints.build(cfg.laconic, cfg.rollout.max_new_tokens, budgets, marker)


@dataclass(frozen=True)
class TrainerConstraints:
    """What the trainer holds of the constraints: ``constraints`` (:func:`build_constraints`), ``prompt_budgets``
    (B_i of each prompt when they come from the data, else None) and ``report_classes`` (the classes of the
    per-class report, ``budget_class/<name>/...``: the run's budget classes, or, for a shaper without multipliers
    such as the L1 baselines, one class per stated target of a set, data.target_lengths; None: no report)."""

    constraints: Constraints
    prompt_budgets: list[float] | None
    report_classes: BudgetClasses | None


def trainer_constraints(cfg: Config, encode: Callable[[str], list[int]], num_prompts: int,
                        budgets: Sequence[float] | None = None) -> TrainerConstraints:
    """The trainer's constraints (:class:`TrainerConstraints`): the marker's token ids by ``encode``, and with
    per-prompt budgets the classes of the stated targets or of the prompts' B_i (``budgets``, one per prompt of the
    ``num_prompts``; default :func:`run_budgets`, the data files' or the synthetic rows' data.budget_key). Raises
    ValueError naming the key where the marker encodes to nothing or the budgets do not match the prompts."""
    lc, d = cfg.laconic, cfg.data
    marker = None
    if lc.reasoning_marker is not None:
        marker = list(encode(lc.reasoning_marker))
        if not marker:
            raise ValueError(f"laconic.reasoning_marker = {lc.reasoning_marker!r} encodes to no token")
    prompt_budgets = None
    stated = None
    if lc.per_prompt_budget:
        stated = d.stated_budgets()
        if stated is None:
            if budgets is None:
                budgets = run_budgets(cfg)
            if len(budgets) != num_prompts:
                raise ValueError(f"data.budget_key: {len(budgets)} budgets for {num_prompts} prompts")
            prompt_budgets = [float(b) for b in budgets]
            stated = prompt_budgets
    constraints = build_constraints(cfg, stated, marker)
    report = constraints.classes
    if report is None and d.target_lengths is not None:
        report = BudgetClasses(d.stated_budgets(), None, eta=0.0, ceiling=0.0)
    return TrainerConstraints(constraints, prompt_budgets, report)


def carry_over(cfg: Config) -> CarryOver:
    """The carry-over entries of ``checkpoint.resume_allow_changes``."""
    return CarryOver.parse(list(cfg.checkpoint.resume_allow_changes or []))


class ResumeRefused(ResumeError):
    """A difference between the checkpoint's constraints and this run's that ``checkpoint.resume_allow_changes`` can
    accept; ``allow`` is a whole list that accepts it (the entries given, less those that cannot apply, with the
    config keys and carry-over entries it lacks)."""

    def __init__(self, message: str, allow: Sequence[str]):
        super().__init__(message)
        self.allow = list(allow)


def restore_constraints(ckpt: str | Path, state: Mapping[str, Any], constraints: Constraints, cfg: Config,
                        strict: bool = True, allow: Sequence[str] | None = None) -> None:
    """Load ``state`` (a checkpoint's trainer state) into this run's ``constraints``: lambda's controller
    (:func:`~laconic_nemo.core.constraint_state.load_lambda_state`), each budget class by its key, the tail constraint
    by its settings, the band's lower bounds with their classes (the mean-length constraint's band by
    :meth:`Constraints.load_band_state`); the carry-over entries of ``allow`` (default: ``cfg``'s
    ``checkpoint.resume_allow_changes``) decide what happens where they differ (:class:`~laconic_nemo.core.CarryOver`).

    A constraint the checkpoint has and this run lacks is dropped (turning it off is a config change that
    ``checkpoint.resume_allow_changes`` must accept). Raises :class:`ResumeRefused`: one line naming the checkpoint,
    what differs and a ``checkpoint.resume_allow_changes`` list that accepts it; ResumeError for a setting that
    differs (``strict``) or another shaper."""
    allow = list(cfg.checkpoint.resume_allow_changes or []) if allow is None else list(allow)
    carry = CarryOver.parse(allow)
    saved = state.get("constraints") or {}
    classes, tail = constraints.classes, constraints.tail
    try:
        constraints.load_band_state(saved.get("band"), strict=strict)
    except ValueError as exc:
        raise ResumeError(f"cannot resume from {ckpt}: {exc}") from None
    problems, entries, drop = [], [], []
    steps = [(lambda: load_lambda_state(cfg.laconic.shaper, constraints.dual, state, carry, strict=strict))]
    steps += [functools.partial(mine.load_state_dict, saved.get(name), strict=strict,
                                carry=carry if name == "classes" else carry.tail)
              for mine, name in ((classes, "classes"), (tail, "tail")) if mine is not None]
    for restore in steps:
        try:
            restore()
        except ConstraintStateMismatch as exc:
            problems.append(str(exc))
            entries += exc.entries
            drop += exc.drop
        except ValueError as exc:  # settings that differ (strict), or a value the checks let through
            raise ResumeError(f"cannot resume from {ckpt}: {exc}") from None
    if problems:
        differ = {k for k, _, _ in config_differences(state.get("config") or {}, to_dict(cfg), defaults())}
        behind = (CLASS_KEYS if classes is not None or constraints.dual is not None else ()) + \
            (TAIL_KEYS if tail is not None else ())
        keys = [k for k in behind if k in differ]
        entries = list(dict.fromkeys(entries))
        other = ""
        if "tail:carry" in entries and "tail:reset" in entries:  # two ways for one tail: offer the first
            entries.remove("tail:reset")
            other = " (tail:reset instead of tail:carry starts mu at laconic.tail_init)"
        if any(e.endswith("=" + CarryOver.LAMBDA) for e in entries):
            other += " (lambda:reset instead starts lambda at laconic.lambda_init)"
        accept = [a for a in allow if a not in drop] + [k for k in keys if not change_allowed(k, allow)] + entries
        raise ResumeRefused(f"cannot resume from {ckpt}: {'; '.join(problems)}. To carry the state over, resume with "
                            f"checkpoint.resume_allow_changes=[{','.join(accept)}]{other} (how each entry carries it: "
                            "docs/reliability.md), or with the checkpoint's settings", accept)


def restore_resume_state(ckpt: str | Path, state: Mapping[str, Any], cfg: Config,
                         constraints: Constraints | None = None) -> None:
    """What a resume checks of a checkpoint's trainer ``state`` before its model is loaded, the same in the pre-flight
    and in every rank: the config differences (:func:`~laconic_nemo.grpo.resume.check_resume_config`), then the
    multipliers restored into ``constraints`` (the trainer's; None: freshly built from ``cfg``, as the pre-flight
    checks them) by :func:`restore_constraints`. A config refusal names the ``checkpoint.resume_allow_changes`` list
    that accepts the constraints' state too (with the carry-over entries the change needs), so that the list it
    names passes."""
    allow = list(cfg.checkpoint.resume_allow_changes or [])
    strict = resume_strict(state, cfg)

    def accepting(keys: list[str]) -> list[str]:
        try:
            restore_constraints(ckpt, state, build_constraints(cfg, run_budgets(cfg)), cfg, strict=strict, allow=keys)
        except ResumeRefused as exc:
            return exc.allow
        except (ResumeError, ValueError):  # another refusal: the config keys are all this list can say
            pass
        return keys

    check_resume_config(ckpt, state.get("config", {}), to_dict(cfg), allow, defaults(), suggest=accepting)
    if constraints is None:
        constraints = build_constraints(cfg, run_budgets(cfg))
    restore_constraints(ckpt, state, constraints, cfg, strict=strict, allow=allow)


def resume_strict(state: Mapping[str, Any], cfg: Config) -> bool:
    """Whether the controllers' settings must equal the checkpoint's: True unless a LACONIC key (or L_max) is among
    the config differences ``checkpoint.resume_allow_changes`` accepts (then this run's settings are kept and the
    restored multipliers clipped into them)."""
    diffs = config_differences(state.get("config", {}), to_dict(cfg), defaults())
    return not any(k.startswith("laconic.") or k == "rollout.max_new_tokens" for k, _, _ in diffs)
