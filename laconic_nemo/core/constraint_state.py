"""The saved state of the constraints beyond the mean, keyed by what it belongs to, and how a resume maps it onto a
run's constraints (:mod:`laconic_nemo.core.constraints` says why by key).

Each budget class's multiplier is saved under the class's key (its budget ``"500"`` or its bin ``"500-1000"``,
:func:`class_name`) together with the budgets it holds; the tail constraint's under its B_tail and q
(:func:`tail_key`). :func:`match_classes` maps saved to current classes by key; a difference is refused
(:class:`ConstraintStateMismatch`) unless a :class:`CarryOver` accepts it. :func:`classes_state_problem` and
:func:`tail_state_problem` name a bad value inside a saved state (key, value, allowed) without a run to load it into;
:func:`saved_classes` reads the list form of older checkpoints where it is unambiguous.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from laconic_nemo.core.band import band_state_problem
from laconic_nemo.core.dual import dual_state_problem, load_shaper_state


def class_name(lo: float, hi: float | None = None) -> str:
    """The metric suffix of a class: its budget (``500``), or its bin ``[lo, hi)`` (``500-1000``)."""
    def num(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else f"{x:g}"
    return num(lo) if hi is None else f"{num(lo)}-{num(hi)}"


def class_budgets_from_state(budgets: Sequence[float], edges: Sequence[float] | None) -> dict[str, list[float]]:
    """``{class key: its budgets}`` of the classes that ``budgets`` and bin ``edges`` make (as
    :class:`BudgetClasses` builds them). Raises ValueError where they make no classes."""
    out: dict[str, list[float]] = {}
    values = sorted({float(b) for b in budgets})
    if edges is None:
        return {class_name(b): [b] for b in values}
    e = [float(x) for x in edges]
    for b in values:
        if not e[0] <= b <= e[-1]:
            raise ValueError(f"budget {b:g} lies outside the bins [{e[0]:g}, {e[-1]:g}]")
        k = min(bisect.bisect_right(e, b) - 1, len(e) - 2)
        out.setdefault(class_name(e[k], e[k + 1]), []).append(b)
    return out


def _number_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                           and math.isfinite(x) for x in value)


def classes_state_problem(state: Any) -> tuple[str, Any, str] | None:
    """What is wrong with a saved :meth:`BudgetClasses.state_dict` (or the list form of older checkpoints):
    ``(key, value, allowed)`` with the key relative to the state (``classes.500.dual.lam``), or None. A list form
    that cannot be keyed unambiguously (:func:`saved_classes`) is a problem too."""
    if not isinstance(state, Mapping):
        return "", state, "a mapping with the budget classes' state"
    edges = state.get("edges")
    if edges is not None and not (_number_list(edges) and len(edges) >= 2):
        return "edges", edges, "null or a list of at least two bin edges"
    if "classes" in state:
        classes = state["classes"]
        if not isinstance(classes, Mapping) or not classes:
            return "classes", classes, "a non-empty mapping of class key -> {budgets, dual}"
        for key, entry in classes.items():
            if not isinstance(entry, Mapping):
                return f"classes.{key}", entry, "a mapping {budgets, dual}"
            if not (_number_list(entry.get("budgets")) and entry["budgets"]):
                return f"classes.{key}.budgets", entry.get("budgets", "(missing)"), "a non-empty list of finite numbers"
        duals = {f"classes.{k}.dual": entry.get("dual") for k, entry in classes.items()}
        for k, entry in classes.items():  # the band's lower bound, saved with its class
            problem = None if entry.get("band") is None else band_state_problem(entry["band"])
            if problem is not None:
                return f"classes.{k}.band" + (f".{problem[0]}" if problem[0] else ""), problem[1], problem[2]
    else:  # the list form of older checkpoints
        problem = _list_form_problem(state)
        if problem is not None:
            return problem
        duals = {f"duals.{i}": d for i, d in enumerate(state["duals"])}
    for where, dual in duals.items():
        problem = dual_state_problem(dual)
        if problem is not None:
            return (f"{where}.{problem[0]}" if problem[0] else where), problem[1], problem[2]
    return None


def _list_form_problem(state: Mapping[str, Any]) -> tuple[str, Any, str] | None:
    """Why the list form of an older checkpoint's classes (``budgets``, ``edges``, ``names``, ``duals`` in the order
    of ``names``) cannot be keyed unambiguously, or None: it needs as many multipliers as names, and the names
    those its own budgets and bin edges make."""
    for key in ("budgets", "names", "duals"):
        if not isinstance(state.get(key), list):
            return key, state.get(key, "(missing)"), "a list (older checkpoints), or the mapping 'classes' instead"
    if not _number_list(state["budgets"]) or not state["budgets"]:
        return "budgets", state["budgets"], "a non-empty list of finite numbers"
    try:
        made = list(class_budgets_from_state(state["budgets"], state.get("edges")))
    except ValueError as exc:
        return "budgets", state["budgets"], f"budgets inside the bin edges ({exc})"
    names = [str(n) for n in state["names"]]
    if names != made:
        return "names", state["names"], f"the classes its budgets and bin edges make, {made} (else which multiplier " \
                                        "belongs to which class is ambiguous)"
    if len(state["duals"]) != len(names):
        return "duals", f"a list of {len(state['duals'])}", f"one multiplier per class of 'names' ({len(names)}: " \
                                                             f"{', '.join(names)}; else which belongs to which " \
                                                             "class is ambiguous)"
    return None


def saved_classes(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{class key: {"budgets": [...], "dual": controller state}}`` of a saved :meth:`BudgetClasses.state_dict`;
    the list form of older checkpoints keyed by its names where that is unambiguous (:func:`classes_state_problem`
    says why not: ValueError)."""
    problem = classes_state_problem(state)
    if problem is not None:
        key, value, allowed = problem
        raise ValueError(f"budget classes state: key {key or '(the state)'} = {value!r} is invalid: allowed {allowed}")
    if "classes" in state:  # with the band, a class's lower bound comes along ("band")
        return {str(k): {"budgets": [float(b) for b in v["budgets"]], "dual": v["dual"],
                         **({"band": v["band"]} if v.get("band") is not None else {})}
                for k, v in state["classes"].items()}
    members = class_budgets_from_state(state["budgets"], state.get("edges"))
    return {str(n): {"budgets": members[str(n)], "dual": d} for n, d in zip(state["names"], state["duals"])}


