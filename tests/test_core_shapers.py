"""Reward shapers against independent pure-Python float64 references, the trainer's lambda for each shaper (the
controller, a constant) and its checkpoint state, and the config errors of the `laconic:` section."""

import math
import random

import pytest
import torch

from laconic_nemo.config import build_config
from laconic_nemo.core import (
    SHAPERS,
    DualController,
    Shaper,
    as_groups,
    constant_lambda,
    group_advantages,
    lambda_controller,
    load_shaper_state,
    next_lambda,
    shape,
    shaper_state,
)

LMAX = 4096
BASE_CFG = {  # recipes/base.yaml `laconic:` defaults
    "shaper": "laconic", "budget": 1500, "eta": 0.002, "ceiling": None, "lambda_init": 0.0, "floor": 0.0,
    "penalty_cap": None, "hit_cap": 0.0, "alpha": None, "overlong_buffer": 512, "overlong_penalty": 1.0,
}


def shaper_from_config(laconic, max_length=LMAX, **data):
    """The recipe's config and lambda controller, as the trainer builds it from a `laconic:` section (checked
    at the config boundary)."""
    cfg = build_config({"laconic": dict(laconic), "rollout": {"max_new_tokens": max_length}, "data": data})
    return cfg, lambda_controller(cfg.laconic, cfg.rollout.max_new_tokens)


def recipe_shaper(cfg):
    """The shaping call of the trainer (grpo/trainer.py): the recipe's `laconic:` section and L_max."""
    return lambda r, L, trunc, lam, targets=None: shape(cfg.laconic, r, L, lam, max_length=cfg.rollout.max_new_tokens,
                                                       truncated=trunc, targets=targets)


def by_groups(shaper, rewards, lengths, truncated, group_size, lam, targets=None):
    """``shaper`` on a flat batch whose groups of ``group_size`` are contiguous: grouped [P, G] for the core
    (core.as_groups), the shaped rewards flat again."""
    def grouped(t):
        return None if t is None else as_groups(torch.as_tensor(t), group_size)

    shaped, metrics = shaper(grouped(rewards), grouped(lengths), grouped(truncated), lam, targets=grouped(targets))
    return shaped.flatten(), metrics


def _batch(seed, P=6, G=8, lmax=LMAX, graded=False):
    rng = random.Random(seed)
    rewards, lengths, targets = [], [], []
    for _ in range(P):
        for _ in range(G):
            correct = rng.random() < 0.6
            rewards.append((0.9 * correct + 0.1 * (rng.random() < 0.8)) if graded else float(correct))
            lengths.append(lmax if rng.random() < 0.15 else rng.randint(0, lmax))
            targets.append(rng.choice([256, 512, 1024, 2048, 3000]))
    trunc = [L == lmax for L in lengths]
    return rewards, lengths, trunc, targets


def _t(rewards, lengths, trunc, targets):
    return (torch.tensor(rewards, dtype=torch.float32), torch.tensor(lengths), torch.tensor(trunc),
            torch.tensor(targets))


# ---------------------------------------------------------------- pure-Python references
def ref_lagrangian(r, L, trunc, B, lam, linear=False, penalty_cap=None, hit_cap=0.0):
    out = []
    for ri, Li, ti in zip(r, L, trunc):
        c = (Li - B) / B
        if not linear:
            c = max(c, 0.0)
        pen = lam * c
        if penalty_cap is not None:
            pen = min(pen, penalty_cap)
        out.append(ri - pen - hit_cap * ti)
    return out


def ref_l1_exact(r, L, n_gold, alpha):
    return [float(ri > 0.5) - alpha * abs(g - Li) for ri, Li, g in zip(r, L, n_gold)]


def ref_l1_max(r, L, n_gold, alpha):
    return [float(ri > 0.5) * min(max(alpha * (g - Li) + 0.5, 0.0), 1.0) for ri, Li, g in zip(r, L, n_gold)]


