"""Constraints beyond the mean (core/constraints.py): the reasoning span cut at the marker, per-prompt costs and
budget classes with one multiplier each, the tail constraint; against hand-worked values and float64
re-implementations written here, and the reductions split over two "ranks" equal to one."""

import math
import random

import pytest
import torch

from laconic_nemo.core import (
    BudgetClasses,
    Shaper,
    TailConstraint,
    class_report,
    local_counts,
    per_prompt_cost64,
    reasoning_lengths,
    report_counts,
    shape,
)
from laconic_nemo.core.constraints import (
    CarryOver,
    ConstraintStateMismatch,
    classes_state_problem,
    find_marker,
    saved_classes,
    tail_state_problem,
)


# ------------------------------------------------------------------ reasoning span
def _rows(prompts, responses, pad=0):
    T = max(len(p) + len(r) for p, r in zip(prompts, responses)) + 2
    rows = [p + r + [pad] * (T - len(p) - len(r)) for p, r in zip(prompts, responses)]
    return (torch.tensor(rows), torch.tensor([len(p) for p in prompts]), torch.tensor([len(r) for r in responses]))


def test_reasoning_span_cut_at_marker_hand_values():
    marker = [7, 8]
    prompts = [[1, 2], [1], [3, 3, 3], [1, 7, 8]]
    responses = [
        [4, 5, 7, 8, 9],      # marker at 2: L = 2 (the answer 9 and the marker itself are not charged)
        [4, 7, 4, 7, 8],      # a lone 7 before the marker: L = 3
        [4, 5, 6],            # never closes its reasoning: charged in full, 3
        [7, 8, 4, 7, 8],      # marker in the prompt is not searched; first at 0 in the response: L = 0
    ]
    L, closed = reasoning_lengths(*_rows(prompts, responses), marker)
    assert L.tolist() == [2, 3, 3, 0]
    assert closed.tolist() == [True, True, False, True]


def test_reasoning_span_ignores_tokens_after_response_end():
    # the marker sits in the padding after the response (past response_lengths): not counted as closing
    tokens = torch.tensor([[1, 4, 5, 7, 8]])
    L, closed = reasoning_lengths(tokens, torch.tensor([1]), torch.tensor([2]), [7, 8])
    assert L.tolist() == [2] and closed.tolist() == [False]
    # a marker cut by the response's end is not a marker either
    L, closed = reasoning_lengths(tokens, torch.tensor([1]), torch.tensor([3]), [7, 8])
    assert L.tolist() == [3] and closed.tolist() == [False]