class ConstraintStateMismatch(ValueError):
    """The saved constraints differ from this run's and nothing says how to carry them over. ``entries``: the
    ``checkpoint.resume_allow_changes`` entries that would accept the difference (each carries the state over
    in one documented way, :class:`CarryOver`); ``drop``: entries given that cannot apply (a rename naming a class
    one side lacks), to be left out of the list that accepts it."""

    def __init__(self, message: str, entries: Sequence[str], drop: Sequence[str] = ()):
        super().__init__(message)
        self.entries, self.drop = list(entries), list(drop)


@dataclass(frozen=True)
class CarryOver:
    """How a resume carries the constraint state over where this run's constraints differ from the checkpoint's
    (each field one ``checkpoint.resume_allow_changes`` entry; default: every difference is refused).

    renames: this run's class key -> the checkpoint's class key whose multiplier it takes (``class:OLD=NEW``).
    new: a class the checkpoint lacks starts at lambda_init (``class:new``).
    dropped: the multiplier of a checkpoint class this run lacks is dropped (``class:dropped``).
    budgets: a class (a bin) whose budgets differ from the checkpoint's keeps its multiplier (``class:budgets``).
    tail: "carry" (``tail:carry``): a tail constraint with another B_tail or q keeps the checkpoint's mu (clipped
        into this run's [0, tail_ceiling]); "reset" (``tail:reset``): it starts at tail_init (also when the
        checkpoint has no tail constraint); None: refused.
    lam: where the checkpoint holds no state of lambda's controller (it trained with per-prompt budgets) and this run
        has one: "reset" (``lambda:reset``): lambda starts at lambda_init; a checkpoint class key K
        (``class:K=lambda``): lambda takes that class's multiplier, clipped into this run's [floor, ceiling]; None:
        refused.
    """

    renames: Mapping[str, str] = field(default_factory=dict)
    new: bool = False
    dropped: bool = False
    budgets: bool = False
    tail: str | None = None
    lam: str | None = None

    PREFIXES = ("class:", "tail:", "lambda:")
    LAMBDA = "lambda"  # the name of lambda's controller as the target of a class:OLD=NEW entry

    @classmethod
    def is_entry(cls, entry: str) -> bool:
        """``entry`` is meant as a carry-over entry (it starts with ``class:`` or ``tail:``), not a config key."""
        return str(entry).startswith(cls.PREFIXES)

    @classmethod
    def parse(cls, entries: Sequence[str]) -> "CarryOver":
        """The carry-over entries among ``entries`` (config keys are left out); ValueError naming a bad one."""
        renames: dict[str, str] = {}
        flags = {"new": False, "dropped": False, "budgets": False}
        tail = lam = None
        for entry in (str(e) for e in entries if cls.is_entry(e)):
            kind, _, what = entry.partition(":")
            if kind == "tail" and what in ("carry", "reset"):
                if tail not in (None, what):
                    raise ValueError(f"{entry!r} contradicts 'tail:{tail}'")
                tail = what
            elif kind == "class" and what in flags:
                flags[what] = True
            elif (kind == "lambda" and what == "reset") or (kind == "class" and what.count("=") == 1
                                                           and what.split("=")[1] == cls.LAMBDA and what[0] != "="):
                how = what if kind == "lambda" else what.split("=")[0]
                if lam not in (None, how):
                    raise ValueError(f"{entry!r} contradicts " + ("'lambda:reset'" if lam == "reset" else
                                                                  f"'class:{lam}={cls.LAMBDA}'"))
                lam = how
            elif kind == "class" and what.count("=") == 1 and all(what.split("=")):
                old, new = what.split("=")
                if new in renames and renames[new] != old:
                    raise ValueError(f"{entry!r}: class {new} already takes class {renames[new]}")
                renames[new] = old
            else:
                raise ValueError(f"{entry!r} is not a carry-over entry: allowed class:new, class:dropped, "
                                 "class:budgets, class:OLD=NEW (class keys as in the metric names, e.g. "
                                 "class:500-1000=500-1200), class:OLD=lambda, lambda:reset, tail:carry or tail:reset")
        return cls(renames=renames, tail=tail, lam=lam, **flags)


