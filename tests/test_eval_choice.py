"""Multiple-choice benchmarks: letter extraction and grading edge cases, the file format, the runner."""

from __future__ import annotations

import json

import pytest

from laconic_nemo.eval.choice import MULTIPLE, ChoiceGrader, extract_choice, load_choice_file, parse_choice_files

OPTS = ["Argon", "Neon", "Xenon", "Helium"]


@pytest.mark.parametrize("text, want", [
    ("so it is \\boxed{C}", "C"),
    ("\\boxed{c}", "C"),                                    # lowercase
    ("\\boxed{(C)}", "C"),
    ("\\boxed{\\text{C}}", "C"),
    ("\\boxed{C.}", "C"),
    ("\\boxed{A} wait, no: \\boxed{D}", "D"),                # the last box
    ("\\boxed{A, C}", MULTIPLE),                           # several letters -> wrong
    ("\\boxed{AC}", MULTIPLE),
    ("\\boxed{A and C}", MULTIPLE),
    ("\\boxed{xenon}", "C"),                                # the option's text
    ("\\boxed{ Xenon. }", "C"),
    ("\\boxed{E}", ""),                                     # not an option of a 4-option problem
    ("\\boxed{42}", ""),
    ("The answer is (B) because neon glows.", "B"),
    ("Answer: D", "D"),
    ("**Answer:** b", "B"),
    ("the final answer is c.", "C"),
    ("the answer is a bit longer than I thought", None),   # a lowercase article, not a letter
    ("Answer: A and C", MULTIPLE),
    ("Answer: A, C", MULTIPLE),
    ("first (a) looks right, but (d) is", "D"),             # the last parenthesised letter
    ("(E) is not an option here", None),
    ("I do not know", None),
    ("Answer: A\n... on reflection \\boxed{B}", "B"),       # a box wins over a statement
])
def test_extract_choice(text, want):
    assert extract_choice(text, OPTS) == want


def test_grader_scores_and_statuses():
    ans = {"letter": "C", "options": OPTS}
    r = ChoiceGrader().score(["\\boxed{c}", "\\boxed{A, C}", "\\boxed{E}", "no idea", "Answer: (C)"], [ans] * 5)
    assert r.scores == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert r.statuses == ["correct", "wrong", "wrong", "no_answer", "correct"]


def test_file_format_and_errors(tmp_path):
    f = tmp_path / "gpqa.jsonl"
    f.write_text(json.dumps({"question": "Which gas?", "options": OPTS, "answer": "c"}) + "\n\n"
                 + json.dumps({"question": "Q2", "options": {"b": "two", "A": "one"}, "answer": "B"}) + "\n")
    probs = load_choice_file("gpqa", f)
    assert [(p.index, p.answer["letter"]) for p in probs] == [(0, "C"), (1, "B")]
    assert probs[1].answer["options"] == ["one", "two"]
    assert probs[0].problem.splitlines()[:4] == ["Which gas?", "", "A. Argon", "B. Neon"]
    assert len(load_choice_file("gpqa", f, limit=1)) == 1
    for row, msg in [({"question": "q", "options": OPTS, "answer": "E"}, "line 1: field 'answer'"),
                     ({"question": "q", "options": ["only"], "answer": "A"}, "field 'options'"),
                     ({"question": "q", "options": {"A": "x", "C": "y"}, "answer": "A"}, "keys"),
                     ({"options": OPTS, "answer": "A"}, "field 'question'")]:
        f.write_text(json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=msg):
            load_choice_file("x", f)
    assert parse_choice_files("gpqa=/d/g.jsonl, lsat=/d/l.jsonl") == {"gpqa": "/d/g.jsonl", "lsat": "/d/l.jsonl"}
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_choice_files("gpqa")


def test_eval_cli_on_a_choice_file(tmp_path):
    """`laconic-nemo eval --choice-files` with a tiny random transformers model: every sample is graded by the
    letter rules, a bad file is refused before the model loads, the table has one column pair per file."""
    pytest.importorskip("transformers")
    from laconic_nemo.cli import main
    from laconic_nemo.eval.runner import SAMPLES, read_samples
    from tests.hf_fixtures import save_tiny_qwen2

    model = save_tiny_qwen2(tmp_path / "m")
    f = tmp_path / "mmlu.jsonl"
    f.write_text("".join(json.dumps({"question": f"Q{i}?", "options": OPTS, "answer": "ABCD"[i]}) + "\n"
                         for i in range(2)))
    out = tmp_path / "eval"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "options": OPTS, "answer": "Z"}) + "\n")
    common = ["eval", "--model", model, "--backend", "transformers", "--n-samples", "2", "--max-tokens", "5"]
    assert main([*common, "--choice-files", f"x={bad}", "--output-dir", str(out)]) == 2
    assert main([*common, "--choice-files", f"mmlu={f}", "--output-dir", str(out)]) == 0
    rows = read_samples(str(out / SAMPLES))
    assert sorted((r["benchmark"], r["index"], r["sample"]) for r in rows) == \
        [("mmlu", i, s) for i in range(2) for s in range(2)]
    grader = ChoiceGrader()
    for r in rows:
        ans = {"letter": "ABCD"[r["index"]], "options": OPTS}
        g = grader.score([r["response"]], [ans])
        assert (r["score"], r["status"]) == (g.scores[0], g.statuses[0])
    assert (out / "table.md").read_text().startswith("| Model | mmlu Pass@1 | mmlu #Tokens |\n")
