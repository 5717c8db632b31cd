"""Length costs and the Lagrangian reward against hand-worked values and float64 references."""

import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from laconic_nemo.core import clipped_cost, default_ceiling, lagrangian_reward, linear_cost

ROOT = Path(__file__).resolve().parents[1]


def test_clipped_cost_hand_values():
    L = torch.tensor([0, 1000, 1500, 1501, 3000, 4096])
    c = clipped_cost(L, 1500)
    expected = [0.0, 0.0, 0.0, 1 / 1500, 1.0, 2596 / 1500]
    assert c.dtype == torch.get_default_dtype()
    assert c.tolist() == pytest.approx(expected, rel=1e-6, abs=0)


def test_linear_cost_hand_values():
    c = linear_cost(torch.tensor([0, 750, 1500, 3000]), 1500)
    assert c.tolist() == pytest.approx([-1.0, -0.5, 0.0, 1.0], abs=1e-7)


def test_costs_keep_float_dtype_and_match_float64_reference():
    rng = random.Random(0)
    for _ in range(20):
        B = rng.uniform(10, 5000)
        lens = [rng.uniform(0, 3 * B) for _ in range(64)]
        for dtype in (torch.float32, torch.float64):
            L = torch.tensor(lens, dtype=dtype)
            cc, lc = clipped_cost(L, B), linear_cost(L, B)
            assert cc.dtype == dtype and lc.dtype == dtype
            ref_l = [(float(x) - B) / B for x in L.tolist()]
            ref_c = [max(v, 0.0) for v in ref_l]
            tol = 1e-6 if dtype == torch.float32 else 1e-15
            assert cc.tolist() == pytest.approx(ref_c, rel=tol, abs=tol)
            assert lc.tolist() == pytest.approx(ref_l, rel=tol, abs=tol)
            assert (cc >= 0).all()
            assert torch.equal(cc, lc.clamp_min(0))


def test_lagrangian_reward_values():
    r = torch.tensor([1.0, 0.0, 1.0, 0.5])
    c = torch.tensor([0.0, 2.0, 0.5, 1.0])
    out = lagrangian_reward(r, c, 0.2)
    assert out.tolist() == pytest.approx([1.0, -0.4, 0.9, 0.3], abs=1e-7)
    assert torch.equal(lagrangian_reward(r, c, 0.0), r)
    per_sample = lagrangian_reward(r, c, torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert per_sample.tolist() == pytest.approx([1.0, -2.0, 0.0, -2.5], abs=1e-7)


def test_long_correct_response_vs_ceiling():
    """Lagrangian reward of a correct length-L_max response is >= 0 (an incorrect in-budget one) iff
    lambda <= B / (L_max - B)."""
    for B, Lmax in [(2000, 4096), (1500, 4096), (1000, 4096), (550, 4096), (100, 101)]:
        ceil = default_ceiling(B, Lmax)
        assert ceil == B / (Lmax - B)
        c = clipped_cost(torch.tensor([Lmax], dtype=torch.float64), B)
        one = torch.ones(1, dtype=torch.float64)
        for lam in (0.0, 0.25 * ceil, 0.999 * ceil):
            assert lagrangian_reward(one, c, lam).item() > 0
        assert lagrangian_reward(one, c, ceil).item() == pytest.approx(0.0, abs=1e-12)
        for lam in (1.001 * ceil, 2 * ceil):
            assert lagrangian_reward(one, c, lam).item() < 0
        # shorter correct responses stay strictly positive at the ceiling
        shorter = clipped_cost(torch.tensor([Lmax - 1, B, B // 2], dtype=torch.float64), B)
        assert (lagrangian_reward(torch.ones(3, dtype=torch.float64), shorter, ceil) > 0).all()


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan, None, True, "100"])
def test_bad_budget_raises(bad):
    with pytest.raises(ValueError, match="budget"):
        clipped_cost(torch.tensor([1, 2]), bad)
    with pytest.raises(ValueError, match="budget"):
        linear_cost(torch.tensor([1, 2]), bad)


def test_lagrangian_shape_mismatch_raises():
    with pytest.raises(ValueError, match="same shape"):
        lagrangian_reward(torch.zeros(3), torch.zeros(4), 0.1)
    with pytest.raises(ValueError, match="lam"):
        lagrangian_reward(torch.zeros(3), torch.zeros(3), math.nan)


def test_default_ceiling_needs_max_length_above_budget():
    with pytest.raises(ValueError, match="max_length"):
        default_ceiling(4096, 4096)


def test_core_imports_no_megatron_nemo_vllm():
    """laconic_nemo.core is torch only: neither its source nor its import pulls megatron / NeMo / vLLM."""
    forbidden = ("megatron", "nemo_aligner", "nemo", "vllm")
    for path in (ROOT / "laconic_nemo" / "core").rglob("*.py"):
        for line in path.read_text().splitlines():
            s = line.strip()
            if s.startswith(("import ", "from ")):
                mod = s.split()[1].split(".")[0]
                assert mod not in forbidden, f"{path.name}: {s}"
    code = ("import sys, laconic_nemo.core\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('megatron', 'nemo', 'nemo_aligner', 'vllm')]\n"
            "print(bad); assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cost_lengths_count_eos_follows_easyr1_response_mask():
    """count_eos: L = the sum of EasyR1's response mask (get_response_mask keeps the first EOS), and the hit flag
    is L == L_max; paper form: L without EOS and the engine's truncation flags."""
    from laconic_nemo.core import cost_lengths

    lmax = 8
    # responses as token lists (2 = EOS); the engine's lengths exclude EOS, truncated = no EOS within L_max
    responses = [[5, 6, 2], [5] * 7 + [2], [5] * 8, [2]]
    lengths = torch.tensor([sum(1 for t in r if t != 2) for r in responses])
    truncated = torch.tensor([2 not in r for r in responses])
    padded = torch.tensor([r + [0] * (lmax - len(r)) for r in responses])
    is_eos = padded.eq(2).long()
    easyr1_mask = torch.logical_not((torch.cumsum(is_eos, dim=1) - is_eos).bool()).long()
    easyr1_mask = easyr1_mask * (torch.arange(lmax) < torch.tensor([len(r) for r in responses])[:, None])
    L, trunc = cost_lengths(lengths, truncated, count_eos=True)
    assert L.tolist() == easyr1_mask.sum(1).tolist() == [3, 8, 8, 1]
    assert trunc is None  # the shaper then takes L >= L_max: the EOS-at-L_max response is a hit too
    L0, trunc0 = cost_lengths(lengths, truncated, count_eos=False)
    assert L0.tolist() == [2, 7, 8, 0] and trunc0.tolist() == [False, False, True, False]