def ref_efficient(r, L, G, alpha):
    out = []
    for g0 in range(0, len(r), G):
        rs, Ls = r[g0:g0 + G], L[g0:g0 + G]
        cl = [Li for ri, Li in zip(rs, Ls) if ri > 0.5]
        if cl:
            m = math.fsum(cl) / len(cl)
            s = math.sqrt(math.fsum((x - m) ** 2 for x in cl) / len(cl))
        for ri, Li in zip(rs, Ls):
            out.append(1 - alpha / (1 + math.exp(-(Li - m) / (s + 1e-7))) if ri > 0.5 else 0.0)
    return out


def ref_overlong(r, L, lmax, buf, pen):
    return [ri + min(-(Li - (lmax - buf)) / buf * pen, 0.0) for ri, Li in zip(r, L)]


# ---------------------------------------------------------------- hand-worked values
def test_laconic_hand_values():
    s = Shaper("laconic", budget=1000, max_length=4000)
    r = torch.tensor([1.0, 1.0, 0.0, 1.0])
    L = torch.tensor([500, 1500, 3000, 4000])
    trunc = torch.tensor([False, False, False, True])
    shaped, m = by_groups(s, r, L, trunc, group_size=2, lam=0.2)
    # costs 0, 0.5, 2, 3 ; penalties 0, 0.1, 0.4, 0.6
    assert shaped.tolist() == pytest.approx([1.0, 0.9, -0.4, 0.4], abs=1e-6)
    assert m["mean_length"] == 2250.0 and m["frac_over_budget"] == 0.75 and m["frac_truncated"] == 0.25
    assert m["mean_cost"] == pytest.approx(5.5 / 4) and m["lambda"] == 0.2
    assert m["task_reward_mean"] == 0.75 and m["shaped_reward_mean"] == pytest.approx(1.9 / 4)
    # authors' knobs: penalty capped at 0.3, truncated responses pay 0.1 more
    s2 = Shaper("laconic", budget=1000, max_length=4000, penalty_cap=0.3, hit_cap=0.1)
    shaped2, m2 = by_groups(s2, r, L, trunc, group_size=2, lam=0.2)
    assert shaped2.tolist() == pytest.approx([1.0, 0.9, -0.3, 0.6], abs=1e-6)
    assert m2["frac_penalty_capped"] == 0.5


def test_efficient_hand_values():
    s = Shaper("efficient", alpha=0.1)
    # group 1: correct lengths 100, 300 -> mean 200, std 100 -> z = -1, +1 ; incorrect -> 0
    # group 2: single correct -> z = 0 -> 1 - 0.05 ; group 3: none correct -> all 0
    r = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    L = torch.tensor([100, 300, 50, 10, 999, 20, 1, 2, 3])
    shaped, m = by_groups(s, r, L, None, group_size=3, lam=0.0)
    sig = 1 / (1 + math.exp(-1))
    expected = [1 - 0.1 * (1 - sig), 1 - 0.1 * sig, 0.0, 0.0, 0.95, 0.0, 0.0, 0.0, 0.0]
    assert shaped.tolist() == pytest.approx(expected, abs=1e-6)
    assert m["frac_correct"] == pytest.approx(3 / 9)


def test_l1_and_overlong_hand_values():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0])
    L = torch.tensor([1000, 3000, 1000, 4096])
    n_gold = torch.tensor([2000, 2000, 2000, 4096])
    e, _ = by_groups(Shaper("l1_exact"), r, L, None, 2, 0.0, targets=n_gold)
    assert e.tolist() == pytest.approx([1 - 0.3, 1 - 0.3, -0.3, 1.0], abs=1e-6)
    mx, m = by_groups(Shaper("l1_max"), r, L, None, 2, 0.0, targets=n_gold)
    assert mx.tolist() == pytest.approx([0.8, 0.2, 0.0, 0.5], abs=1e-6)
    assert m["frac_over_target"] == 0.25
    o, m = by_groups(Shaper("overlong", max_length=4096, overlong_buffer=1024), r, L, None, 2, 0.0)
    # 3000 is 0 tokens into the buffer [3072, 4096]: no penalty; 4096 is at its end: -1
    assert o.tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0], abs=1e-6)
    o2, _ = by_groups(Shaper("overlong", max_length=4096, overlong_buffer=1024, overlong_penalty=0.5),
                      r, torch.tensor([3584, 3072, 4000, 4096]), None, 2, 0.0)
    assert o2.tolist() == pytest.approx([0.75, 1.0, -0.5 * 928 / 1024, 0.5], abs=1e-6)


