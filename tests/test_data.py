"""Prompt sampler, DP sharding, response masks, the synthetic task and the prompt datasets."""

import json
import random

import pytest
import torch

from laconic_nemo.data.datasets import load_math_prompts, read_rows, render
from laconic_nemo.data.sampler import PromptSampler, shard_prompts
from laconic_nemo.data.synthetic import (
    CharTokenizer,
    Problem,
    SyntheticTask,
    abbreviated_solution,
    close_reasoning,
    closes_reasoning,
    compact_solution,
    worked_solution,
)
from laconic_nemo.grpo.interfaces import response_mask


def test_sampler_covers_each_epoch_once_and_is_a_function_of_step():
    s = PromptSampler(num_prompts=10, prompts_per_step=4, seed=3)
    seen = [i for step in range(5) for i in s.batch(step)]  # 20 draws = exactly 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # reshuffled each epoch
    fresh = PromptSampler(num_prompts=10, prompts_per_step=4, seed=3)
    assert fresh.batch(3) == s.batch(3)  # resume needs only the step number
    assert PromptSampler(10, 4, seed=3, shuffle=False).batch(1) == [4, 5, 6, 7]


def test_shards_partition_the_batch_and_keep_groups_whole():
    batch = list(range(100, 116))
    shards = [shard_prompts(batch, r, 4) for r in range(4)]
    assert [i for s in shards for i in s] == batch
    G = 8
    # groups are formed after sharding: every sample of prompt p lives on the rank that owns p
    owner = {p: r for r, s in enumerate(shards) for p in s}
    for r, s in enumerate(shards):
        rows = [p for p in s for _ in range(G)]
        assert all(owner[p] == r for p in rows) and len(rows) == 4 * G
    with pytest.raises(ValueError, match="num_prompts_per_step"):
        shard_prompts(list(range(6)), 0, 4)


def test_response_mask_marks_exactly_the_positions_scoring_response_tokens():
    pl, rl, T = torch.tensor([3, 1]), torch.tensor([2, 4]), 6
    m = response_mask(pl, rl, T)
    # row 0: tokens 3,4 are the response -> scored at positions 2,3; row 1: tokens 1..4 -> positions 0..3
    assert m.tolist() == [[0, 0, 1, 1, 0], [1, 1, 1, 1, 0]]
    assert m.sum(1).tolist() == rl.float().tolist()


def test_synthetic_solutions_are_right_and_have_the_documented_lengths():
    task = SyntheticTask(min_terms=2, max_terms=8, max_filler=6)
    rng = random.Random(0)
    for _ in range(200):
        p = task.problem(rng)
        assert 2 <= len(p.terms) <= 8
        w = worked_solution(p, filler=3)
        assert w.endswith(f"\\boxed{{{sum(p.terms) % 10}}}")
        assert len(worked_solution(p)) == 5 * len(p.terms) + 9
        # each step is <letter><digit>:<running sum mod 10>, checked against a direct recomputation
        steps = worked_solution(p).split("\\boxed")[0].rstrip(",").split(",")
        running = [int(st.split(":")[1]) for st in steps]
        assert running == [sum(p.terms[: i + 1]) % 10 for i in range(len(p.terms))]
        assert len(w) - len(worked_solution(p)) == 3 * len("hmm. ")
        assert abbreviated_solution(p) == f"\\boxed{{{p.answer}}}"
        c = compact_solution(p)
        assert len(c) == 2 * len(p.terms) + 9 and c.endswith(f"\\boxed{{{p.answer}}}")
        assert [int(ch) for ch in c.split("\\boxed")[0][1::2]] == [sum(p.terms[: i + 1]) % 10 for i in range(len(p.terms))]
    # expected lengths: exact enumeration over k agrees with style_lengths()
    ks = range(2, 9)
    assert task.style_lengths()["worked"] == pytest.approx(sum(5 * k + 9 for k in ks) / 7)
    assert Problem((9, 9, 3)).answer == "1" and Problem((9, 9, 3)).prompt == "Q:a9b9c3\n"
    assert worked_solution(Problem((9, 9, 3)), filler=1) == "hmm. a9:9,b9:8,c3:1,\\boxed{1}"
    assert compact_solution(Problem((9, 9, 3))) == "a9b8c1\\boxed{1}"
    # the warm-up mix follows the configured shares (empirical frequencies over 4000 draws)
    mix = SyntheticTask(p_abbreviated=0.15, p_compact=0.25)
    rng = random.Random(1)
    styles = []
    for _ in range(4000):
        _, r = mix.warmup_example(rng)
        body = r.replace("hmm. ", "")
        styles.append("abbr" if body.startswith("\\boxed") else "worked" if ":" in body else "compact")
    assert abs(styles.count("abbr") / 4000 - 0.15) < 0.02 and abs(styles.count("compact") / 4000 - 0.25) < 0.025
    with pytest.raises(ValueError, match="p_compact"):
        SyntheticTask(p_abbreviated=0.6, p_compact=0.6)