def test_find_marker_matches_a_string_search():
    rng = random.Random(0)
    for _ in range(300):
        resp = [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
        marker = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
        # the same search on text: each token a letter
        text, m = "".join("abcd"[t] for t in resp), "".join("abcd"[t] for t in marker)
        assert find_marker(resp, marker) == text.find(m)
    with pytest.raises(ValueError, match="no token"):
        find_marker([1, 2], [])


# ------------------------------------------------------------------ per-prompt cost and classes
def test_per_prompt_cost_hand_values_and_budget_one():
    L = torch.tensor([[0.0, 1.0, 2.0], [600.0, 400.0, 1000.0]], dtype=torch.float64)
    B = torch.tensor([[1.0, 1.0, 1.0], [500.0, 500.0, 1000.0]], dtype=torch.float64)
    c = per_prompt_cost64(L, B)
    assert c.tolist() == [[0.0, 0.0, 1.0], [0.2, 0.0, 0.0]]
    assert per_prompt_cost64(L, B, linear=True).tolist() == [[-1.0, 0.0, 1.0], [0.2, -0.2, 0.0]]


def _float64_classes(budgets, edges):
    """Independent grouping: class of each distinct budget by a linear scan of the bins."""
    values = sorted(set(budgets))
    if edges is None:
        return {b: i for i, b in enumerate(values)}
    out = {}
    for b in values:
        for k in range(len(edges) - 1):
            last = k == len(edges) - 2
            if edges[k] <= b < edges[k + 1] or (last and b == edges[-1]):
                out[b] = k
                break
    return out


def test_classes_hand_values_with_a_class_without_sample():
    bc = BudgetClasses([500, 1000, 2000], None, eta=0.1, ceiling=1.0)
    assert bc.names == ["500", "1000", "2000"]
    L = torch.tensor([600, 400, 1500, 900])
    B = torch.tensor([500.0, 500.0, 1000.0, 1000.0])
    counts = local_counts(L, bc.budget_index(B), len(bc.budgets), None)
    # S per budget, n per budget, tail count (no tail), responses
    assert counts == [1000, 2400, 0, 2, 2, 0, 0, 4]
    rho = bc.update(counts)
    assert rho == [1.0, 1.2, None]                   # 1000 / (2 * 500), 2400 / (2 * 1000); class 2000 has none
    assert bc.values() == [0.0, pytest.approx(0.02), 0.0]
    bc.duals[2]._lam = 0.5
    bc.update(counts)
    assert bc.values()[2] == 0.5                      # a class without a sample keeps its multiplier


def test_classes_with_bins_ratio_is_mean_of_L_over_B():
    bc = BudgetClasses([500, 700, 1000, 3000], [500, 1000, 4000], eta=0.5, ceiling=10.0)
    assert bc.names == ["500-1000", "1000-4000"]
    assert bc.class_index(torch.tensor([500.0, 700.0, 1000.0, 3000.0])).tolist() == [0, 0, 1, 1]
    L = torch.tensor([600, 700, 500, 1000, 6000])
    B = torch.tensor([500.0, 700.0, 1000.0, 1000.0, 3000.0])
    rho = bc.update(local_counts(L, bc.budget_index(B), len(bc.budgets), None))
    assert rho[0] == pytest.approx((600 / 500 + 700 / 700) / 2)
    assert rho[1] == pytest.approx((500 / 1000 + 1000 / 1000 + 6000 / 3000) / 3)
    assert bc.values() == [pytest.approx(0.5 * (rho[0] - 1)), pytest.approx(0.5 * (rho[1] - 1))]


def test_class_report_hand_values_with_bins_and_a_class_without_sample():
    """Per class: mean of L / B, shares within 10% of B (|L - B| <= 0.1 B, the bound included) and over B, pass@1;
    counts summed over two ranks give the one-rank report."""
    bc = BudgetClasses([500, 700, 1000, 3000, 5000], [500, 1000, 4000, 6000], eta=0.0, ceiling=0.0)
    L = torch.tensor([550, 700, 400, 1100, 2700, 3400])
    B = torch.tensor([500.0, 700.0, 1000.0, 1000.0, 3000.0, 3000.0])
    ok = torch.tensor([True, False, True, True, False, True])
    counts = report_counts(L, ok, bc.budget_index(B), bc.budgets)
    rep = class_report(bc, counts)
    assert set(rep) == {"500-1000", "1000-4000"}  # 4000-6000 has no response this batch
    assert rep["500-1000"] == {"length_ratio": pytest.approx((550 / 500 + 1) / 2), "within_10": 1.0,
                               "over_budget": 0.5, "pass@1": 0.5}
    assert rep["1000-4000"] == {"length_ratio": pytest.approx((0.4 + 1.1 + 0.9 + 3400 / 3000) / 4),
                                "within_10": 0.5, "over_budget": 0.5, "pass@1": 0.75}
    halves = [report_counts(L[s], ok[s], bc.budget_index(B[s]), bc.budgets) for s in (slice(0, 3), slice(3, 6))]
    assert [a + b for a, b in zip(*halves)] == counts


def test_classes_refuse_bad_bins_and_unknown_budgets():
    with pytest.raises(ValueError, match=r"\[1000, 2000\) holds no budget"):
        BudgetClasses([500, 2500], [0, 1000, 2000, 3000], eta=0.1)
    with pytest.raises(ValueError, match="outside"):
        BudgetClasses([500, 5000], [0, 1000, 3000], eta=0.1)
    with pytest.raises(ValueError, match="> 0"):
        BudgetClasses([0, 10], None, eta=0.1)
    bc = BudgetClasses([10, 20], None, eta=0.1)
    with pytest.raises(ValueError, match="not one of the run's budgets"):
        bc.budget_index(torch.tensor([15.0]))


def test_default_class_ceiling_is_the_papers_for_the_smallest_budget():
    bc = BudgetClasses([1, 30, 40], [1, 35, 40], eta=0.1, max_length=96)
    assert [d.ceiling for d in bc.duals] == [1 / 95, 40 / 56]


def test_classes_random_against_float64_reference_and_split_over_two_ranks():
    rng = random.Random(1)
    for trial in range(40):
        budgets = sorted({rng.choice([1, 3, 50, 64, 100, 250, 999]) for _ in range(5)})
        edges = None
        if trial % 2 and len(budgets) > 1:
            edges = [budgets[0], budgets[-1]] if len(budgets) == 2 else [budgets[0], budgets[1], budgets[-1]]
        eta, ceiling = rng.choice([0.01, 0.3]), 2.0
        bc = BudgetClasses(budgets, edges, eta=eta, ceiling=ceiling)
        ref_class = _float64_classes(budgets, edges)
        K = len(set(ref_class.values()))
        lam_ref = [0.0] * K
        for _step in range(5):
            N = 8
            B = [float(rng.choice(budgets)) for _ in range(N)]
            L = [rng.randrange(0, 1200) for _ in range(N)]
            Lt, Bt = torch.tensor(L), torch.tensor(B, dtype=torch.float64)
            # two ranks of 4 responses each, counts summed (the all-reduce)
            c0 = local_counts(Lt[:4], bc.budget_index(Bt[:4]), len(bc.budgets), None)
            c1 = local_counts(Lt[4:], bc.budget_index(Bt[4:]), len(bc.budgets), None)
            whole = local_counts(Lt, bc.budget_index(Bt), len(bc.budgets), None)
            assert [a + b for a, b in zip(c0, c1)] == whole
            # float64 reference of each class's ratio and dual step
            for k in range(K):
                members = [i for i in range(N) if ref_class[B[i]] == k]
                if members:
                    ratio = math.fsum(L[i] / B[i] for i in members) / len(members)
                    lam_ref[k] = min(max(lam_ref[k] + eta * (ratio - 1.0), 0.0), ceiling)
            bc.update(whole)
            assert bc.values() == pytest.approx(lam_ref, rel=1e-12, abs=1e-15)
            lam_of = bc.multipliers(Bt)
            assert lam_of.tolist() == [bc.values()[ref_class[b]] for b in B]


def test_shape_with_per_prompt_budgets_equals_reference_and_plain_laconic_with_one_budget():
    rng = torch.Generator().manual_seed(0)
    r = (torch.rand(3, 4, generator=rng) > 0.5).float()
    L = torch.randint(0, 96, (3, 4), generator=rng)
    B = torch.tensor([[20.0] * 4, [40.0] * 4, [20.0] * 4], dtype=torch.float64)
    lams = torch.where(B == 20.0, 0.3, 0.7).to(torch.float64)
    s = Shaper("laconic", budget=31, max_length=96)
    shaped, _ = shape(s, r, L, 0.0, max_length=96, budgets=B, lams=lams)
    L64, r64 = L.double(), r.double()
    ref = r64 - lams * ((L64 - B) / B).clamp_min(0.0)
    assert torch.allclose(shaped.double(), ref, rtol=0, atol=1e-7)
    # one budget for all and one multiplier = the plain laconic shaper
    one, _ = shape(s, r, L, 0.4, max_length=96, budgets=torch.full((3, 4), 31.0, dtype=torch.float64),
                   lams=torch.full((3, 4), 0.4, dtype=torch.float64))
    plain, _ = shape(s, r, L, 0.4, max_length=96)
    assert torch.equal(one, plain)
    with pytest.raises(ValueError, match="adaptive shaper"):
        shape(Shaper("grpo"), r, L, 0.0, budgets=B, lams=lams)


# ------------------------------------------------------------------ tail
def test_tail_share_hand_values_at_zero_and_one():
    t = TailConstraint(tail_budget=50, share=0.25, eta=0.1, ceiling=1.0)
    L = torch.tensor([10, 50, 51, 40])                       # 50 is not in the tail (L > B_tail)
    counts = local_counts(L, None, 0, t)
    assert counts == [1, 4]
    assert t.update(*counts) == 0.25 and t.value == 0.0      # at q: no move
    assert t.update(4, 4) == 1.0                             # share 1: mu += 0.1 * (1 / 0.25 - 1)
    assert t.value == pytest.approx(0.3)
    assert t.update(0, 4) == 0.0                             # share 0: mu -= 0.1
    assert t.value == pytest.approx(0.2)
    for _ in range(5):
        t.update(0, 4)
    assert t.value == 0.0                                    # floor 0
    for _ in range(10):
        t.update(4, 4)
    assert t.value == 1.0                                    # ceiling
    assert t.penalty64(L, 0.5).tolist() == [0.0, 0.0, 0.5, 0.0]


def test_tail_float64_reference_and_refusals():
    rng = random.Random(2)
    t = TailConstraint(tail_budget=40, share=0.1, eta=0.05, ceiling=0.8, init=0.2)
    mu = 0.2
    for _ in range(100):
        L = [rng.randrange(0, 96) for _ in range(16)]
        share = sum(x > 40 for x in L) / 16
        mu = min(max(mu + 0.05 * (share / 0.1 - 1.0), 0.0), 0.8)
        c0, c1 = local_counts(torch.tensor(L[:8]), None, 0, t), local_counts(torch.tensor(L[8:]), None, 0, t)
        t.update(c0[0] + c1[0], c0[1] + c1[1])
        assert t.value == mu                                 # bit for bit
    for q in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\)"):
            TailConstraint(40, q, 0.1, 1.0)