# ---------------------------------------------------------------- random batches vs references
@pytest.mark.parametrize("seed", range(5))
def test_all_shapers_match_references(seed):
    rng = random.Random(100 + seed)
    graded = seed % 2 == 1
    r, L, tr, tg = _batch(seed, graded=graded)
    rt, Lt, trt, tgt = _t(r, L, tr, tg)
    B = rng.choice([550, 1000, 1500, 2000])
    lam = rng.uniform(0, B / (LMAX - B))
    cap = rng.choice([None, 0.4])
    hit = rng.choice([0.0, 0.1])
    r32 = rt.tolist()  # the float32 rewards the shaper sees
    cases = {  # settings, lambda, reference
        "laconic": (dict(budget=B, penalty_cap=cap, hit_cap=hit), lam,
                    ref_lagrangian(r32, L, tr, B, lam, penalty_cap=cap, hit_cap=hit)),
        "linear": (dict(budget=B, penalty_cap=cap, hit_cap=hit), lam,
                   ref_lagrangian(r32, L, tr, B, lam, linear=True, penalty_cap=cap, hit_cap=hit)),
        "fixed": (dict(budget=B), 0.05, ref_lagrangian(r32, L, tr, B, 0.05)),
        "grpo": (dict(budget=B), 0.0, r32),
        "l1_exact": (dict(alpha=0.0005), 0.0, ref_l1_exact(r32, L, tg, 0.0005)),
        "l1_max": (dict(alpha=None), 0.0, ref_l1_max(r32, L, tg, 0.0003)),
        "efficient": (dict(alpha=0.2), 0.0, ref_efficient(r32, L, 8, 0.2)),
        "overlong": (dict(overlong_buffer=512, overlong_penalty=1.0), 0.0, ref_overlong(r32, L, LMAX, 512, 1.0)),
    }
    assert sorted(cases) == sorted(SHAPERS)
    for name, (cfg, lam_s, ref) in cases.items():
        s = Shaper(name, max_length=LMAX, **cfg)
        shaped, m = by_groups(s, rt, Lt, trt, group_size=8, lam=lam_s, targets=tgt)
        assert shaped.dtype == torch.float32 and shaped.shape == rt.shape
        assert shaped.tolist() == pytest.approx(ref, rel=1e-6, abs=1e-6), name
        for key in ("mean_length", "frac_over_budget", "mean_cost", "lambda", "task_reward_mean",
                    "shaped_reward_mean", "frac_truncated"):
            assert isinstance(m[key], float), (name, key)
        assert m["mean_length"] == pytest.approx(sum(L) / len(L))
        assert m["task_reward_mean"] == pytest.approx(sum(r32) / len(r32))
        assert m["shaped_reward_mean"] == pytest.approx(sum(ref) / len(ref), abs=1e-9)
        assert m["frac_truncated"] == pytest.approx(sum(tr) / len(tr))
        if "budget" in cfg:
            assert m["frac_over_budget"] == pytest.approx(sum(x > B for x in L) / len(L))


def test_lambda_zero_laconic_equals_grpo():
    for seed in range(5):
        rt, Lt, trt, _ = _t(*_batch(seed, graded=seed % 2 == 0))
        lac = Shaper("laconic", budget=1000, max_length=LMAX, penalty_cap=0.4)
        grpo = Shaper("grpo", budget=1000, max_length=LMAX)
        a, _ = by_groups(lac, rt, Lt, trt, 8, 0.0)
        b, _ = by_groups(grpo, rt, Lt, trt, 8, 0.0)
        assert torch.equal(a, b)
        assert torch.equal(group_advantages(as_groups(a, 8)), group_advantages(as_groups(b, 8)))


