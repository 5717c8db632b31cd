"""The band constraint (core/band.py, core/constraints.py): per budget class a lower bound B_lo = rho B beside B,
its multiplier lambda_lo moved from the class's global length ratio, the reward term
``- lambda_lo max((B_lo - L) / B_lo, 0)``; against a hand-worked example on [P, G], a float64 re-implementation
written here on random batches (the counts split over two "ranks" equal to one), and its saved state by class key."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from laconic_nemo.config import ConfigError, load_config
from laconic_nemo.core import (
    Band,
    BudgetClasses,
    Constraints,
    DualController,
    LowerBound,
    band_cost64,
    class_report,
    dual_state_problem,
    report_counts,
    shape,
)
from laconic_nemo.core.constraints import CarryOver, classes_state_problem
from laconic_nemo.grpo.constraints import build_constraints

STATED = "recipes/tiny_cpu_stated.yaml"


def _stated(*overrides):
    """The tiny stated-budget recipe (budgets 20, 25, 30, 35; L_max 96) with the band and these overrides."""
    cfg = load_config(STATED, list(overrides))
    return cfg, build_constraints(cfg, cfg.data.stated_budgets())


def _shape(cfg, c, r, L, B, G):
    """The trainer's steps 4: each response's class multiplier, the band term, the shaper."""
    lams, tail = c.penalties(L, B, G)
    band = c.band_penalty(L, B, G)
    return shape(cfg.laconic, r.view(-1, G), L.view(-1, G), c.lam, max_length=cfg.rollout.max_new_tokens,
                 budgets=B.view(-1, G), lams=lams, tail_penalty=tail, band_penalty=band)


# ------------------------------------------------------------------ hand-worked
def test_band_cost_hand_values():
    L = torch.tensor([0.0, 8.0, 16.0, 20.0, 40.0], dtype=torch.float64)
    # B_lo = 16: (16 - L) / 16 clipped at 0 -> 1 at L = 0, 0.5 at 8, 0 at and above 16
    assert band_cost64(L, 16.0).tolist() == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert band_cost64(L, torch.full_like(L, 32.0)).tolist() == [1.0, 0.75, 0.5, 0.375, 0.0]


def test_lower_bound_dual_step_hand_values_and_clips():
    lo = LowerBound(0.8, eta=0.5, ceiling=0.2)
    # x = mean_L / B = 0.6: error 1 - 0.6 / 0.8 = 0.25 -> 0.125
    assert lo.update(0.6) == pytest.approx(0.125, abs=1e-15)
    # x = 0.4: error 0.5 -> 0.125 + 0.25 = 0.375, clipped at the ceiling 0.2
    assert lo.update(0.4) == 0.2
    # x = 1.2 (over B, far above B_lo): error -0.5 -> 0.2 - 0.25 < 0, clipped at 0
    assert lo.update(1.2) == 0.0
    # inside the band it stays at 0
    assert lo.update(0.9) == 0.0
    # the lower controller's error has the other sign than the upper's, same clip
    up, down = DualController(0.8, 0.5), DualController(0.8, 0.5, bound="lower")
    assert up.error(0.6) == -down.error(0.6)


def test_band_dual_step_and_reward_by_hand_on_p_by_g():
    """Two prompts of G = 3: budget 20 (B_lo 16) far below its lower bound, budget 35 (B_lo 28) over B."""
    cfg, c = _stated("laconic.band=0.8", "laconic.eta=0.5", "laconic.ceiling=1.0")
    L = torch.tensor([8, 12, 16, 35, 42, 49])
    B = torch.tensor([20.0, 20, 20, 35, 35, 35], dtype=torch.float64)
    r = torch.tensor([1.0, 0, 1, 1, 1, 0])
    # step 1: every multiplier 0, the reward is the task reward
    shaped, m = _shape(cfg, c, r, L, B, 3)
    assert shaped.tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]] and m["mean_band_penalty"] == 0.0
    _, _, out = c.step(float(L.double().mean()), c.counts(L, B, None))
    # class 20: x = 36 / 20 / 3 = 0.6 -> lambda_hi = clip(0.5 (0.6 - 1)) = 0, lambda_lo = 0.5 (1 - 0.6 / 0.8) = 0.125
    # class 35: x = 126 / 35 / 3 = 1.2 -> lambda_hi = 0.5 * 0.2 = 0.1, lambda_lo = clip(0.5 (1 - 1.5)) = 0
    # classes 25 and 30 (no response) keep theirs
    assert out["laconic/lambda_lo/class_20"] == 0.0 and out["laconic/length_ratio/class_20"] == pytest.approx(0.6)
    assert c.classes.values() == pytest.approx([0.0, 0.0, 0.0, 0.1], abs=1e-15)
    assert c.classes.values_lo() == pytest.approx([0.125, 0.0, 0.0, 0.0], abs=1e-15)
    # step 2 on the same batch:
    # class 20: c_lo = (16 - [8, 12, 16]) / 16 = [0.5, 0.25, 0], times 0.125 = [0.0625, 0.03125, 0]; c_hi = 0
    # class 35: c_hi = ([35, 42, 49] - 35) / 35 = [0, 0.2, 0.4], times 0.1 = [0, 0.02, 0.04]; c_lo = 0 (L >= 28)
    shaped, m = _shape(cfg, c, r, L, B, 3)
    want = [[1 - 0.0625, 0 - 0.03125, 1.0], [1.0, 1 - 0.02, 0 - 0.04]]
    assert shaped.double().numpy() == pytest.approx(np.array(want), abs=1e-6)  # float32 rewards
    assert m["mean_band_penalty"] == pytest.approx((0.0625 + 0.03125) / 6, abs=1e-15)
    assert m["mean_penalty"] == pytest.approx((0.02 + 0.04) / 6, abs=1e-15)
    _, _, out = c.step(float(L.double().mean()), c.counts(L, B, None))
    # the metric is the lambda_lo used at the step; the next: 0.125 + 0.125 = 0.25
    assert out["laconic/lambda_lo/class_20"] == pytest.approx(0.125, abs=1e-15)
    assert c.classes.values_lo()[0] == pytest.approx(0.25, abs=1e-15)


def test_band_of_the_mean_length_by_hand():
    """Without per-prompt budgets the band is on the mean length against laconic.budget (one class)."""
    cfg = load_config("tiny_cpu", ["laconic.band=0.5", "laconic.budget=40", "laconic.eta=0.2", "laconic.ceiling=1.0"])
    c = build_constraints(cfg)
    assert c.classes is None and c.band is not None and c.band.ceiling == 1.0 and c.band.eta == 0.2
    L = torch.tensor([5, 10, 15, 50])  # mean 20 = B_lo: error 0, lambda_lo stays 0
    _, _, out = c.step(20.0, c.counts(L, None, None))
    assert out == {"laconic/lambda_lo": 0.0} and c.band.value == 0.0
    c.step(10.0, [])  # mean 10: x = 0.25, error 1 - 0.25 / 0.5 = 0.5 -> 0.1
    assert c.band.value == pytest.approx(0.1, abs=1e-15)
    # B_lo = 20: c_lo = [0.75, 0.5, 0.25, 0], times 0.1; lambda (upper, x = 0.25 < 1) stays 0
    pen = c.band_penalty(L, None, 2)
    assert pen.shape == (2, 2) and pen.reshape(-1).tolist() == pytest.approx([0.075, 0.05, 0.025, 0.0], abs=1e-15)
    assert c.lam == 0.0
    # a shaper without a dual step has no lambda_lo to move: the config refuses it, and so does the core
    with pytest.raises(ConfigError, match="laconic.band = 0.9 is invalid: allowed null with laconic.shaper = fixed"):
        load_config("tiny_cpu", ["laconic.shaper=fixed", "laconic.band=0.9"])
    fixed = dataclasses.replace(load_config("tiny_cpu", ["laconic.shaper=fixed"]).laconic, band=0.9)
    with pytest.raises(ValueError, match="laconic.band needs a shaper with a dual step"):
        Constraints.build(fixed, 96)


def test_class_report_in_band_hand_values():
    L = torch.tensor([17, 18, 20, 21, 22, 25])
    idx = torch.tensor([0, 0, 0, 0, 1, 1])
    correct = torch.tensor([True, False, True, True, False, True])
    counts = report_counts(L, correct, idx, [20.0, 25.0], band=0.9)
    # budget 20: band [18, 20] holds 18 and 20 (17 below, 21 over) -> 2 / 4; budget 25: [22.5, 25] holds 25 -> 1 / 2
    assert counts[-2:] == [2, 1]
    rep = class_report(BudgetClasses([20, 25], None, eta=0.0, ceiling=0.0), counts)
    assert rep["20"]["in_band"] == 0.5 and rep["25"]["in_band"] == 0.5
    assert "in_band" not in class_report(BudgetClasses([20, 25], None, eta=0.0, ceiling=0.0), counts[:-2])["20"]


# ------------------------------------------------------------------ float64 re-implementation
def _reference(budgets, rho, eta, ceiling, eta_lo, ceiling_lo, steps):
    """numpy float64: per step (budget of each response, L, r) the class ratios, both multipliers and the reward."""
    names = sorted(set(budgets))
    lam_hi, lam_lo = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
    out = []
    for b, L, r in steps:
        b, L, r = np.asarray(b, np.float64), np.asarray(L, np.float64), np.asarray(r, np.float64)
        hi = np.array([lam_hi[x] for x in b])
        lo = np.array([lam_lo[x] for x in b])
        reward = r - hi * np.maximum((L - b) / b, 0) - lo * np.maximum((rho * b - L) / (rho * b), 0)
        out.append((reward, dict(lam_hi), dict(lam_lo)))
        for k in names:
            m = b == k
            if m.any():
                x = float(np.mean(L[m] / k))
                lam_hi[k] = min(max(lam_hi[k] + eta * (x - 1), 0.0), ceiling)
                lam_lo[k] = min(max(lam_lo[k] + eta_lo * (1 - x / rho), 0.0), ceiling_lo)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_band_against_a_float64_reimplementation_on_random_batches(seed):
    rng = np.random.default_rng(seed)
    rho, eta, ceiling = float(rng.uniform(0.6, 0.95)), float(rng.uniform(0.05, 0.5)), float(rng.uniform(0.3, 2))
    eta_lo, ceiling_lo = float(rng.uniform(0.05, 0.5)), float(rng.uniform(0.2, 1))
    cfg, c = _stated(f"laconic.band={rho}", f"laconic.eta={eta}", f"laconic.ceiling={ceiling}",
                     f"laconic.band_eta={eta_lo}", f"laconic.band_ceiling={ceiling_lo}")
    budgets = [20.0, 25.0, 30.0, 35.0]
    P, G = 8, 4
    steps = []
    for _ in range(12):
        b = np.repeat(rng.choice(budgets, P), G)
        L = np.clip(np.round(b * rng.uniform(0.3, 1.6, P * G)), 0, 96).astype(int)
        steps.append((b, L, rng.integers(0, 2, P * G)))
    ref = _reference([b for s in steps for b in s[0]], rho, eta, ceiling, eta_lo, ceiling_lo, steps)
    for (b, L, r), (want, hi, lo) in zip(steps, ref):
        Bt, Lt, rt = torch.tensor(b), torch.tensor(L), torch.tensor(r, dtype=torch.float64)
        assert c.classes.values() == pytest.approx([hi[x] for x in budgets], abs=1e-12)
        assert c.classes.values_lo() == pytest.approx([lo[x] for x in budgets], abs=1e-12)
        shaped, _ = _shape(cfg, c, rt, Lt, Bt, G)
        assert shaped.reshape(-1).numpy() == pytest.approx(want, abs=1e-12)
        # the counts of two "ranks" (half the groups each), summed, are the counts of one
        half = P * G // 2
        parts = [c.counts(Lt[s], Bt[s], None) for s in (slice(0, half), slice(half, None))]
        counts = [x + y for x, y in zip(*parts)]
        assert counts == c.counts(Lt, Bt, None)
        c.step(float(Lt.double().mean()), counts)


def test_band_of_the_mean_length_against_float64_with_the_plain_laconic_reward():
    rng = np.random.default_rng(5)
    cfg = load_config("tiny_cpu", ["laconic.band=0.7", "laconic.eta=0.3", "laconic.ceiling=0.8"])
    c = build_constraints(cfg)
    B, lam, lo = cfg.laconic.budget, 0.0, 0.0
    for _ in range(10):
        L = rng.integers(5, 60, 24)
        r = rng.integers(0, 2, 24).astype(np.float64)
        want = r - lam * np.maximum((L - B) / B, 0) - lo * np.maximum((0.7 * B - L) / (0.7 * B), 0)
        Lt = torch.tensor(L)
        shaped, _ = shape(cfg.laconic, torch.tensor(r).view(-1, 4), Lt.view(-1, 4), c.lam, max_length=96,
                          band_penalty=c.band_penalty(Lt, None, 4))
        assert shaped.reshape(-1).numpy() == pytest.approx(want, abs=1e-12)
        mean = float(L.sum()) / L.size
        lam_used, lam_next, out = c.step(mean, c.counts(Lt, None, None))
        assert lam_used == pytest.approx(lam, abs=1e-12) and out["laconic/lambda_lo"] == pytest.approx(lo, abs=1e-12)
        lam = min(max(lam + 0.3 * (mean / B - 1), 0.0), 0.8)
        lo = min(max(lo + 0.3 * (1 - (mean / B) / 0.7), 0.0), 0.8)


# ------------------------------------------------------------------ settings and saved state
def test_band_settings_default_to_the_classs_and_bad_values_are_named():
    _, c = _stated("laconic.band=0.9", "laconic.eta=0.15", "laconic.ceiling=2.0")
    assert [(lo.rho, lo.eta, lo.ceiling) for lo in c.classes.lower] == [(0.9, 0.15, 2.0)] * 4
    _, c = _stated("laconic.band=0.9", "laconic.ceiling=null")
    # null ceiling: the class's Lambda b / (L_max - b), for each class its own
    assert [lo.ceiling for lo in c.classes.lower] == pytest.approx([b / (96 - b) for b in (20, 25, 30, 35)])
    _, c = _stated("laconic.band=0.9", "laconic.band_eta=0.3", "laconic.band_ceiling=0.5")
    assert {(lo.eta, lo.ceiling) for lo in c.classes.lower} == {(0.3, 0.5)}
    for rho in (0.0, 1.0, -0.5, math.nan):
        with pytest.raises(ValueError, match="laconic.band must be a number in"):
            Band(rho)
    with pytest.raises(ValueError, match="laconic.band_ceiling"):
        Band(0.9, ceiling=-1.0)
    with pytest.raises(ValueError, match="bound must be one of upper, lower"):
        DualController(20, 0.1, bound="both")
    _, c = _stated()
    assert c.classes.lower is None and c.band is None  # off by default: the paper's form
    assert "band" not in next(iter(c.classes.state_dict()["classes"].values()))


def test_band_state_is_saved_and_restored_with_its_class_by_key():
    _, a = _stated("laconic.band=0.8", "laconic.eta=0.5", "laconic.ceiling=1.0")
    L = torch.tensor([8, 12, 16, 35, 42, 49])
    B = torch.tensor([20.0, 20, 20, 35, 35, 35], dtype=torch.float64)
    for _ in range(2):
        a.step(27.0, a.counts(L, B, None))
    state = a.classes.state_dict()
    assert state["classes"]["20"]["band"]["rho"] == 0.8
    assert state["classes"]["20"]["band"]["dual"]["bound"] == "lower"
    assert classes_state_problem(state) is None
    _, b = _stated("laconic.band=0.8", "laconic.eta=0.5", "laconic.ceiling=1.0")
    b.classes.load_state_dict(state)
    assert b.classes.values_lo() == a.classes.values_lo() and b.classes.values() == a.classes.values()
    # by key, not position: budgets 20 and 35 saved, a run of budgets 35 and 20 in another order of the list
    _, c = _stated("laconic.band=0.8", "laconic.eta=0.5", "laconic.ceiling=1.0", "data.target_lengths=[35,25,20,30]")
    c.classes.load_state_dict(state)
    assert c.classes.values_lo() == a.classes.values_lo()
    # a renamed class carries its lambda_lo with it
    _, d = _stated("laconic.band=0.8", "laconic.eta=0.5", "laconic.ceiling=1.0", "data.target_lengths=[21,25,30,35]")
    d.classes.load_state_dict(state, carry=CarryOver(renames={"21": "20"}), strict=False)
    assert d.classes.values_lo()[0] == a.classes.values_lo()[0] > 0
    # a checkpoint without the band: strict refuses, otherwise lambda_lo starts at 0
    _, plain = _stated("laconic.eta=0.5", "laconic.ceiling=1.0")
    with pytest.raises(ValueError, match="no band state"):
        b.classes.load_state_dict(plain.classes.state_dict())
    plain.step(27.0, plain.counts(L, B, None))
    _, f = _stated("laconic.band=0.8", "laconic.eta=0.5", "laconic.ceiling=1.0")
    f.classes.load_state_dict(plain.classes.state_dict(), strict=False)
    assert f.classes.values_lo() == [0.0] * 4 and f.classes.values() == plain.classes.values() != [0.0] * 4
    # another rho: strict names it; otherwise lambda_lo is carried over, clipped into this run's ceiling
    _, e = _stated("laconic.band=0.9", "laconic.eta=0.5", "laconic.ceiling=1.0", "laconic.band_ceiling=0.1")
    with pytest.raises(ValueError, match="mismatch on 'rho'"):
        e.classes.load_state_dict(state)
    e.classes.load_state_dict(state, strict=False)
    assert e.classes.values_lo()[0] == 0.1


@pytest.mark.parametrize("edit,key,allowed", [
    (lambda s: s["classes"]["20"]["band"].update(rho=1.5), "classes.20.band.rho", "a number in (0, 1)"),
    (lambda s: s["classes"]["20"]["band"]["dual"].update(lam="x"), "classes.20.band.dual.lam", "a finite number"),
    (lambda s: s["classes"]["20"]["band"]["dual"].pop("bound"), "classes.20.band.dual.bound", "'lower'"),
    (lambda s: s["classes"]["25"]["band"]["dual"].update(bound="side"), "classes.25.band.dual.bound", "one of"),
])
def test_bad_values_in_a_saved_band_state_are_named(edit, key, allowed):
    _, c = _stated("laconic.band=0.8")
    state = c.classes.state_dict()
    edit(state)
    problem = classes_state_problem(state)
    assert problem is not None and problem[0] == key and allowed in problem[2]


def test_lower_bound_controller_state_round_trip_and_bound_mismatch():
    lo = DualController(0.8, 0.3, ceiling=1.0, bound="lower")
    lo.update(0.5)
    state = lo.state_dict()
    assert state["bound"] == "lower" and dual_state_problem(state) is None
    again = DualController(0.8, 0.3, ceiling=1.0, bound="lower")
    again.load_state_dict(state)
    assert again.value == lo.value and again.num_updates == 1
    up = DualController(0.8, 0.3, ceiling=1.0)
    assert "bound" not in up.state_dict()  # an upper bound's state is the one saved before lower bounds existed
    with pytest.raises(ValueError, match="mismatch on 'bound'"):
        up.load_state_dict(state, strict=False)
    with pytest.raises(ValueError, match="mismatch on 'bound'"):
        again.load_state_dict(up.state_dict())


def test_mean_band_state_round_trip_and_refusals():
    cfg = load_config("tiny_cpu", ["laconic.band=0.8"])
    a = build_constraints(cfg)
    a.step(10.0, [])
    state = a.state_dict()
    assert state["band"]["budget"] == cfg.laconic.budget and state["classes"] is None and state["tail"] is None
    b = build_constraints(cfg)
    b.load_band_state(state["band"])
    assert b.band.value == a.band.value > 0
    with pytest.raises(ValueError, match="no band state"):
        b.load_band_state(None)
    other = build_constraints(load_config("tiny_cpu", ["laconic.band=0.8", "laconic.budget=40"]))
    with pytest.raises(ValueError, match="mismatch on 'budget'"):
        other.load_band_state(state["band"])
    other.load_band_state(state["band"], strict=False)
    assert other.band.value == a.band.value
    assert build_constraints(load_config("tiny_cpu")).state_dict() is None  # off: nothing saved, as before
