"""Trainer pieces that need no model: L1 target lengths, config checks at construction."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from laconic_nemo.config import load_config
from laconic_nemo.grpo.trainer import GRPOTrainer

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny_cpu.yaml"


def make_trainer(overrides, dp_rank=0, dp_size=1):
    cfg = load_config(TINY, overrides)
    actor = SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size, dp_group=None)
    prompts = [(f"P{i}", str(i)) for i in range(50)]
    return GRPOTrainer(cfg, actor, encode=list, decode=str, prompts=prompts, reward_fn=None, eos_id=1)


def test_l1_targets_are_drawn_in_range_stated_in_the_prompt_and_layout_independent():
    ov = ["laconic.shaper=l1_exact", "data.target_length_range=[20,60]"]
    t = make_trainer(ov)
    texts, targets = t._prompt_texts(3, [4, 7, 9])
    assert all(20 <= n <= 60 for n in targets)
    assert texts == [f"P{i} Think for {n} tokens." for i, n in zip([4, 7, 9], targets)]
    # the same prompt at the same step gets the same target on any rank / layout, and differs across steps
    other = make_trainer(ov, dp_rank=1, dp_size=2)
    assert other._prompt_texts(3, [7])[1] == [targets[1]]
    draws = {tuple(t._prompt_texts(s, [4, 7, 9])[1]) for s in range(20)}
    assert len(draws) > 15


def test_shapers_needing_targets_fail_early_without_a_range():
    with pytest.raises(ValueError, match="data.target_length_range"):
        make_trainer(["laconic.shaper=l1_max"])
    with pytest.raises(ValueError, match="data.target_length_range"):
        make_trainer(["laconic.shaper=l1_max", "data.target_length_range=[9,3]"])
    assert make_trainer([])._prompt_texts(0, [1, 2]) == (["P1", "P2"], None)


def test_batch_sizes_must_fit_the_data_parallel_layout():
    with pytest.raises(ValueError, match="num_prompts_per_step"):
        make_trainer(["grpo.num_prompts_per_step=15", "grpo.minibatch_size=120"], dp_size=2)
    with pytest.raises(ValueError, match="minibatch_size"):
        make_trainer(["grpo.minibatch_size=1"], dp_size=2)  # divides the rollout, not DP