def test_shape_with_tail_penalty_subtracts_it():
    r = torch.ones(2, 2)
    L = torch.tensor([[10, 60], [70, 20]])
    t = TailConstraint(50, 0.2, 0.1, 1.0)
    base, _ = shape(Shaper("grpo"), r, L, 0.0)
    shaped, m = shape(Shaper("grpo"), r, L, 0.0, tail_penalty=t.penalty64(L, 0.25))
    assert shaped.tolist() == [[1.0, 0.75], [0.75, 1.0]] and base.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert m["mean_tail_penalty"] == 0.125


def test_state_round_trip_exact():
    bc = BudgetClasses([10, 20], None, eta=0.37, ceiling=3.0)
    t = TailConstraint(15, 0.3, 0.11, 0.9)
    for step in range(7):
        bc.update([10 * step + 3, 41, 2, 2, 0, 4])
        t.update(step % 4, 4)
    bc2, t2 = BudgetClasses([10, 20], None, eta=0.37, ceiling=3.0), TailConstraint(15, 0.3, 0.11, 0.9)
    bc2.load_state_dict(bc.state_dict())
    t2.load_state_dict(t.state_dict())
    assert bc2.values() == bc.values() and t2.value == t.value
    with pytest.raises(ConstraintStateMismatch, match="class 30 is new .*class 20 of the checkpoint is gone"):
        BudgetClasses([10, 30], None, eta=0.37, ceiling=3.0).load_state_dict(bc.state_dict())
    with pytest.raises(ConstraintStateMismatch, match="the tail constraint differs: the checkpoint has the tail "
                                                      "constraint B_tail=15,q=0.3, this run B_tail=16,q=0.3"):
        TailConstraint(16, 0.3, 0.11, 0.9).load_state_dict(t.state_dict())