def match_classes(saved: Mapping[str, Mapping[str, Any]], classes: Any, carry: CarryOver
                  ) -> dict[str, str | None]:
    """Which saved class each class of this run continues: ``{this run's key: the saved key, or None (starts at
    lambda_init)}``, by key (a renamed class by ``carry.renames``). ``classes``: this run's
    :class:`~laconic_nemo.core.constraints.BudgetClasses` (its ``names`` and ``class_budgets(k)``).

    Raises :class:`ConstraintStateMismatch` listing every difference ``carry`` does not accept: a class of this
    run the checkpoint lacks, a saved class this run lacks, a class whose budgets differ, a rename that names a
    class neither side has."""
    problems, entries, drop = [], [], []
    plan: dict[str, str | None] = {}
    used = set()
    for new, old in carry.renames.items():
        if new not in classes.names or old not in saved:
            problems.append(f"class:{old}={new} names "
                            + (f"class {old}, which the checkpoint lacks" if old not in saved else
                               f"class {new}, which this run lacks"))
            drop.append(f"class:{old}={new}")
    # what else differs is judged without the renames that cannot apply (the entries offered replace them)
    carry = dataclasses.replace(carry, renames={n: o for n, o in carry.renames.items() if f"class:{o}={n}" not in drop})
    for k, name in enumerate(classes.names):
        source = carry.renames.get(name, name)
        if source not in saved:
            plan[name] = None
            if not carry.new and name not in carry.renames:
                problems.append(f"class {name} is new (the checkpoint lacks it)")
                entries.append("class:new")
            continue
        plan[name] = source
        used.add(source)
        before, now = [float(b) for b in saved[source]["budgets"]], classes.class_budgets(k)
        if before != now and source == name and not carry.budgets:
            problems.append(f"class {name} holds the budgets {_show(now)}, the checkpoint's {_show(before)}")
            entries.append("class:budgets")
    gone = [k for k in saved if k not in used]
    if gone and not carry.dropped:
        problems.append(f"class{'es' if len(gone) > 1 else ''} {', '.join(gone)} of the checkpoint "
                        f"{'are' if len(gone) > 1 else 'is'} gone from this run")
        entries.append("class:dropped")
    new_keys = [n for n in classes.names if n not in saved and n not in carry.renames]
    if len(gone) == 1 and len(new_keys) == 1:  # one class for another: most likely a renamed budget or bin
        entries = [e for e in entries if e not in ("class:new", "class:dropped")] + [f"class:{gone[0]}={new_keys[0]}"]
    if problems:
        raise ConstraintStateMismatch(
            f"the budget classes differ: the checkpoint has {', '.join(saved) or 'none'}, this run "
            f"{', '.join(classes.names)}: {'; '.join(problems)}", list(dict.fromkeys(entries)), drop)
    return plan


