"""The run's constraints beyond the mean, built from its config, and their state across a resume.

:func:`build_constraints` builds what the trainer (and ``plan``) build from a config
(:class:`laconic_nemo.core.constraints.Constraints`). :func:`restore_constraints` loads a checkpoint's constraint state into
them: each class by its key (its budget or bin), the tail constraint by its B_tail and q; a class or tail
constraint that differs from the checkpoint's is refused naming the keys and the checkpoint, unless the
``checkpoint.resume_allow_changes`` entries (``class:...``, ``tail:...``; :class:`~laconic_nemo.core.CarryOver`)
say how to carry it over. The pre-flight runs the same restore on freshly built constraints
(:func:`check_constraints_resume`), so ``train`` refuses before any rank starts what a rank would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from laconic_nemo.config import Config, defaults, to_dict
from laconic_nemo.core.constraints import (
    BudgetClasses,
    CarryOver,
    Constraints,
    ConstraintStateMismatch,
    TailConstraint,
)
from laconic_nemo.grpo.resume import ResumeError, config_differences

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


def restore_constraints(ckpt: str | Path, state: Mapping[str, Any], classes: BudgetClasses | None,
                        tail: TailConstraint | None, cfg: Config, strict: bool = True,
                        constraints: Constraints | None = None) -> None:
    """Load ``state`` (a checkpoint's trainer state) into this run's ``classes`` and ``tail``, by key; the carry-over
    entries of ``cfg`` decide what happens where they differ (:class:`~laconic_nemo.core.CarryOver`). The band's
    lower bounds come with their classes; ``constraints``: the run's constraints, whose band of the mean-length
    constraint (a run without per-prompt budgets) is restored too (:meth:`Constraints.load_band_state`).

    A constraint the checkpoint has and this run lacks is dropped (turning it off is a config change that
    ``checkpoint.resume_allow_changes`` must accept). Raises :class:`~laconic_nemo.grpo.resume.ResumeError`: one
    line naming the checkpoint, the keys that differ and the entries that would accept them."""
    saved = state.get("constraints") or {}
    if constraints is not None:
        try:
            constraints.load_band_state(saved.get("band"), strict=strict)
        except ValueError as exc:
            raise ResumeError(f"cannot resume from {ckpt}: {exc}") from None
    carry = carry_over(cfg)
    problems, entries = [], []
    for mine, name in ((classes, "classes"), (tail, "tail")):
        if mine is None:
            continue
        carry_how = carry if name == "classes" else carry.tail
        try:
            mine.load_state_dict(saved.get(name), strict=strict, carry=carry_how)
        except ConstraintStateMismatch as exc:
            problems.append(str(exc))
            entries += exc.entries
        except ValueError as exc:  # settings that differ (strict), or a value the checks let through
            raise ResumeError(f"cannot resume from {ckpt}: {exc}") from None
    if problems:
        differ = {k for k, _, _ in config_differences(state.get("config") or {}, to_dict(cfg), defaults())}
        behind = (CLASS_KEYS if classes is not None else ()) + (TAIL_KEYS if tail is not None else ())
        keys = [k for k in behind if k in differ]
        allowed = list(cfg.checkpoint.resume_allow_changes or [])
        entries = list(dict.fromkeys(entries))
        other = ""
        if "tail:carry" in entries and "tail:reset" in entries:  # two ways for one tail: offer the first
            entries.remove("tail:reset")
            other = " (tail:reset instead of tail:carry starts mu at laconic.tail_init)"
        accept = allowed + [k for k in keys if k not in allowed] + entries
        raise ResumeError(f"cannot resume from {ckpt}: {'; '.join(problems)}. To carry the state over, resume with "
                          f"checkpoint.resume_allow_changes=[{','.join(accept)}]{other} (how each entry carries it: "
                          "docs/reliability.md), or with the checkpoint's settings")


def check_constraints_resume(ckpt: str | Path, state: Mapping[str, Any], cfg: Config) -> None:
    """The pre-flight's copy of a rank's restore: build this run's constraints from ``cfg`` and restore ``state``
    into them (:func:`restore_constraints`); ResumeError as a rank would raise it."""
    built = build_constraints(cfg, run_budgets(cfg))
    restore_constraints(ckpt, state, built.classes, built.tail, cfg, strict=resume_strict(state, cfg), constraints=built)


def resume_strict(state: Mapping[str, Any], cfg: Config) -> bool:
    """Whether the controllers' settings must equal the checkpoint's: True unless a LACONIC key (or L_max) is among
    the config differences ``checkpoint.resume_allow_changes`` accepts (then this run's settings are kept and the
    restored multipliers clipped into them)."""
    diffs = config_differences(state.get("config", {}), to_dict(cfg), defaults())
    return not any(k.startswith("laconic.") or k == "rollout.max_new_tokens" for k, _, _ in diffs)