def test_laconic_reward_ordering_at_ceiling():
    """With lambda <= Lambda = B / (L_max - B), every correct response outranks every incorrect in-budget one."""
    B = 1500
    dual = DualController(B, 10.0, max_length=LMAX)
    assert dual.ceiling == B / (LMAX - B)
    dual.update(10 * LMAX)  # one huge step, clipped at the ceiling
    assert dual.value == dual.ceiling
    r = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    L = torch.tensor([LMAX - 1, 2000, 0, B])
    shaped, _ = by_groups(Shaper("laconic", budget=B, max_length=LMAX), r, L, None, 4, dual.value)
    assert min(shaped[:2]) > max(shaped[2:])


# ---------------------------------------------------------------- lambda: the controller or a constant
def test_adaptive_dual_update_and_state():
    cfg, s = shaper_from_config({**BASE_CFG, "eta": 0.01, "floor": 1e-5, "lambda_init": 1e-5})
    assert SHAPERS["laconic"].lam == "dual" and s.value == 1e-5
    lam = next_lambda(s, s.value, 3000)
    assert lam == pytest.approx(1e-5 + 0.01 * (3000 / 1500 - 1)) and s.value == lam
    _, m = by_groups(recipe_shaper(cfg), torch.ones(4), torch.tensor([100, 200, 300, 4000]), None, 4, s.value)
    assert m["lambda"] == lam
    sd = shaper_state("laconic", s)
    _, t = shaper_from_config({**BASE_CFG, "eta": 0.01, "floor": 1e-5, "lambda_init": 1e-5})
    load_shaper_state("laconic", t, sd)
    assert t.value.hex() == s.value.hex()
    with pytest.raises(ValueError, match="shaper"):
        load_shaper_state("linear", shaper_from_config({**BASE_CFG, "shaper": "linear"})[1], sd)
    with pytest.raises(ValueError, match="eta"):
        load_shaper_state("laconic", shaper_from_config({**BASE_CFG, "floor": 1e-5, "lambda_init": 1e-5})[1], sd)


@pytest.mark.parametrize("name", ["fixed", "grpo", "l1_exact", "l1_max", "efficient", "overlong"])
def test_non_adaptive_dual_interface_is_noop(name):
    targets = {"target_length_range": [100, 200]} if SHAPERS[name].needs_targets else {}  # the L1 shapers' data key
    cfg, dual = shaper_from_config({**BASE_CFG, "shaper": name, "budget": 1000, "lambda_init": 0.01}, **targets)
    lam0 = constant_lambda(cfg.laconic)
    assert lam0 == (0.01 if name == "fixed" else 0.0)
    assert dual is None and SHAPERS[name].lam != "dual"
    assert next_lambda(dual, lam0, 3000.0) == lam0
    sd = shaper_state(name, dual)
    load_shaper_state(name, dual, sd)
    assert constant_lambda(cfg.laconic) == lam0
    with pytest.raises(ValueError, match="global_mean_length"):
        next_lambda(dual, lam0, math.nan)


def test_linear_shaper_rewards_shortness_below_budget():
    s = Shaper("linear", budget=1000, max_length=LMAX)
    shaped, m = by_groups(s, torch.ones(3), torch.tensor([0, 500, 1000]), None, 3, 0.1)
    assert shaped.tolist() == pytest.approx([1.1, 1.05, 1.0])
    assert m["mean_cost"] == pytest.approx(-0.5)


def test_truncated_default_from_max_length():
    s = Shaper("laconic", budget=1000, max_length=2000, hit_cap=0.5)
    shaped, m = by_groups(s, torch.ones(2), torch.tensor([1999, 2000]), None, 2, 0.0)
    assert shaped.tolist() == [1.0, 0.5] and m["frac_truncated"] == 0.5


# ---------------------------------------------------------------- errors
def test_bad_inputs():
    s = Shaper("laconic", budget=1000, max_length=2000)
    with pytest.raises(ValueError, match="divisible by group_size"):
        by_groups(s, torch.ones(5), torch.ones(5), None, 2, 0.0)
    with pytest.raises(ValueError, match="lengths"):
        s(torch.ones(2, 2), torch.ones(1, 3), None, 0.0)
    with pytest.raises(ValueError, match="max_length"):
        by_groups(s, torch.ones(2), torch.tensor([10, 2001]), None, 2, 0.0)
    with pytest.raises(ValueError, match="truncated"):
        by_groups(s, torch.ones(2), torch.tensor([10, 20]), torch.tensor([0, 1]), 2, 0.0)
    with pytest.raises(ValueError, match="targets"):
        by_groups(Shaper("l1_exact"), torch.ones(2), torch.tensor([10, 20]), None, 2, 0.0)