def _show(budgets: Sequence[float]) -> str:
    return "[" + ", ".join(f"{b:g}" for b in budgets) + "]"


def tail_key(tail_budget: float, share: float) -> str:
    """The key of a tail constraint: its B_tail and q."""
    return f"B_tail={tail_budget:g},q={share:g}"


def tail_state_problem(state: Any) -> tuple[str, Any, str] | None:
    """What is wrong with a saved :meth:`TailConstraint.state_dict`: ``(key, value, allowed)``, or None."""
    if not isinstance(state, Mapping):
        return "", state, "a mapping {tail_budget, share, dual}"
    for key, allowed in (("tail_budget", "a finite number > 0"), ("share", "a number in (0, 1)")):
        v = state.get(key, "(missing)")
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        if not ok or (key == "share" and v >= 1):
            return key, v, allowed
    problem = dual_state_problem(state.get("dual"))
    if problem is not None:
        return (f"dual.{problem[0]}" if problem[0] else "dual"), problem[1], problem[2]
    return None


def load_lambda_state(shaper: str, dual: Any, state: Mapping[str, Any], carry: CarryOver, strict: bool = True) -> None:
    """Restore lambda's controller ``dual`` (None: this run has none) from a checkpoint's trainer ``state`` (its
    ``shaper`` entry, :func:`~laconic_nemo.core.dual.load_shaper_state`; ValueError for another shaper or a setting
    that differs with ``strict``).

    A checkpoint that holds no state of lambda's controller while this run has one (the checkpoint trained with
    per-prompt budgets: a multiplier per budget class instead) is refused (:class:`ConstraintStateMismatch`, naming
    the classes whose multipliers this run drops) unless ``carry.lam`` says where lambda starts: "reset" at
    lambda_init, or a checkpoint class key with that class's multiplier (clipped into this run's settings). The
    entry offered: ``class:K=lambda`` for a class K that holds exactly the budget of lambda's controller, else
    ``lambda:reset``."""
    entry = state.get("shaper") if isinstance(state.get("shaper"), Mapping) else {}
    if dual is None or "dual" in entry or entry.get("shaper") != shaper:
        load_shaper_state(shaper, dual, entry, strict=strict)
        return
    classes = (state.get("constraints") or {}).get("classes")
    saved = {} if classes is None else saved_classes(classes)
    if carry.lam == "reset":
        return
    if carry.lam in saved:
        dual.load_state_dict(saved[carry.lam]["dual"], strict=False)
        return
    problems, drop = [], []
    if carry.lam is not None:
        problems.append(f"class:{carry.lam}={CarryOver.LAMBDA} names class {carry.lam}, which the checkpoint lacks")
        drop.append(f"class:{carry.lam}={CarryOver.LAMBDA}")
    dropped = (f"trained with per-prompt budgets: this run drops the multipliers of its budget classes "
               f"{', '.join(saved)}" if saved else "it trained without one")
    problems.insert(0, f"lambda's controller (budget {dual.budget:g}) is new: the checkpoint holds no state of it "
                       f"({dropped})")
    same = [f"class:{k}={CarryOver.LAMBDA}" for k, v in saved.items() if [float(b) for b in v["budgets"]] == [dual.budget]]
    raise ConstraintStateMismatch("; ".join(problems), same[:1] or ["lambda:reset"], drop)

