"""Constraints beyond the mean length: a reasoning-only length, per-prompt budgets with one multiplier per budget
class, and a tail constraint on the share of long responses, each with its own dual variable (docs/algorithm.md,
"Constraints beyond the mean").

A constraint is (what it measures per response, the reward term it subtracts, a dual variable with its own eta /
ceiling / floor, the global statistic its dual step reads):

- **reasoning-only length** (:func:`reasoning_lengths`): L is the number of response tokens before the first
  occurrence of the end-of-reasoning marker's token sequence; a response that never closes its reasoning is
  charged in full. It replaces L everywhere L is used (every shaper, the dual step).
- **budget classes** (:class:`BudgetClasses`): response i is priced against its prompt's budget B_i,
  ``c_i = max((L_i - B_i) / B_i, 0)``, and ``l_i = r_i - lambda_{k(i)} c_i`` with k(i) the class of B_i. The dual
  step of class k reads the class's global length ratio ``rho_k = (1 / n_k) sum_{i in k} L_i / B_i``
  (``mean_L / B_k`` when the class has one budget): ``lambda_k <- clip(lambda_k + eta (rho_k - 1), floor,
  Lambda_k)``. A class with no response in a batch keeps its multiplier.
- **band** (:class:`~laconic_nemo.core.band.Band`, ``laconic.band``): beside each class's upper bound a lower bound
  ``B_lo = rho B`` with its own multiplier lambda_lo, moved from the same global ratio,
  ``lambda_lo <- clip(lambda_lo + eta (1 - rho_k / rho), 0, Lambda)``, and the reward term
  ``- lambda_lo max((B_lo - L_i) / B_lo, 0)``; without per-prompt budgets the run's one budget is the one class
  (its lambda_lo reads the global mean length). Saved with its class, under the class's key.
- **tail** (:class:`TailConstraint`): the share of responses longer than B_tail at most q. Reward term
  ``- mu 1[L_i > B_tail]``; dual step ``mu <- clip(mu + eta_tail (s / q - 1), 0, M)`` with s the global share.

Every statistic a dual step reads comes from integer counts all-reduced over the data-parallel group (the sum of
L per distinct budget, the responses per distinct budget, the responses in the tail), combined in a fixed order in
Python floats, so every rank (and every layout: DP 2 gives what DP 1 gives) computes the same multipliers bit for
bit. The counts of one rank are :func:`local_counts` ([2 D + 2] int64: sums and counts per distinct budget, tail
count, responses); :func:`class_ratios` and :func:`tail_share` read the all-reduced vector.

**Saved state, keyed by what it belongs to.** :meth:`BudgetClasses.state_dict` keys each class's multiplier by
the class (its budget ``"500"`` or its bin ``"500-1000"``, :func:`class_name`) together with the budgets it
holds; :meth:`TailConstraint.state_dict` holds B_tail and q beside mu. A resume maps saved to current classes by
key (:func:`match_classes`), never by position: a class the checkpoint lacks, one it has and this run lacks, a
renamed class or a class whose budgets changed is refused (:class:`ConstraintStateMismatch`, naming the keys)
unless a :class:`CarryOver` says how to carry the state over (``checkpoint.resume_allow_changes`` entries
``class:new``, ``class:dropped``, ``class:budgets``, ``class:OLD=NEW``, ``tail:carry``, ``tail:reset``; parsed by
:meth:`CarryOver.parse`). The state of older checkpoints (one list of multipliers beside the list of class names)
is read when it is unambiguous: as many multipliers as names, and the names those its own budgets and bin edges
give. :func:`classes_state_problem` and :func:`tail_state_problem` name a bad value inside a saved state (key,
value, allowed) without a run to load it into. The saved-state functions live in
:mod:`laconic_nemo.core.constraint_state` and are importable from here.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any, Mapping, Sequence

import torch

from laconic_nemo.core.band import Band, LowerBound
from laconic_nemo.core.constraint_state import (
    CarryOver,
    ConstraintStateMismatch,
    class_name,
    classes_state_problem,
    match_classes,
    saved_classes,
    tail_key,
    tail_state_problem,
)
from laconic_nemo.core.costs import band_cost64, per_prompt_cost64
from laconic_nemo.core.dual import DualController, DualSettings, next_lambda
from laconic_nemo.core.shapers import constant_lambda, lambda_controller

__all__ = ["Band", "BudgetClasses", "LowerBound", "CarryOver", "ConstraintStateMismatch", "Constraints", "TailConstraint", "WITHIN",
           "class_name", "class_report", "classes_state_problem", "find_marker", "local_counts", "match_classes",
           "per_prompt_cost64", "reasoning_lengths", "report_counts", "saved_classes", "tail_state_problem"]


# ------------------------------------------------------------------------------------------------------------------
# reasoning-only length
# ------------------------------------------------------------------------------------------------------------------
def find_marker(response: Sequence[int], marker: Sequence[int]) -> int:
    """The index of the first occurrence of the token sequence ``marker`` in ``response``, or -1."""
    m, n = len(marker), len(response)
    if m == 0:
        raise ValueError("the end-of-reasoning marker encodes to no token")
    first = marker[0]
    for i in range(n - m + 1):
        if response[i] == first and list(response[i:i + m]) == list(marker):
            return i
    return -1


def reasoning_lengths(tokens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                      marker: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reasoning span's length of each response: its tokens before the first ``marker`` sequence.

    A response without the marker is charged in full (its whole length). The marker's own tokens and the answer
    after them are not counted.

    Args:
        tokens: [N, T] int, prompt then response (then padding) per row.
        prompt_lengths: [N] int. response_lengths: [N] int, the response's tokens (EOS excluded) to search.
        marker: the marker's token ids (non-empty).

    Returns:
        (L_reason [N] int64, closed [N] bool: True where the marker was found).
    """
    marker = [int(t) for t in marker]
    rows = tokens.tolist()
    out, closed = [], []
    for row, p, r in zip(rows, prompt_lengths.tolist(), response_lengths.tolist()):
        at = find_marker(row[p:p + r], marker)
        out.append(r if at < 0 else at)
        closed.append(at >= 0)
    return torch.tensor(out, dtype=torch.long), torch.tensor(closed, dtype=torch.bool)