@pytest.mark.parametrize("override,key", [
    ({"shaper": "laconix"}, "shaper"),
    ({"budget": 0}, "budget"),
    ({"budget": -100}, "budget"),
    ({"budget": "1500"}, "budget"),
    ({"eta": -0.1}, "eta"),
    ({"ceiling": -0.1}, "ceiling"),
    ({"floor": -1.0}, "floor"),
    ({"floor": 0.2, "ceiling": 0.1}, "ceiling"),
    ({"lambda_init": 0.9}, "lambda_init"),
    ({"lambda_init": -1e-6}, "lambda_init"),
    ({"penalty_cap": 0.0}, "penalty_cap"),
    ({"hit_cap": -0.1}, "hit_cap"),
    ({"budget": 5000}, "max_new_tokens"),  # default ceiling needs L_max = rollout.max_new_tokens > B
    ({"bogus_key": 1}, "bogus_key"),
    ({"shaper": "l1_exact", "alpha": -1.0}, "alpha"),
    ({"shaper": "efficient", "alpha": 0}, "alpha"),
    ({"shaper": "overlong", "overlong_buffer": 0}, "overlong_buffer"),
    ({"shaper": "overlong", "overlong_buffer": 5000}, "overlong_buffer"),
    ({"shaper": "overlong", "overlong_penalty": -1}, "overlong_penalty"),
    ({"shaper": "fixed", "lambda_init": -0.01}, "lambda_init"),
])
def test_bad_config_names_key(override, key):
    with pytest.raises(ValueError) as info:
        shaper_from_config({**BASE_CFG, **override})
    assert key in str(info.value)


def test_config_keys_match_base_yaml():
    from pathlib import Path

    import yaml

    from laconic_nemo.config import LaconicConfig

    base = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "base.yaml").read_text())["laconic"]
    assert set(base) == set(LaconicConfig.__dataclass_fields__)
    for name in SHAPERS:  # the base section builds every method
        cfg, _ = shaper_from_config({**base, "shaper": name}, max_length=base_max_length(),
                                    target_length_range=[1, 2])
        assert cfg.laconic.shaper == name and SHAPERS[cfg.laconic.shaper] is SHAPERS[name]
    assert base["shaper"] in SHAPERS


def base_max_length():
    from pathlib import Path

    import yaml

    return yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "base.yaml").read_text())[
        "rollout"]["max_new_tokens"]


def test_omegaconf_section_and_authors_settings():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"laconic": {**BASE_CFG, "budget": 2000, "eta": 0.002, "floor": 1e-5,
                                        "lambda_init": 1e-5, "ceiling": 0.1, "penalty_cap": 0.4, "hit_cap": 0.1}})
    c, dual = shaper_from_config(cfg.laconic, max_length=4096)
    s = c.laconic  # the shaper's settings are the section itself
    assert dual.ceiling == 0.1 and dual.floor == 1e-5 and s.penalty_cap == 0.4 and s.hit_cap == 0.1


def test_lambda_init_below_floor_accepted_first_step_unpenalised():
    """laconic.lambda_init = 0 with laconic.floor = 1e-5 (the authors' DeepScaleR script) builds; the first step
    is shaped with lambda = 0 (no length penalty, only the hit penalty), the first dual step clips to the floor."""
    cfg, dual = shaper_from_config({**BASE_CFG, "floor": 1e-5, "lambda_init": 0.0, "ceiling": 0.1,
                                    "penalty_cap": 0.4, "hit_cap": 0.1})
    r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    L = torch.tensor([100, 3000, LMAX, 1500])
    shaped, _ = by_groups(recipe_shaper(cfg), r, L, None, 2, dual.value)
    assert shaped.tolist() == pytest.approx([1.0, 0.0, 0.9, 0.0], abs=1e-7)
    assert next_lambda(dual, dual.value, 100.0) == 1e-5
