"""The synthetic task's budget-aware warm-up (data.synthetic.stated_share, stated_range, budget_follow) and its
per-prompt budgets from the data (data.synthetic.budgets_by_terms written to the field data.budget_key)."""

import hashlib
import json
import random
from pathlib import Path

import pytest

from laconic_nemo.config import ConfigError, load_config, state_target
from laconic_nemo.data.synthetic import FILLER, Problem, SyntheticTask

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")
STATED = str(ROOT / "recipes" / "tiny_cpu_stated.yaml")
PER_PROMPT = str(ROOT / "recipes" / "tiny_cpu_per_prompt.yaml")

# sha256 of the main recipe's first 20 warm-up batches (the prompt and response token ids of each example, in order),
# as the warm-up drew them before the stated-budget option existed (measured on that code): the main job's warm-up
MAIN_WARMUP_STREAM = "c8b031d810e9cc626d8ac377d1e15a00954f3d4e6fd6c986ae675dcffb95a4d9"


def warmup_stream_digest(cfg, steps: int = 20) -> str:
    """The digest of the warm-up examples of ``steps`` batches as ``supervised_warmup`` draws them."""
    from laconic_nemo.app.task import build_task

    task = build_task(cfg)
    h = hashlib.sha256()
    for step in range(steps):
        rng = random.Random(cfg.run.seed * 7919 + step)  # supervised_warmup's stream
        for _ in range(cfg.warmup.batch_size):
            p, r = task.warmup_example(rng)
            h.update(json.dumps([p, r]).encode())
    return h.hexdigest()


def test_the_main_jobs_warmup_data_are_unchanged():
    """Without a stated budget the warm-up draws exactly what it drew before the option: the main job's warm-up
    (and so its policy and metrics) is unchanged."""
    assert warmup_stream_digest(load_config(TINY)) == MAIN_WARMUP_STREAM
    # the option's other keys do nothing while no prompt states a budget
    off = load_config(TINY, ["data.synthetic.budget_follow=0.3", "data.synthetic.stated_range=[20,30]"])
    assert warmup_stream_digest(off, steps=2) == warmup_stream_digest(load_config(TINY), steps=2)


def test_fitted_answers_have_the_length_nearest_the_budget():
    """Hand-worked: worked 5 k + 9, compact 2 k + 9, abbreviated 9 tokens, each filler phrase 5."""
    t = SyntheticTask(max_filler=6)
    p2, p5, p8 = Problem((3, 3)), Problem((3,) * 5), Problem((3,) * 8)
    cases = {
        (p2, 16): "hmm. a3b6\\boxed{6}",                 # compact 13 + 5 = 18 (|2|) beats worked 19 (|3|)
        (p2, 24): "hmm. a3:3,b3:6,\\boxed{6}",           # worked 19 + 5 = 24 exactly
        (p5, 32): "a3:3,b3:6,c3:9,d3:2,e3:5,\\boxed{5}",  # worked 34 (|2|) ties compact 19 + 15 = 34: worked
        (p5, 16): "a3b6c9d2e5\\boxed{5}",                # compact 19 (|3|) beats abbreviated 9 (|7|)
        (p8, 16): "\\boxed{4}",                          # abbreviated 9 (|7|) beats compact 25 (|9|)
        (p8, 48): "a3:3,b3:6,c3:9,d3:2,e3:5,f3:8,g3:1,h3:4,\\boxed{4}",  # worked 49
    }
    for (p, b), want in cases.items():
        got = t.fitted_solution(p, b)
        assert got == want, (p, b, got)
        assert got.endswith(f"\\boxed{{{p.answer}}}")
    # capped by max_filler: at most 6 phrases
    assert t.fitted_solution(p2, 90).count(FILLER) == 6
    # the marker counts towards the length
    marked = SyntheticTask(max_filler=6, reasoning_marker="ok.")
    assert marked.fitted_solution(p2, 27) == "hmm. a3:3,b3:6,ok.\\boxed{6}"  # worked 22 + 5 = 27


