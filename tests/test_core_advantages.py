"""Group-normalised advantages: hand values, float64 reference, invariances, errors."""

import math
import random

import pytest
import torch

from laconic_nemo.core import as_groups, group_advantages


def _reference(values, G, eps, loo=False):
    out = []
    for g in range(len(values) // G):
        grp = [float(v) for v in values[g * G:(g + 1) * G]]
        mean = math.fsum(grp) / G
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in grp) / G)
        if max(grp) == min(grp):
            out += [0.0] * G
            continue
        for v in grp:
            base = (math.fsum(grp) - v) / (G - 1) if loo else mean
            out.append((v - base) / (std + eps))
    return out


def test_hand_values():
    # group [1, 0, 1, 0]: mean 0.5, population std 0.5 -> +-1 (eps=0)
    # group [1, 1, 1, 1]: zero spread -> 0
    # group [0, 0, 0, 3]: mean 0.75, std sqrt((3*0.5625 + 5.0625)/4) = sqrt(1.6875)
    r = torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 3])
    a = group_advantages(as_groups(r, 4), eps=0.0).flatten()
    s = math.sqrt(1.6875)
    expected = [1, -1, 1, -1, 0, 0, 0, 0, -0.75 / s, -0.75 / s, -0.75 / s, 2.25 / s]
    assert a.tolist() == pytest.approx(expected, abs=1e-6)
    assert a.dtype == torch.float32


def test_population_std_not_sample_std():
    a = group_advantages(as_groups(torch.tensor([0.0, 2.0], dtype=torch.float64), 2), eps=0.0).flatten()
    assert a.tolist() == [-1.0, 1.0]  # population std 1; sample std would give +-0.7071


def test_leave_one_out_hand_values():
    # [3, 0, 0]: mean 1, std sqrt(2); LOO baselines 0, 1.5, 1.5 -> (3, -1.5, -1.5) / sqrt(2)
    a = group_advantages(as_groups(torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64), 3), eps=0.0,
                         leave_one_out=True).flatten()
    s = math.sqrt(2)
    assert a.tolist() == pytest.approx([3 / s, -1.5 / s, -1.5 / s], rel=1e-14)


def test_matches_float64_reference_random():
    rng = random.Random(1)
    for trial in range(30):
        G = rng.choice([2, 3, 4, 8, 16])
        P = rng.randint(1, 8)
        vals = [rng.choice([0.0, 1.0, rng.uniform(-3, 3)]) for _ in range(P * G)]
        if trial % 5 == 0:
            vals[:G] = [0.7] * G  # a flat group
        eps = rng.choice([0.0, 1e-6, 1e-2])
        for loo in (False, True):
            a = group_advantages(as_groups(torch.tensor(vals, dtype=torch.float64), G), eps=eps,
                                 leave_one_out=loo).flatten()
            assert a.tolist() == pytest.approx(_reference(vals, G, eps, loo), rel=1e-12, abs=1e-12)
            a32 = group_advantages(as_groups(torch.tensor(vals, dtype=torch.float32), G), eps=eps,
                                   leave_one_out=loo).flatten()
            assert a32.dtype == torch.float32
            ref32 = _reference(torch.tensor(vals, dtype=torch.float32).tolist(), G, eps, loo)
            assert a32.tolist() == pytest.approx(ref32, rel=1e-5, abs=1e-5)


def test_flat_groups_exactly_zero():
    for v in (0.1, 1 / 3, 1e8 + 0.1, -7.25):
        for G in (1, 3, 7, 16):
            a = group_advantages(as_groups(torch.full((2 * G,), v, dtype=torch.float32), G), eps=0.0).flatten()
            assert torch.equal(a, torch.zeros(2 * G))


