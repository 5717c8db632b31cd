"""The authors' LACONIC semantics, 50 dual steps per knob set, against an independent float64 re-implementation.

The reference follows the authors' public description of their trainer (CLAUDE.md of Debugger001/Length-Aware-LLM,
branch LACONIC-code, "The LACONIC Algorithm": penalty = min(lambda * max(0, (L - B)/B), penalty_cap), plus hit_cap
when L hit max_response_length, subtracted from the score; lambda <- clip(lambda + dual_lr * (mean(L / B) - 1),
floor, ceil) after the update, the initial lambda unclipped) and EasyR1 v0.3.2.dev0 (L = response-mask sum,
which keeps the first EOS: verl/utils/torch_functional.py::get_response_mask; GRPO advantage
(score - mean) / (torch.std(group) + 1e-6): verl/trainer/core_algos.py::compute_grpo_outcome_advantage).
Our side runs the recipes through the trainer's own code (grpo/trainer.py: the lambda controller, shaped_advantages).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from laconic_nemo.config import load_config
from laconic_nemo.core import as_groups, cost_lengths, lambda_controller
from laconic_nemo.grpo.trainer import shaped_advantages

ROOT = Path(__file__).resolve().parent.parent

# recipes carrying the authors' knob sets: B 2000 / 1500 / 1000 / 550, eta 0.002 / 0.01, floor 1e-5 / 0,
# ceiling 0.1 / 0.15 / 1 / 10, penalty cap 0.4, hit cap 0.1, lambda_init 0 (below the floor in the first)
RECIPES = ["deepscaler_1.5b_b2000", "deepseek_1.5b_b1500", "ablation_eta_0.01", "qwen3_8b_b1000",
           "qwen_math_1.5b_b550"]


def _authors_scores(lam, rewards, mask_lengths, B, lmax, cap, hit):
    out = []
    for r, L in zip(rewards, mask_lengths):
        penalty = min(lam * max(0.0, (L - B) / B), cap)
        if L == lmax:
            penalty += hit
        out.append(r - penalty)
    return out


def _easyr1_grpo(scores, G, eps=1e-6):
    out = []
    for g in range(len(scores) // G):
        grp = scores[g * G:(g + 1) * G]
        mean = math.fsum(grp) / G
        std = math.sqrt(math.fsum((s - mean) ** 2 for s in grp) / (G - 1))
        out += [(s - mean) / (std + eps) for s in grp]
    return out


def _authors_dual(lam, mask_lengths, B, eta, floor, ceil):
    ratio = math.fsum(L / B for L in mask_lengths) / len(mask_lengths)
    return min(max(lam + eta * (ratio - 1.0), floor), ceil)


@pytest.mark.parametrize("name", RECIPES)
def test_fifty_dual_steps_match_the_authors_semantics(name):
    cfg = load_config(ROOT / "recipes" / f"{name}.yaml")
    lc, G, lmax = cfg.laconic, int(cfg.grpo.group_size), int(cfg.rollout.max_new_tokens)
    assert lc.count_eos and cfg.grpo.advantage_std == "unbiased" and lc.lambda_init == 0.0
    B, eta, floor, ceil = float(lc.budget), float(lc.eta), float(lc.floor), float(lc.ceiling)
    cap, hit = float(lc.penalty_cap), float(lc.hit_cap)
    dual = lambda_controller(cfg.laconic, cfg.rollout.max_new_tokens)  # as GRPOTrainer builds it
    rng = random.Random(name)
    lam_ref = 0.0
    prompts = 16
    clipped_at = {"floor": 0, "ceiling": 0}
    lam_max = 0.0
    for step in range(50):
        # lengths: over budget for the first 15 steps (lambda rises), well under it after (lambda falls to the floor);
        # some responses truncated (no EOS, L_max tokens), some ending on EOS exactly at the L_max-th token
        over = step < 15
        scale, p_trunc, p_eos_at_lmax = (1.6, 0.1, 0.05) if over else (0.3, 0.02, 0.01)
        gen_len, trunc, mask_len, rewards = [], [], [], []
        for _ in range(prompts * G):
            kind = rng.random()
            if kind < p_trunc:
                n, t = lmax, True                      # truncated: mask = L_max tokens, no EOS
            elif kind < p_trunc + p_eos_at_lmax:
                n, t = lmax - 1, False                 # EOS is the L_max-th token: mask sum L_max
            else:
                n, t = min(lmax - 2, max(1, int(rng.gauss(scale * B, 0.3 * B)))), False
            gen_len.append(n)
            trunc.append(t)
            mask_len.append(n if t else n + 1)
            rewards.append(rng.choice([0.0, 0.1, 0.9, 1.0]))
        L, flags = cost_lengths(torch.tensor(gen_len), torch.tensor(trunc), count_eos=True)
        assert L.tolist() == mask_len and flags is None
        lam_used = dual.value
        assert lam_used == lam_ref
        shaped, adv, _ = shaped_advantages(cfg, as_groups(torch.tensor(rewards, dtype=torch.float64), G),
                                           as_groups(L, G), lam_used, truncated=flags)
        ref = _authors_scores(lam_ref, rewards, mask_len, B, lmax, cap, hit)
        assert shaped.flatten().tolist() == pytest.approx(ref, abs=1e-12)
        assert adv.flatten().tolist() == pytest.approx(_easyr1_grpo(ref, G), rel=1e-9, abs=1e-9)
        mean_L = float(int(L.sum())) / float(L.numel())          # the trainer's exact global mean
        lam_new = dual.update(mean_L)
        lam_ref = _authors_dual(lam_ref, mask_len, B, eta, floor, ceil)
        assert lam_new == pytest.approx(lam_ref, rel=1e-12, abs=1e-15)
        assert floor <= lam_new <= ceil
        lam_ref = lam_new  # both sides continue from the same lambda (differences stay at rounding level)
        lam_max = max(lam_max, lam_new)
        clipped_at["floor"] += lam_new == floor
        clipped_at["ceiling"] += lam_new == ceil
    assert clipped_at["floor"] > 0, "the run must reach the floor (lengths under budget)"
    assert lam_max > floor + 5 * eta, "lambda must rise while the lengths are over budget"


def test_first_step_unclipped_then_floor():
    """deepscaler_1.5b_b2000: lambda_init 0 < floor 1e-5 prices step 1 (only hit penalties), then a dual step
    under budget lands exactly on the floor, as the authors' clip(lambda + dual_lr (ratio - 1), floor, ceil)."""
    cfg = load_config(ROOT / "recipes" / "deepscaler_1.5b_b2000.yaml")
    dual = lambda_controller(cfg.laconic, cfg.rollout.max_new_tokens)
    shaped, _, _ = shaped_advantages(cfg, torch.tensor([[1.0, 1.0, 0.0, 0.9]]), torch.tensor([[3000, 4096, 100, 2500]]),
                                     dual.value)
    assert shaped.flatten().tolist() == pytest.approx([1.0, 0.9, 0.0, 0.9], abs=1e-7)
    assert dual.update(1000.0) == 1e-5