def _moved(classes: BudgetClasses, lams: dict[str, float]) -> BudgetClasses:
    """``classes`` with the multipliers set by class key (one dual step each, so the state is past its start)."""
    for name, d in zip(classes.names, classes.duals):
        d.update(1.0 + lams[name] / d.eta)  # lam = 0 + eta (rho - 1) = lams[name] (below the ceiling 3)
    return classes


def test_classes_state_is_keyed_and_restored_by_key_not_position():
    """The issue's case: a saved class missing (its entry removed) must not shift the others. The multipliers come
    back under their own keys; a class whose key the checkpoint lacks is refused, naming it."""
    saved = _moved(BudgetClasses([22, 40, 60], None, eta=0.5, ceiling=3.0), {"22": 0.25, "40": 0.5, "60": 0.75})
    state = saved.state_dict()
    assert sorted(state["classes"]) == ["22", "40", "60"] and state["classes"]["40"]["budgets"] == [40.0]
    fresh = BudgetClasses([22, 40, 60], None, eta=0.5, ceiling=3.0)
    fresh.load_state_dict(state)
    assert fresh.values() == [0.25, 0.5, 0.75]
    del state["classes"]["22"]
    with pytest.raises(ConstraintStateMismatch, match="class 22 is new") as caught:
        BudgetClasses([22, 40, 60], None, eta=0.5, ceiling=3.0).load_state_dict(state)
    assert caught.value.entries == ["class:new"]
    carried = BudgetClasses([22, 40, 60], None, eta=0.5, ceiling=3.0, lambda_init=0.125)
    carried.load_state_dict(state, carry=CarryOver(new=True))
    assert carried.values() == [0.125, 0.5, 0.75]  # 22 at lambda_init; 40 and 60 keep their own