def test_properties_sum_zero_shift_and_scale_invariance():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        G = int(torch.randint(2, 17, (1,), generator=g))
        P = int(torch.randint(1, 9, (1,), generator=g))
        r = torch.randn(P * G, generator=g, dtype=torch.float64)
        for loo in (False, True):
            a = group_advantages(as_groups(r, G), eps=0.0, leave_one_out=loo).flatten()
            assert a.view(P, G).sum(1).abs().max() < 1e-12
            shift = torch.randn(P, generator=g, dtype=torch.float64).repeat_interleave(G) * 100
            assert torch.allclose(group_advantages(as_groups(r + shift, G), eps=0.0, leave_one_out=loo).flatten(), a,
                                  atol=1e-9)
            scale = float(torch.rand(1, generator=g)) * 50 + 0.01
            assert torch.allclose(group_advantages(as_groups(r * scale, G), eps=0.0, leave_one_out=loo).flatten(), a,
                                  atol=1e-10)
            # with eps > 0 the scale invariance holds up to eps / std
            a_eps = group_advantages(as_groups(r * 1e3, G), eps=1e-6, leave_one_out=loo).flatten()
            assert torch.allclose(a_eps, a, rtol=1e-6, atol=1e-8)
        # leave-one-out is the plain advantage scaled by G / (G - 1)
        assert torch.allclose(group_advantages(as_groups(r, G), leave_one_out=True).flatten(),
                              group_advantages(as_groups(r, G)).flatten() * G / (G - 1), atol=1e-12)


def test_integer_input_and_empty():
    a = group_advantages(as_groups(torch.tensor([1, 0, 0, 0]), 2), eps=0.0).flatten()
    assert a.dtype == torch.get_default_dtype() and a.tolist() == [1.0, -1.0, 0.0, 0.0]
    assert group_advantages(as_groups(torch.zeros(0), 4)).flatten().numel() == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rewards=torch.zeros(10), group_size=4), "divisible by group_size"),
        (dict(rewards=torch.zeros(8), group_size=0), "group_size"),
        (dict(rewards=torch.zeros(8), group_size=2.0), "group_size"),
        (dict(rewards=torch.zeros(2, 4), group_size=4), "flat"),
        (dict(rewards=torch.zeros(8), group_size=4, eps=-1.0), "eps"),
        (dict(rewards=torch.zeros(8), group_size=1, leave_one_out=True), "leave_one_out"),
        (dict(rewards=torch.tensor([0.0, math.nan]), group_size=2), "finite"),
    ],
)
def test_errors(kwargs, match):
    kwargs = dict(kwargs)
    rewards, group_size = kwargs.pop("rewards"), kwargs.pop("group_size")
    with pytest.raises(ValueError, match=match):
        group_advantages(as_groups(rewards, group_size), **kwargs)


@pytest.mark.parametrize("G", [2, 4, 6])
def test_unbiased_std_matches_float64_reference_and_torch_std(G):
    """grpo.advantage_std = unbiased: (l - mean) / (std_{G-1} + eps), as EasyR1's compute_grpo_outcome_advantage
    (torch.std, unbiased); checked against a float64 re-implementation and torch.std itself."""
    rng = random.Random(G)
    vals = [rng.choice([0.0, 0.9, 1.0, 0.1]) - rng.uniform(0, 0.4) * rng.random() for _ in range(8 * G)]
    vals[:G] = [0.5] * G  # one group without spread
    eps = 1e-6
    ref = []
    for g in range(8):
        grp = vals[g * G:(g + 1) * G]
        mean = math.fsum(grp) / G
        s = math.sqrt(math.fsum((v - mean) ** 2 for v in grp) / (G - 1))
        ref += [0.0] * G if max(grp) == min(grp) else [(v - mean) / (s + eps) for v in grp]
    r = torch.tensor(vals, dtype=torch.float64)
    a = group_advantages(as_groups(r, G), eps=eps, std="unbiased").flatten()
    assert a.tolist() == pytest.approx(ref, rel=1e-12, abs=1e-12)
    grouped = r.view(-1, G)
    easyr1 = (grouped - grouped.mean(1, keepdim=True)) / (torch.std(grouped, dim=1, keepdim=True) + eps)
    assert torch.allclose(a.view(-1, G)[1:], easyr1[1:], rtol=1e-12, atol=1e-12)
    pop = group_advantages(as_groups(r, G), eps=0.0, std="population").flatten()
    unb = group_advantages(as_groups(r, G), eps=0.0, std="unbiased").flatten()
    assert torch.allclose(pop, unb * math.sqrt(G / (G - 1)), rtol=1e-12, atol=1e-12)


def test_advantage_std_rejects_unknown_and_g1():
    with pytest.raises(ValueError, match="advantage_std"):
        group_advantages(as_groups(torch.zeros(4), 2), std="sample")
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(as_groups(torch.zeros(4), 1), std="unbiased")