def test_warmup_length_follows_the_stated_budget_as_documented():
    """The documented knob: over stated budgets 16..56 the warm-up's mean length rises by about budget_follow
    tokens per token of budget (measured on a fixed seed: slopes 0, 0.47, 0.93 for budget_follow 0, 0.5, 1)."""
    budgets = [16, 20, 24, 28, 32, 40, 48, 56]
    slopes = {}
    for follow in (0.0, 0.5, 1.0):
        slope, means = SyntheticTask(max_filler=6, budget_follow=follow).length_slope(budgets, n=1000, seed=0)
        slopes[follow] = slope
        if follow > 0:
            assert all(a <= b for a, b in zip(means, means[1:])), means  # longer for every larger budget
    assert slopes[0.0] == 0.0  # no example follows: the same answers whatever the budget
    assert 0.4 <= slopes[0.5] <= 0.55, slopes
    assert 0.85 <= slopes[1.0] <= 1.0, slopes
    # always following, the mean length is the budget's within 2 tokens over the styles' reach (20..48)
    _, means = SyntheticTask(max_filler=6, budget_follow=1.0).length_slope([20, 24, 28, 32, 40, 48], n=1000)
    assert all(abs(m - b) <= 2.0 for m, b in zip(means, [20, 24, 28, 32, 40, 48])), means


def test_stated_warmup_prompts_state_the_budget_in_the_rl_words():
    t = SyntheticTask(max_filler=6, stated_share=0.5, stated_range=(12, 60), budget_follow=0.5)
    rng = random.Random(5)
    n, stated, fitted = 4000, 0, 0
    for _ in range(n):
        prompt, response = t.warmup_example(rng, state=lambda b: state_target("m{target}\n", b))
        lines = prompt.split("\n")
        assert lines[0].startswith("Q:") and prompt.endswith("\n")
        if len(lines) == 3:  # "Q:...", "m<b>", ""
            stated += 1
            b = int(lines[1][1:])
            assert 12 <= b <= 60
            fitted += response == t.fitted_solution(Problem(tuple(int(c) for c in lines[0][3::2])), b)
    assert abs(stated / n - 0.5) < 0.03
    # about half of the stated examples are the fitted answer (a few unfitted draws coincide with it)
    assert 0.5 <= fitted / stated < 0.6
    with pytest.raises(ValueError, match="stated_share > 0 needs the instruction"):
        t.warmup_example(random.Random(0))


def test_budget_aware_warmup_settings_are_checked_naming_the_key():
    bad = {"data.synthetic.stated_share=1.5": "data.synthetic.stated_share",
           "data.synthetic.budget_follow=-0.1": "data.synthetic.budget_follow",
           "data.synthetic.stated_range=[30,20]": "data.synthetic.stated_range",
           "data.synthetic.budgets_by_terms=[20,30]": "data.synthetic.budgets_by_terms"}
    for override, key in bad.items():
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(TINY, [override])
    # a stated budget in the warm-up needs an instruction the character tokenizer can write
    with pytest.raises(ConfigError, match="data.target_instruction"):
        load_config(TINY, ["data.synthetic.stated_share=0.5", "data.target_instruction=Think for {target}."])
    # per-prompt budgets from the synthetic rows need the field they are written to, and vice versa
    with pytest.raises(ConfigError, match="data.synthetic.budgets_by_terms"):
        load_config(TINY, ["data.synthetic.budgets_by_terms=[1,2,3,4,5,6,7]"])
    with pytest.raises(ConfigError, match="data.budget_key"):
        load_config(TINY, ["laconic.per_prompt_budget=true", "data.budget_key=budget"])