def test_carry_over_entries_rename_drop_and_rebin():
    saved = _moved(BudgetClasses([22, 40], None, eta=0.5, ceiling=3.0), {"22": 0.25, "40": 0.5})
    state = saved.state_dict()
    # a changed budget (22 -> 24): one class for another; the refusal proposes the rename
    with pytest.raises(ConstraintStateMismatch) as caught:
        BudgetClasses([24, 40], None, eta=0.5, ceiling=3.0).load_state_dict(state)
    assert caught.value.entries == ["class:22=24"]
    renamed = BudgetClasses([24, 40], None, eta=0.5, ceiling=3.0)
    renamed.load_state_dict(state, carry=CarryOver.parse(["class:22=24"]))
    assert renamed.values() == [0.25, 0.5]
    # a class gone: refused, then dropped with class:dropped
    with pytest.raises(ConstraintStateMismatch, match="class 22 of the checkpoint is gone"):
        BudgetClasses([40], None, eta=0.5, ceiling=3.0).load_state_dict(state)
    only = BudgetClasses([40], None, eta=0.5, ceiling=3.0)
    only.load_state_dict(state, carry=CarryOver.parse(["class:dropped", "run.seed"]))  # config keys are ignored
    assert only.values() == [0.5]
    # bins: the same bin with other budgets is refused (class:budgets keeps it); a moved edge renames the bin
    binned = _moved(BudgetClasses([20, 30, 50], [10, 40, 60], eta=0.5, ceiling=3.0), {"10-40": 0.25, "40-60": 0.5})
    b_state = binned.state_dict()
    assert b_state["classes"]["10-40"]["budgets"] == [20.0, 30.0]
    with pytest.raises(ConstraintStateMismatch, match=r"class 10-40 holds the budgets \[20, 35\], the checkpoint's "
                                                      r"\[20, 30\]") as caught:
        BudgetClasses([20, 35, 50], [10, 40, 60], eta=0.5, ceiling=3.0).load_state_dict(b_state)
    assert caught.value.entries == ["class:budgets"]
    kept = BudgetClasses([20, 35, 50], [10, 40, 60], eta=0.5, ceiling=3.0)
    kept.load_state_dict(b_state, carry=CarryOver(budgets=True))
    assert kept.values() == [0.25, 0.5]
    moved = BudgetClasses([20, 30, 50], [10, 45, 60], eta=0.5, ceiling=3.0)
    with pytest.raises(ConstraintStateMismatch):  # both bins renamed: 10-40 -> 10-45 and 40-60 -> 45-60
        moved.load_state_dict(b_state)
    moved.load_state_dict(b_state, carry=CarryOver.parse(["class:10-40=10-45", "class:40-60=45-60"]))
    assert moved.values() == [0.25, 0.5]
    with pytest.raises(ConstraintStateMismatch, match="class:99=45-60 names class 99, which the checkpoint lacks"):
        moved.load_state_dict(b_state, carry=CarryOver.parse(["class:10-40=10-45", "class:99=45-60"]))
    for bad in ("class:nope", "class:=5", "tail:keep", "class:1=2=3"):
        with pytest.raises(ValueError, match="not a carry-over entry"):
            CarryOver.parse([bad])


def test_tail_state_by_its_settings():
    t = TailConstraint(44, 0.1, 0.5, 0.9)
    t.update(1, 2)  # mu = 0.5 (0.5 / 0.1 - 1) clipped to 0.9
    state = t.state_dict()
    other = TailConstraint(50, 0.1, 0.5, 0.6)
    with pytest.raises(ConstraintStateMismatch) as caught:
        other.load_state_dict(state)
    assert caught.value.entries == ["tail:carry", "tail:reset"]
    other.load_state_dict(state, carry="carry")
    assert other.value == 0.6  # the saved 0.9, clipped into this run's [0, 0.6]
    reset = TailConstraint(50, 0.1, 0.5, 0.6, init=0.2)
    reset.load_state_dict(state, carry="reset")
    assert reset.value == 0.2
    with pytest.raises(ConstraintStateMismatch, match="the checkpoint has no tail constraint") as caught:
        TailConstraint(44, 0.1, 0.5, 0.9).load_state_dict(None, carry="carry")
    assert caught.value.entries == ["tail:reset"]