# ------------------------------------------------------------------------------------------------------------------
# per-prompt budgets and their classes
# ------------------------------------------------------------------------------------------------------------------
class BudgetClasses:
    """The budget classes of a run and one multiplier lambda_k per class.

    Args:
        budgets: every budget a prompt of the run can have (the dataset's B_i, the stated targets), each a
            finite number > 0; the distinct ones, sorted, are the key space of the all-reduced counts.
        edges: bin edges ``e_0 < e_1 < ... < e_K`` (K classes ``[e_k, e_{k+1})``, the last one closed), or None:
            one class per distinct budget. Every budget must fall in a bin and every bin must hold a budget.
        dual: the settings of every class's controller (lambda's, :class:`~laconic_nemo.core.dual.DualSettings`;
            its budget is not used: a class's controller reads the ratio rho_k against 1); ceiling None:
            ``Lambda_k = b / (L_max - b)`` with b the class's smallest budget (the paper's ceiling for the largest
            cost of the class), which needs L_max = ``dual.max_length`` > b.
        band: the band's settings (:class:`~laconic_nemo.core.band.Band`): one lower bound ``rho b`` per class
            beside its upper bound, lambda_lo's eta and ceiling defaulting to the class's; None: no band.
        **settings: instead of ``dual``, its fields by name (eta, ceiling, max_length, lambda_init, ...).
    """

    def __init__(self, budgets: Sequence[float], edges: Sequence[float] | None, dual: DualSettings | None = None,
                 band: Band | None = None, **settings: Any):
        if dual is None:
            dual = DualSettings(budget=1.0, **settings)
        elif settings:
            raise TypeError("BudgetClasses takes the controller settings as dual or by name, not both")
        ceiling, max_length = dual.ceiling, dual.max_length
        values = sorted({float(b) for b in budgets})
        if not values:
            raise ValueError("per-prompt budgets: no budget given")
        for b in values:
            if not (math.isfinite(b) and b > 0):
                raise ValueError(f"per-prompt budgets must be finite numbers > 0, got {b!r}")
        self.budgets = values                              # the D distinct budgets, sorted
        self.edges = None if edges is None else [float(e) for e in edges]
        if self.edges is None:
            members = [[j] for j in range(len(values))]
            self.names = [class_name(b) for b in values]
        else:
            e = self.edges
            if len(e) < 2 or any(not (a < b) for a, b in zip(e, e[1:])):
                raise ValueError(f"budget_classes must be at least two strictly increasing bin edges, got {e}")
            members = [[] for _ in range(len(e) - 1)]
            for j, b in enumerate(values):
                k = self._bin(b)
                if k is None:
                    raise ValueError(f"budget {b:g} lies outside the budget classes' bins [{e[0]:g}, {e[-1]:g}]")
                members[k].append(j)
            for k, m in enumerate(members):
                if not m:
                    raise ValueError(f"budget class [{e[k]:g}, {e[k + 1]:g}) holds no budget of the run "
                                     f"(budgets {', '.join(f'{b:g}' for b in values)})")
            self.names = [class_name(e[k], e[k + 1]) for k in range(len(members))]
        self.members = members                             # class k -> indices into self.budgets
        self.class_of_budget = [0] * len(values)
        for k, m in enumerate(members):
            for j in m:
                self.class_of_budget[j] = k
        self.duals = []
        for m in members:
            lam_ceiling = ceiling
            if lam_ceiling is None and max_length is not None:
                b = values[m[0]]
                if not max_length > b:
                    raise ValueError(f"budget {b:g} must be < L_max = {max_length:g} for the default ceiling")
                lam_ceiling = b / (max_length - b)
            # the controller's error is rho_k - 1: its "budget" is 1 and it reads the ratio rho_k as the mean
            self.duals.append(dataclasses.replace(dual, budget=1.0, ceiling=lam_ceiling, max_length=None).build())
        self.band = band
        # the band's lambda_lo per class (None: no band), its eta and ceiling by default the class's
        self.lower: list[LowerBound] | None = None if band is None else [band.lower(d.eta, d.ceiling)
                                                                           for d in self.duals]

    def _bin(self, b: float) -> int | None:
        e = self.edges
        if b < e[0] or b > e[-1]:
            return None
        return min(bisect.bisect_right(e, b) - 1, len(e) - 2)

    def __len__(self) -> int:
        return len(self.members)

    def budget_index(self, budgets: torch.Tensor) -> torch.Tensor:
        """[...] budgets -> [...] int64 index into the distinct budgets (a budget not of the run: ValueError)."""
        table = torch.tensor(self.budgets, dtype=torch.float64)
        b = budgets.to(torch.float64)
        idx = torch.searchsorted(table, b.reshape(-1)).clamp_max(len(self.budgets) - 1).view(b.shape)
        if not torch.equal(table[idx], b):
            bad = b[table[idx] != b].reshape(-1)[0].item()
            raise ValueError(f"budget {bad:g} is not one of the run's budgets")
        return idx

    def class_index(self, budgets: torch.Tensor) -> torch.Tensor:
        """[...] budgets -> [...] int64 class index."""
        return torch.tensor(self.class_of_budget, dtype=torch.long)[self.budget_index(budgets)]

    def multipliers(self, budgets: torch.Tensor) -> torch.Tensor:
        """[...] float64: each response's lambda_{k(i)} (the multipliers of this step)."""
        lam = torch.tensor([d.value for d in self.duals], dtype=torch.float64)
        return lam[self.class_index(budgets)]

    def multipliers_lo(self, budgets: torch.Tensor) -> torch.Tensor:
        """[...] float64: each response's lambda_lo of its class (the band; this step's)."""
        lam = torch.tensor([lo.value for lo in self.lower], dtype=torch.float64)
        return lam[self.class_index(budgets)]

    def band_penalty64(self, lengths: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """[...] float64 band term ``lambda_lo,k(i) max((rho B_i - L_i) / (rho B_i), 0)`` (lengths, budgets [...])."""
        return self.multipliers_lo(budgets) * band_cost64(lengths.to(torch.float64),
                                                          self.band.rho * budgets.to(torch.float64))

    def ratios(self, counts: Sequence[int]) -> list[float | None]:
        """Each class's global length ratio ``rho_k = (1 / n_k) sum_b S_b / b`` from the all-reduced counts
        (``counts[:D]`` the sums S_b of L per distinct budget b, ``counts[D:2D]`` the responses n_b); None for a
        class without a response. Python floats in a fixed order: the same on every rank and every layout."""
        D = len(self.budgets)
        sums, ns = [int(c) for c in counts[:D]], [int(c) for c in counts[D:2 * D]]
        out: list[float | None] = []
        for m in self.members:
            n = sum(ns[j] for j in m)
            if n == 0:
                out.append(None)
                continue
            total = 0.0
            for j in m:
                total += sums[j] / self.budgets[j]
            out.append(total / n)
        return out

    def update(self, counts: Sequence[int]) -> list[float | None]:
        """One dual step per class with a response: ``lambda_k <- clip(lambda_k + eta (rho_k - 1), floor,
        Lambda_k)`` and, with the band, ``lambda_lo,k <- clip(lambda_lo,k + eta_lo (1 - rho_k / rho), 0,
        Lambda_lo)``; a class without a response keeps its multipliers. Returns the ratios rho_k."""
        rho = self.ratios(counts)
        for k, (d, r) in enumerate(zip(self.duals, rho)):
            if r is not None:
                d.update(r)
                if self.lower is not None:
                    self.lower[k].update(r)
        return rho

    def values(self) -> list[float]:
        return [d.value for d in self.duals]

    def values_lo(self) -> list[float] | None:
        """Each class's lambda_lo (None without the band)."""
        return None if self.lower is None else [lo.value for lo in self.lower]

    def class_budgets(self, k: int) -> list[float]:
        """The budgets of class ``k``, sorted."""
        return [self.budgets[j] for j in self.members[k]]

    def state_dict(self) -> dict[str, Any]:
        """``{"edges": [...] | None, "classes": {key: {"budgets": [...], "dual": controller state}}}``, each class
        under its key (:func:`class_name`: its budget, or its bin); with the band each class's entry holds its
        lower bound too, ``"band": {"rho": rho, "dual": lambda_lo's state}``."""
        classes = {}
        for k, (name, d) in enumerate(zip(self.names, self.duals)):
            classes[name] = {"budgets": self.class_budgets(k), "dual": d.state_dict()}
            if self.lower is not None:
                classes[name]["band"] = self.lower[k].state_dict()
        return {"edges": None if self.edges is None else list(self.edges), "classes": classes}

    def load_state_dict(self, state: Mapping[str, Any] | None, strict: bool = True,
                        carry: "CarryOver | None" = None) -> None:
        """Restore each class's multiplier from the saved class of the same key (:func:`match_classes`; ``carry``
        says how to carry over classes that differ, default: refuse every difference; ``state`` None: a checkpoint
        without classes). A class that takes no saved state starts at lambda_init. With the band, a class's
        lambda_lo comes with its class's saved state; a saved class without one (a run that turned the band on, a
        config change that only a non-strict resume accepts) starts lambda_lo at 0. Raises
        :class:`ConstraintStateMismatch` (the keys that differ) or ValueError (a bad saved value, or settings that
        differ with ``strict``)."""
        saved = {} if state is None else saved_classes(state)
        plan = match_classes(saved, self, carry or CarryOver())
        for k, (name, d) in enumerate(zip(self.names, self.duals)):
            source = plan[name]
            if source is None:
                continue
            # a class carried over from another key or other budgets keeps this run's settings (its default
            # ceiling follows its budgets), the multiplier clipped into them
            same = source == name and [float(b) for b in saved[source]["budgets"]] == self.class_budgets(k)
            d.load_state_dict(saved[source]["dual"], strict=strict and same)
            if self.lower is not None:
                band = saved[source].get("band")
                if band is not None:
                    self.lower[k].load_state_dict(band, strict=strict and same)
                elif strict:
                    raise ValueError(f"budget class {name}: the checkpoint holds no band state (laconic.band), this "
                                     f"run has band {self.band.rho:g}")


# ------------------------------------------------------------------------------------------------------------------
# tail constraint
# ------------------------------------------------------------------------------------------------------------------
class TailConstraint:
    """The share of responses longer than ``tail_budget`` (B_tail) at most ``share`` (q in (0, 1)), with the
    multiplier mu: reward term ``- mu 1[L > B_tail]``, dual step ``mu <- clip(mu + eta (s / q - 1), 0, ceiling)``
    with s the global share of the batch (from all-reduced integer counts)."""

    def __init__(self, tail_budget: float, share: float, eta: float, ceiling: float, init: float = 0.0):
        if not (math.isfinite(float(tail_budget)) and tail_budget > 0):
            raise ValueError(f"tail_budget must be a finite number > 0, got {tail_budget!r}")
        if not 0.0 < float(share) < 1.0:
            raise ValueError(f"tail_share must be in (0, 1), got {share!r}")
        self.tail_budget, self.share = float(tail_budget), float(share)
        self.dual = DualController(self.share, eta, ceiling=ceiling, init=init, floor=0.0)

    @property
    def value(self) -> float:
        return self.dual.value

    def in_tail(self, lengths: torch.Tensor) -> torch.Tensor:
        """[...] bool: L > B_tail."""
        return lengths.to(torch.float64) > self.tail_budget

    def penalty64(self, lengths: torch.Tensor, mu: float) -> torch.Tensor:
        """[...] float64: ``mu 1[L > B_tail]``."""
        return mu * self.in_tail(lengths).to(torch.float64)

    @staticmethod
    def global_share(tail_count: int, n: int) -> float:
        """s = tail responses / responses (Python float of two all-reduced integers)."""
        return int(tail_count) / int(n)

    def update(self, tail_count: int, n: int) -> float:
        """The dual step on the global share; returns the share s."""
        s = self.global_share(tail_count, n)
        self.dual.update(s)
        return s

    @property
    def key(self) -> str:
        """What the constraint is: ``B_tail=<B_tail>,q=<q>`` (its saved state is keyed by these settings)."""
        return tail_key(self.tail_budget, self.share)

    def state_dict(self) -> dict[str, Any]:
        return {"tail_budget": self.tail_budget, "share": self.share, "dual": self.dual.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any] | None, strict: bool = True, carry: str | None = None
                        ) -> None:
        """Restore mu from the saved tail constraint of the same B_tail and q. One with other settings, or none
        (``state`` None): refused (:class:`ConstraintStateMismatch`) unless ``carry`` is "carry" (keep the saved mu,
        clipped into this run's range; not for a missing state) or "reset" (mu stays at its initial value)."""
        settings = None if state is None else (float(state["tail_budget"]), float(state["share"]))
        saved = None if settings is None else tail_key(*settings)
        if settings != (self.tail_budget, self.share):
            if carry == "reset" or (carry == "carry" and saved is not None):
                if carry == "carry":
                    self.dual.load_state_dict(state["dual"], strict=False)
                return
            what = "no tail constraint" if saved is None else f"the tail constraint {saved}"
            raise ConstraintStateMismatch(
                f"the tail constraint differs: the checkpoint has {what}, this run {self.key}",
                ["tail:reset"] if saved is None else ["tail:carry", "tail:reset"],
                drop=["tail:carry"] if carry == "carry" else [])  # nothing to carry
        self.dual.load_state_dict(state["dual"], strict=strict)