def _warmup_example_reference(task: SyntheticTask, rng: random.Random) -> tuple[str, str]:
    """The warm-up draw as the task had it before its marker option: problem, style draw, filler draw."""
    p = task.problem(rng)
    u = rng.random()
    if u < task.p_abbreviated:
        return p.prompt, abbreviated_solution(p)
    filler = rng.randint(0, task.max_filler)
    if u < task.p_abbreviated + task.p_compact:
        return p.prompt, compact_solution(p, filler=filler)
    return p.prompt, worked_solution(p, filler=filler)


def test_reasoning_marker_closes_every_warmup_answer_and_off_changes_nothing():
    # hand-worked: the marker sits right before the final boxed answer, whatever the style
    p = Problem((9, 9, 3))
    assert close_reasoning(worked_solution(p, filler=1), "ok.") == "hmm. a9:9,b9:8,c3:1,ok.\\boxed{1}"
    assert close_reasoning(compact_solution(p), "ok.") == "a9b8c1ok.\\boxed{1}"
    assert close_reasoning(abbreviated_solution(p), "ok.") == "ok.\\boxed{1}"
    assert close_reasoning("\\boxed{3}a1\\boxed{1}", "ok.") == "\\boxed{3}a1ok.\\boxed{1}"  # the FINAL one
    assert close_reasoning("a9b8c1\\boxed{1}", None) == "a9b8c1\\boxed{1}"
    assert closes_reasoning("a9b8ok.\\boxed{1}", "ok.") and not closes_reasoning("a9ok.b8\\boxed{1}", "ok.")
    assert not closes_reasoning("a9b8\\boxed{1}", "ok.")
    plain = SyntheticTask(max_filler=6)
    marked = SyntheticTask(max_filler=6, reasoning_marker="ok.")
    r_ref, r_plain, r_marked = random.Random(3), random.Random(3), random.Random(3)
    for _ in range(500):
        ref = _warmup_example_reference(plain, r_ref)
        assert plain.warmup_example(r_plain) == ref  # off: the same draws and answers as before the option
        prompt, response = marked.warmup_example(r_marked)
        i = ref[1].rindex("\\boxed{")
        assert (prompt, response) == (ref[0], ref[1][:i] + "ok." + ref[1][i:])
        assert closes_reasoning(response, "ok.") and response.count("ok.") == 1
    assert r_ref.random() == r_plain.random() == r_marked.random()  # the marker draws nothing
    # the documented lengths grow by the marker's tokens
    for style, n in plain.style_lengths().items():
        assert marked.style_lengths()[style] == pytest.approx(n + 3), style
    for bad in ("</think>", ""):
        with pytest.raises(ValueError, match="data.synthetic.reasoning_marker"):
            SyntheticTask(reasoning_marker=bad)


def test_synthetic_problem_set_is_stratified_by_number_of_terms():
    task = SyntheticTask(min_terms=2, max_terms=8)
    probs = task.problems(70, seed=5)
    for start in range(0, 70, 7):
        assert sorted(len(p.terms) for p in probs[start : start + 7]) == list(range(2, 9))
    assert probs == task.problems(70, seed=5) and probs != task.problems(70, seed=6)


def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer()
    s = "Q:a1b2\nhmm. a1:1,b2:3,\\boxed{3}"
    ids = tok.encode(s)
    assert len(ids) == len(s) and tok.decode(ids + [tok.eos_id, tok.pad_id]) == s
    with pytest.raises(ValueError, match="alphabet"):
        tok.encode("Z")


def test_math_prompts_from_json_and_jsonl(tmp_path):
    rows = [{"problem": "1+1?", "answer": "2"}, {"problem": "x?", "answer": ["3\n"]}]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    items = load_math_prompts([tmp_path / "a.json", tmp_path / "b.jsonl"], "plain")
    assert [i.prompt for i in items] == ["1+1?", "x?"] * 2 and items[1].answer == ["3\n"]
    assert "\\boxed{}" in render("deepseek_r1", "P") and render("deepseek_r1", "P").count("P") == 1
    (tmp_path / "bad.json").write_text(json.dumps([{"question": "q"}]))
    with pytest.raises(ValueError, match="problem"):
        load_math_prompts([tmp_path / "bad.json"], "plain")
    with pytest.raises(ValueError, match="prompt_template"):
        render("nope", "P")
    with pytest.raises(FileNotFoundError):
        read_rows(tmp_path / "missing.json")