def test_list_form_of_older_checkpoints_is_read_only_when_unambiguous():
    """Older checkpoints saved the multipliers as a list in the order of the class names: read when there is one
    per name and the names are those the saved budgets and edges make; else the problem names why."""
    a, b = (_moved(BudgetClasses([22, 40], None, eta=0.5, ceiling=3.0), {"22": 0.25, "40": 0.5}).duals[i].state_dict()
            for i in (0, 1))
    old = {"budgets": [22.0, 40.0], "edges": None, "names": ["22", "40"], "duals": [a, b]}
    assert classes_state_problem(old) is None
    assert {k: v["dual"]["lam"] for k, v in saved_classes(old).items()} == {"22": 0.25, "40": 0.5}
    fresh = BudgetClasses([22, 40], None, eta=0.5, ceiling=3.0)
    fresh.load_state_dict(old)
    assert fresh.values() == [0.25, 0.5]
    short = {**old, "duals": [b]}  # the first entry removed: which class is it for?
    key, value, allowed = classes_state_problem(short)
    assert key == "duals" and value == "a list of 1" and "one multiplier per class of 'names' (2: 22, 40" in allowed
    with pytest.raises(ValueError, match="ambiguous"):
        BudgetClasses([22, 40], None, eta=0.5, ceiling=3.0).load_state_dict(short)
    renamed = {**old, "names": ["40", "22"]}
    assert classes_state_problem(renamed)[0] == "names"


@pytest.mark.parametrize("edit, key, allowed", [
    (lambda s: s["classes"]["22"]["dual"].update(lam="abc"), "classes.22.dual.lam", "a finite number"),
    (lambda s: s["classes"]["22"]["dual"].update(lam=True), "classes.22.dual.lam", "a finite number"),
    (lambda s: s["classes"]["40"]["dual"].pop("eta"), "classes.40.dual.eta", "a finite number >= 0"),
    (lambda s: s["classes"]["40"]["dual"].update(num_updates=-1), "classes.40.dual.num_updates", "an integer >= 0"),
    (lambda s: s["classes"]["40"].update(budgets="40"), "classes.40.budgets", "a non-empty list of finite numbers"),
    (lambda s: s["classes"]["40"].update(dual=None), "classes.40.dual", "a mapping"),
    (lambda s: s.update(classes=[]), "classes", "a non-empty mapping"),
])
def test_bad_values_in_a_saved_classes_state_are_named(edit, key, allowed):
    state = _moved(BudgetClasses([22, 40], None, eta=0.5, ceiling=3.0), {"22": 0.25, "40": 0.5}).state_dict()
    assert classes_state_problem(state) is None
    edit(state)
    got = classes_state_problem(state)
    assert got is not None and got[0] == key and got[2].startswith(allowed), got


def test_bad_values_in_a_saved_tail_state_are_named():
    state = TailConstraint(44, 0.1, 0.5, 0.9).state_dict()
    assert tail_state_problem(state) is None
    assert tail_state_problem({**state, "dual": {**state["dual"], "lam": "0.3"}})[:2] == ("dual.lam", "0.3")
    assert tail_state_problem({**state, "share": 1.5})[:2] == ("share", 1.5)
    assert tail_state_problem(None)[0] == ""


# ------------------------------------------------------------------ the run's constraints, one object
def _settings(**kw):
    from types import SimpleNamespace

    base = dict(shaper="laconic", budget=15.0, eta=0.5, ceiling=3.0, lambda_init=0.2, floor=0.0, controller="integral",
                kp=0.0, kd=0.0, per_prompt_budget=False, budget_classes=None, tail_budget=None, tail_share=0.25,
                tail_eta=0.2, tail_ceiling=1.0, tail_init=0.1)
    return SimpleNamespace(**{**base, **kw})