def local_counts(lengths: torch.Tensor, budget_index: torch.Tensor | None, num_budgets: int,
                 tail: TailConstraint | None) -> list[int]:
    """One rank's integer counts for the dual steps: [S_0..S_{D-1}, n_0..n_{D-1}, tail count, responses].

    lengths: [N] int L; budget_index: [N] int64 index of each response's budget among the run's D distinct
    budgets (None: no classes, D = 0). All-reduce (sum) the list over the data-parallel group."""
    L = lengths.to(torch.long).reshape(-1)
    out: list[int] = []
    if budget_index is not None:
        idx = budget_index.reshape(-1)
        out += torch.zeros(num_budgets, dtype=torch.long).index_add_(0, idx, L).tolist()
        out += torch.bincount(idx, minlength=num_budgets).tolist()
    out.append(int(tail.in_tail(L).sum()) if tail is not None else 0)
    out.append(int(L.numel()))
    return out


# ------------------------------------------------------------------------------------------------------------------
# per-class report: how each budget class's responses sit against their budgets (every shaper with per-prompt budgets)
# ------------------------------------------------------------------------------------------------------------------
WITHIN = 0.1  # "within 10%" of a budget: |L - B| <= 0.1 B


def report_counts(lengths: torch.Tensor, correct: torch.Tensor, budget_index: torch.Tensor,
                  budgets: Sequence[float], band: float | None = None) -> list[int]:
    """One rank's integer counts per distinct budget b of ``budgets`` (D of them): [S_b (sum of L), n_b, within_b
    (``|L - b| <= 0.1 b``), over_b (``L > b``), correct_b], D entries each, 5 D in all, and with ``band`` (rho)
    in_band_b (``rho b <= L <= b``) after them, 6 D; all-reduce (sum) them.

    lengths: [N] int L; correct: [N] bool; budget_index: [N] int64 index of each response's budget in ``budgets``."""
    L = lengths.to(torch.long).reshape(-1)
    idx = budget_index.reshape(-1)
    b = torch.tensor([float(x) for x in budgets], dtype=torch.float64)[idx]
    D = len(budgets)

    def per_budget(values: torch.Tensor) -> list[int]:
        return torch.zeros(D, dtype=torch.long).index_add_(0, idx, values.to(torch.long)).tolist()

    Lf = L.to(torch.float64)
    out = (per_budget(L) + per_budget(torch.ones_like(L)) + per_budget((Lf - b).abs() <= WITHIN * b)
           + per_budget(Lf > b) + per_budget(correct.reshape(-1)))
    return out if band is None else out + per_budget((Lf >= band * b) & (Lf <= b))