def test_warmup_cache_key_names_the_stated_budget_settings(tmp_path):
    from laconic_nemo.app.warmup import warmup_cache_dir, warmup_cache_key

    base = [f"warmup.cache_dir={tmp_path}"]
    plain = warmup_cache_key(load_config(TINY, base), 2, 1)["synthetic"]
    assert not {"stated_share", "stated_range", "budget_follow", "budgets_by_terms", "instruction"} & set(plain)
    on = [*base, "data.synthetic.stated_share=0.5", "data.target_instruction=m{target}."]
    key = warmup_cache_key(load_config(TINY, on), 2, 1)["synthetic"]
    assert (key["stated_share"], key["budget_follow"], key["instruction"]) == (0.5, 1.0, "m{target}.")
    other = warmup_cache_dir(load_config(TINY, [*on[:-1], "data.target_instruction=max{target}\n"]), 2, 1)
    assert other != warmup_cache_dir(load_config(TINY, on), 2, 1)
    # the RL prompts' budgets (stated or from the data) do not change the warm-up
    stated = load_config(STATED, base)
    assert warmup_cache_dir(stated, 2, 1) == warmup_cache_dir(load_config(STATED, [*base, "data.target_lengths=[20]"]),
                                                              2, 1)


def test_per_prompt_budgets_are_a_function_of_the_visible_problem():
    """The per-prompt recipe's rows carry B_i = budgets_by_terms[k - min_terms] in the field data.budget_key; the
    task hands them to the trainer in the prompts' order."""
    from laconic_nemo.app.task import build_task

    cfg = load_config(PER_PROMPT)
    key = str(cfg.data.budget_key)
    table = list(cfg.data.synthetic.budgets_by_terms)
    task = build_task(cfg)
    assert len(task.budgets) == len(task.prompts) == cfg.data.num_prompts
    for (prompt, _), b in zip(task.prompts, task.budgets):
        k = (len(prompt) - 3) // 2  # "Q:" + k letter-digit pairs + "\n"
        assert b == table[k - cfg.data.synthetic.min_terms]
    rows = SyntheticTask(**{"min_terms": 2, "max_terms": 4, "budgets_by_terms": [11, 13, 17]}).rows(6, seed=1,
                                                                                                  budget_key=key)
    assert [r[key] for r in rows] == [{2: 11, 3: 13, 4: 17}[(len(r["problem"]) - 3) // 2] for r in rows]
    assert all(set(r) == {"problem", "answer", key} for r in rows)
    # the prompts are the plain task's, in the same order
    assert [p for p, _ in task.prompts] == [p for p, _ in build_task(load_config(TINY)).prompts]


def test_the_resume_check_builds_the_per_prompt_classes_from_the_synthetic_rows():
    """The pre-flight's restore of a checkpoint's constraint state (grpo/constraints.py:restore_resume_state)
    builds the per-prompt run's classes from the synthetic rows' B_i, as the trainer does: a checkpoint of the same
    classes is restored by key, one of other bins is refused naming the key."""
    from laconic_nemo.app.task import build_task
    from laconic_nemo.config import to_dict
    from laconic_nemo.core import shaper_state
    from laconic_nemo.grpo.constraints import (
        build_constraints,
        restore_constraints,
        restore_resume_state,
        run_budgets,
    )
    from laconic_nemo.grpo.resume import ResumeError

    cfg = load_config(PER_PROMPT)
    budgets = run_budgets(cfg)
    assert budgets == [float(b) for b in build_task(cfg).budgets]
    classes = build_constraints(cfg, budgets).classes
    assert classes.names == ["16-24", "24-32", "32-40"]
    classes.duals[2].update(1.5)  # rho 1.5 in the bin [32, 40]: its multiplier moves, the others stay at 0
    assert classes.duals[2].value > 0.0
    state = {"constraints": {"classes": classes.state_dict()}, "config": to_dict(cfg),
             "shaper": shaper_state(cfg.laconic.shaper, None)}
    restore_resume_state("ckpt", state, cfg)
    fresh = build_constraints(cfg, run_budgets(cfg))
    restore_constraints("ckpt", state, fresh, cfg)
    assert [d.value for d in fresh.classes.duals] == [0.0, 0.0, classes.duals[2].value]
    other = load_config(PER_PROMPT, ["laconic.budget_classes=[16,30,40]"])
    with pytest.raises(ResumeError, match=r"laconic\.budget_classes"):
        restore_resume_state("ckpt", state, other)