def test_constraints_object_runs_every_dual_step_of_a_step_by_hand():
    """Budget classes {2, 4}, a tail constraint (B_tail 5, q 0.25) and the marker [7], through the four calls of
    a step, against values worked by hand."""
    from laconic_nemo.core import Constraints

    c = Constraints.build(_settings(per_prompt_budget=True, tail_budget=5.0), 40, budgets=[4, 2, 4], marker=[7])
    assert c.dual is None and c.lam == 0.0 and c.classes.names == ["2", "4"] and c.beyond_mean
    tokens = torch.full((4, 8), 5)
    tokens[0, 1 + 2] = 7  # row 0 closes its reasoning after 2 tokens
    L, closed = c.lengths(torch.tensor([4, 4, 6, 6]), tokens, torch.ones(4, dtype=torch.long),
                          torch.tensor([4, 4, 6, 6]))
    assert L.tolist() == [2, 4, 6, 6] and closed.tolist() == [True, False, False, False]
    budgets = torch.tensor([2.0, 4.0, 2.0, 4.0])
    lams, tail = c.penalties(L, budgets, 2)
    assert lams.tolist() == [[0.2, 0.2], [0.2, 0.2]] and tail.tolist() == [[0.0, 0.0], [0.1, 0.1]]
    counts = c.counts(L, budgets, closed)
    assert counts == [8, 10, 2, 2, 2, 4, 1]  # sum of L per budget, responses per budget, tail, responses, closed
    lam_used, lam_next, m = c.step(4.5, counts)
    assert (lam_used, lam_next) == (0.0, 0.0)
    assert m == {"laconic/lambda/class_2": 0.2, "laconic/length_ratio/class_2": 2.0,     # 8 / 2 / 2
                 "laconic/lambda/class_4": 0.2, "laconic/length_ratio/class_4": 1.25,    # 10 / 4 / 2
                 "laconic/mu_tail": 0.1, "laconic/tail_share": 0.5,
                 "laconic/reasoning_length_mean": 4.5, "laconic/reasoning_closed_share": 0.25}
    assert c.classes.values() == pytest.approx([0.2 + 0.5 * (2.0 - 1), 0.2 + 0.5 * (1.25 - 1)])
    assert c.tail.value == pytest.approx(0.1 + 0.2 * (0.5 / 0.25 - 1))
    assert set(c.state_dict()) == {"classes", "tail"} and set(c.state_dict()["classes"]["classes"]) == {"2", "4"}


def test_constraints_object_without_constraints_beyond_the_mean_is_lambda_alone():
    from laconic_nemo.core import Constraints

    c = Constraints.build(_settings(), 40)
    assert c.dual.ceiling == 3.0 and c.lam == 0.2 and not c.beyond_mean and c.state_dict() is None
    assert c.counts(torch.tensor([1, 2]), None, None) == []
    assert c.step(20.0, []) == (0.2, pytest.approx(0.2 + 0.5 * (20 / 15 - 1)), {})
    fixed = Constraints.build(_settings(shaper="fixed"), 40)
    assert fixed.dual is None and fixed.lam == 0.2 and fixed.step(20.0, [])[:2] == (0.2, 0.2)
    assert Constraints.build(_settings(per_prompt_budget=True), 40).classes is None  # budgets not given: not built


def test_one_dual_settings_type_for_the_config_the_classes_and_the_plug_ins():
    """The controller knobs are written once (core.dual.DualSettings): the config hands them over, the budget
    classes take them whole, the plug-ins' settings are one; each builds the controller the kwargs built."""
    from pathlib import Path

    from laconic_nemo.config import load_config
    from laconic_nemo.core import DualController, DualSettings, lambda_controller
    from laconic_nemo.integrations.common import LaconicSettings

    cfg = load_config(Path(__file__).resolve().parent.parent / "recipes" / "tiny_cpu.yaml",
                      ["laconic.controller=pid", "laconic.kp=0.3", "laconic.floor=0.01"])
    lc, lmax = cfg.laconic, cfg.rollout.max_new_tokens
    s = lc.dual(lmax)
    assert isinstance(s, DualSettings) and (s.kp, s.floor, s.max_length, s.budget) == (0.3, 0.01, lmax, lc.budget)
    assert s.build().state_dict() == lambda_controller(lc, lmax).state_dict() == DualController(
        lc.budget, lc.eta, ceiling=lc.ceiling, max_length=lmax, init=lc.lambda_init, floor=0.01, controller="pid",
        kp=0.3).state_dict()
    with pytest.raises(AttributeError):
        s.eta = 1.0  # frozen
    plug = LaconicSettings(budget=10, eta=0.25, ceiling=0.7, lambda_init=0.3)
    assert isinstance(plug, DualSettings) and plug.controller_for().state_dict() == \
        DualSettings(10, 0.25, ceiling=0.7, lambda_init=0.3).build().state_dict()
    whole = BudgetClasses([10, 20], None, DualSettings(budget=99.0, eta=0.5, ceiling=3.0, lambda_init=0.1))
    named = BudgetClasses([10, 20], None, eta=0.5, ceiling=3.0, lambda_init=0.1)
    assert whole.state_dict() == named.state_dict()
    with pytest.raises(TypeError, match="not both"):
        BudgetClasses([10], None, DualSettings(1.0, 0.5), eta=0.5)