def class_report(classes: BudgetClasses, counts: Sequence[int]) -> dict[str, dict[str, float]]:
    """Per class with a response, from the all-reduced :func:`report_counts`: length_ratio (the class's mean of
    L_i / B_i, as its dual step reads it), within_10, over_budget and pass@1 (shares of its responses), and
    in_band (``rho B <= L <= B``) where the counts hold the band's (6 D of them)."""
    D = len(classes.budgets)
    c = [int(x) for x in counts]
    sums, ns, within, over, correct = (c[i * D:(i + 1) * D] for i in range(5))
    in_band = c[5 * D:6 * D] if len(c) == 6 * D else None
    out: dict[str, dict[str, float]] = {}
    for name, m, ratio in zip(classes.names, classes.members, classes.ratios(sums + ns)):
        if ratio is None:
            continue
        n = sum(ns[j] for j in m)
        out[name] = {"length_ratio": ratio, "within_10": sum(within[j] for j in m) / n,
                     "over_budget": sum(over[j] for j in m) / n, "pass@1": sum(correct[j] for j in m) / n}
        if in_band is not None:
            out[name]["in_band"] = sum(in_band[j] for j in m) / n
    return out


# ------------------------------------------------------------------------------------------------------------------
# the run's constraints, one object
# ------------------------------------------------------------------------------------------------------------------
class Constraints:
    """The Lagrangian constraints of a run and their multipliers: the mean-length controller (lambda, or the
    shaper's constant lambda), the budget classes, the tail constraint and the end-of-reasoning marker. The trainer
    and ``plan`` build it with :meth:`build`; one GRPO step reads it three times: :meth:`lengths` (L as the
    constraints see it), :meth:`penalties` (each response's multiplier and tail term for the shaper) and, after
    the all-reduce of :meth:`counts`, :meth:`step` (every dual step, and the metrics).

    dual: lambda's controller (None: a shaper without one, or per-prompt budgets). constant: lambda without a
    controller. classes / tail / marker: None where the recipe does not ask for them (marker: its token ids).
    band, budget: the band's lower bound of the mean-length constraint and its budget B (a run without per-prompt
    budgets; the classes hold their own); None without the band.
    """

    def __init__(self, dual: DualController | None, constant: float, classes: BudgetClasses | None,
                 tail: TailConstraint | None, marker: Sequence[int] | None, band: LowerBound | None = None,
                 budget: float | None = None):
        self.dual, self.constant = dual, constant
        self.classes, self.tail = classes, tail
        self.marker = None if marker is None else [int(t) for t in marker]
        if band is not None and not (budget is not None and budget > 0):
            raise ValueError(f"the band of the mean-length constraint needs its budget B > 0, got {budget!r}")
        self.band, self.budget = band, budget

    @classmethod
    def build(cls, settings: Any, max_length: float, budgets: Sequence[float] | None = None,
              marker: Sequence[int] | None = None) -> "Constraints":
        """The constraints of the ``laconic:`` settings (``LaconicConfig``: shaper, the controller settings,
        per_prompt_budget, budget_classes, tail_*) with L_max = ``max_length``. ``budgets``: every budget a prompt
        of the run can have (per-prompt budgets; None: the classes are not built, as ``plan`` without the data
        files). ``marker``: the end-of-reasoning marker's token ids (None: L counts the whole response). The band
        (``laconic.band``): a lower bound per class, or of the mean-length constraint without per-prompt budgets
        (it needs lambda's controller there: an adaptive shaper)."""
        s = settings
        band = Band.of(s)
        lower = None
        if s.per_prompt_budget:  # one multiplier per budget class instead of lambda (lambda is then 0)
            dual, constant = None, 0.0
            classes = None if budgets is None else BudgetClasses(budgets, s.budget_classes,
                                                                 DualSettings.of(s, max_length), band=band)
        else:
            dual, constant, classes = lambda_controller(s, max_length), constant_lambda(s), None
            if band is not None:
                if dual is None:
                    raise ValueError(f"laconic.band needs a shaper with a dual step (laconic, linear), got "
                                     f"laconic.shaper = {s.shaper!r}")
                lower = band.lower(dual.eta, dual.ceiling)
        tail = None if s.tail_budget is None else TailConstraint(s.tail_budget, s.tail_share, s.tail_eta,
                                                                 s.tail_ceiling, s.tail_init)
        return cls(dual, constant, classes, tail, marker, lower, None if lower is None else float(s.budget))

    @property
    def lam(self) -> float:
        """lambda of the next step: the controller's, or the shaper's constant."""
        return self.dual.value if self.dual is not None else self.constant

    @property
    def beyond_mean(self) -> bool:
        """Any constraint beyond the mean is on (its counts ride on the step's all-reduce)."""
        return self.marker is not None or self.classes is not None or self.tail is not None

    def lengths(self, lengths: torch.Tensor, tokens: torch.Tensor, prompt_lengths: torch.Tensor,
                response_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """L as the constraints see it: [N] ``lengths``, or with the marker the reasoning span's length where the
        response closes it (:func:`reasoning_lengths`; tokens [N, T]). Returns (L [N], closed [N] bool or None)."""
        if self.marker is None:
            return lengths, None
        span, closed = reasoning_lengths(tokens, prompt_lengths, response_lengths, self.marker)
        return torch.where(closed, span, lengths), closed

    def penalties(self, lengths: torch.Tensor, budgets: torch.Tensor | None, G: int
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What the shaper takes of this step's multipliers, grouped [P, G]: each response's class multiplier
        lambda_k(i) (float64, None without classes) and the tail term ``mu 1[L > B_tail]`` (None without a tail
        constraint). lengths / budgets: [N]."""
        lams = None if self.classes is None else self.classes.multipliers(budgets).view(-1, G)
        tail = None if self.tail is None else self.tail.penalty64(lengths, self.tail.value).view(-1, G)
        return lams, tail

    def band_penalty(self, lengths: torch.Tensor, budgets: torch.Tensor | None, G: int) -> torch.Tensor | None:
        """The band's reward term grouped [P, G], float64: ``lambda_lo max((B_lo - L) / B_lo, 0)`` with each
        response's class lambda_lo and ``B_lo = rho B_i`` (per-prompt budgets ``budgets`` [N]), or lambda_lo of
        the mean-length constraint and ``B_lo = rho B``; None without the band. lengths: [N]."""
        L64 = lengths.to(torch.float64)
        if self.band is not None:
            return (self.band.value * self.band.cost64(L64, self.budget)).view(-1, G)
        if self.classes is not None and self.classes.lower is not None:
            return self.classes.band_penalty64(L64, budgets).view(-1, G)
        return None

    def counts(self, lengths: torch.Tensor, budgets: torch.Tensor | None, closed: torch.Tensor | None) -> list[int]:
        """This rank's integer counts of the constraints beyond the mean, to all-reduce: per distinct budget (sum
        of L, responses), tail count, responses (:func:`local_counts`), then the responses that closed their
        reasoning. Empty when there is no such constraint."""
        if not self.beyond_mean:
            return []
        c = self.classes
        out = local_counts(lengths, None if c is None else c.budget_index(budgets), 0 if c is None else len(c.budgets),
                           self.tail)
        return out + [int(closed.sum()) if closed is not None else 0]

    def step(self, global_mean_length: float, counts: Sequence[int]) -> tuple[float, float, dict[str, Any]]:
        """Every dual step of the step, from the all-reduced statistics (the same integers on every rank, so the
        same multipliers bit for bit): lambda's on ``global_mean_length``, then each budget class's and the tail
        constraint's on ``counts`` (the all-reduced :meth:`counts`). A class without a response keeps its
        multiplier (its ratio is null). The band's lambda_lo moves on the same ratio as its class's multiplier
        (without classes: ``global_mean_length / B``). Returns (lambda used, lambda next, the constraints' metrics:
        each multiplier used this step and its constraint's measured value)."""
        lam_used = self.lam
        lam_next = next_lambda(self.dual, lam_used, global_mean_length)
        out: dict[str, Any] = {}
        if self.band is not None:
            out["laconic/lambda_lo"] = self.band.value
            self.band.update(global_mean_length / self.budget)
        if not self.beyond_mean:
            return lam_used, lam_next, out
        c = self.classes
        if c is not None:
            used, used_lo = c.values(), c.values_lo()
            ratios = c.update(list(counts[:-3]))
            for k, (name, lam_k, rho) in enumerate(zip(c.names, used, ratios)):
                out[f"laconic/lambda/class_{name}"] = lam_k
                out[f"laconic/length_ratio/class_{name}"] = rho
                if used_lo is not None:
                    out[f"laconic/lambda_lo/class_{name}"] = used_lo[k]
        tail_count, n, closed = counts[-3], counts[-2], counts[-1]
        if self.tail is not None:
            out["laconic/mu_tail"] = self.tail.value
            out["laconic/tail_share"] = self.tail.update(tail_count, n)
        if self.marker is not None:
            out["laconic/reasoning_length_mean"] = global_mean_length
            out["laconic/reasoning_closed_share"] = closed / n
        return lam_used, lam_next, out

    def state_dict(self) -> dict[str, Any] | None:
        """The ``constraints`` entry of a checkpoint's trainer state (classes by key, the tail by its settings, the
        mean-length constraint's band under ``band`` with its budget), or None without any of them (lambda's state
        is the ``shaper`` entry, :func:`~laconic_nemo.core.shaper_state`)."""
        if self.classes is None and self.tail is None and self.band is None:
            return None
        out = {"classes": None if self.classes is None else self.classes.state_dict(),
               "tail": None if self.tail is None else self.tail.state_dict()}
        if self.band is not None:
            out["band"] = {"budget": self.budget, **self.band.state_dict()}
        return out

    def load_band_state(self, state: Mapping[str, Any] | None, strict: bool = True) -> None:
        """Restore the mean-length constraint's lambda_lo from a :meth:`state_dict`'s ``band`` entry (None: a
        checkpoint without the band; with ``strict`` refused, else lambda_lo starts at 0). With ``strict`` a saved
        budget or band setting other than this run's is a ValueError naming it."""
        if self.band is None:
            return
        if state is None:
            if strict:
                raise ValueError(f"the checkpoint holds no band state (laconic.band), this run has band "
                                 f"{self.band.rho:g}")
            return
        saved = state.get("budget")
        if strict and saved != self.budget:
            raise ValueError(f"band state mismatch on 'budget' (laconic.budget): checkpoint has {saved!r}, this run "
                             f"has {self.budget!r}")
        self.band.load_state_dict({k: v for k, v in state.items() if k != "budget"}, strict=strict)
