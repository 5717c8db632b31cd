"""`laconic-nemo eval` end to end with a tiny random transformers model and a locally built tokenizer."""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("math_verify")

from laconic_nemo.eval.backends import EvalSampling, TransformersBackend  # noqa: E402
from laconic_nemo.eval.benchmarks import BENCHMARKS, INSTRUCTION, build_prompt, load_benchmark, parse_benchmarks  # noqa: E402
from laconic_nemo.eval.runner import SAMPLES, evaluate, markdown_table, read_samples, summarize  # noqa: E402
from tests.hf_fixtures import char_tokenizer, save_tiny_qwen2  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


class CountingBackend(TransformersBackend):
    """The transformers backend, counting generate calls and sampled completions."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = 0
        self.completions = 0

    def generate(self, prompts, n, settings, seeds):
        self.calls += 1
        self.completions += n * len(prompts)
        return super().generate(prompts, n, settings, seeds)


def hand_summary(rows):
    """pass@1 and mean tokens per benchmark recomputed from the per-sample rows, in plain Python."""
    per = defaultdict(lambda: defaultdict(list))
    for r in rows:
        per[r["benchmark"]][r["index"]].append(r)
    out = {}
    for b, probs in per.items():
        p = [sum(s["score"] for s in v) / len(v) for v in probs.values()]
        t = [sum(s["num_tokens"] for s in v) / len(v) for v in probs.values()]
        out[b] = (sum(p) / len(p), sum(t) / len(t))
    return out


def test_benchmarks_load_and_prompt():
    assert [len(load_benchmark(b)) for b in BENCHMARKS] == [30, 500, 272, 675, 83]
    assert parse_benchmarks("all") == list(BENCHMARKS)
    with pytest.raises(ValueError, match="aime2025"):
        parse_benchmarks("aime2024,aime2025")
    tok = char_tokenizer()
    assert build_prompt("1+1?", tok) == f"<|user|>1+1?\n{INSTRUCTION}<|assistant|>"
    assert build_prompt("1+1?") == f"1+1?\n{INSTRUCTION}"
    with pytest.raises(ValueError, match="top-p"):
        EvalSampling(top_p=0.0)


def test_summary_and_table_arithmetic_by_hand():
    def row(b, i, s, score, tok, fin="stop"):
        return {"benchmark": b, "index": i, "sample": s, "score": score, "num_tokens": tok, "finish_reason": fin,
                "status": "correct" if score else "wrong"}

    rows = [row("aime2024", 0, 0, 1.0, 10), row("aime2024", 0, 1, 0.0, 20, "length"),
            row("aime2024", 1, 0, 1.0, 30), row("aime2024", 1, 1, 1.0, 50)]
    rows += [row(b, 0, s, float(s == 0), 100) for b in ("math500", "minerva", "olympiad_bench") for s in (0, 1)]
    s = summarize(rows, ["aime2024", "math500", "minerva", "olympiad_bench"], n_samples=2)
    assert s["benchmarks"]["aime2024"]["pass@1"] == 0.75  # mean of (0.5, 1.0)
    assert s["benchmarks"]["aime2024"]["tokens"] == 27.5  # mean of (15, 40)
    assert s["benchmarks"]["aime2024"]["truncated"] == 0.25
    assert s["average"]["pass@1"] == pytest.approx((0.75 + 0.5 * 3) / 4)
    assert s["average"]["tokens"] == pytest.approx((27.5 + 300) / 4)
    base = {"benchmarks": {b: {"pass@1": 0.5, "tokens": 55.0} for b in s["benchmarks"]},
            "average": {"pass@1": 0.5, "tokens": 55.0}}
    table = markdown_table(s, "ours", base, "base")
    lines = table.strip().splitlines()
    assert lines[0].startswith("| Model | AIME2024 Pass@1 | AIME2024 #Tokens | MATH500 Pass@1")
    assert lines[2].split(" | ")[1:3] == ["50.0", "55"]
    assert lines[3].split(" | ")[1:3] == ["75.0", "28"]  # 27.5 rounds half to even
    change = lines[4].split(" | ")
    assert change[1:3] == ["+25.0", "-50.0%"]  # 75 - 50 points; (27.5 - 55) / 55
    assert change[3:5] == ["+0.0", "+81.8%"]  # MATH500: (100 - 55) / 55


def test_eval_end_to_end_and_resume(tiny_model_dir, tmp_path):
    from laconic_nemo.cli import main
    from laconic_nemo.rewards import MathReward

    out = tmp_path / "eval"
    base = {"model": "base-model", "benchmarks": {b: {"pass@1": 0.5, "tokens": 4.0} for b in BENCHMARKS},
            "average": {"pass@1": 0.5, "tokens": 4.0}}
    (tmp_path / "base.json").write_text(json.dumps(base))
    rc = main(["eval", "--model", tiny_model_dir, "--backend", "transformers", "--benchmarks", "all",
               "--n-samples", "2", "--max-tokens", "6", "--limit", "2", "--output-dir", str(out),
               "--base-summary", str(tmp_path / "base.json"), "--grader-workers", "0", "--name", "tiny"])
    assert rc == 0
    rows = read_samples(str(out / SAMPLES))
    assert len(rows) == 5 * 2 * 2
    assert {(r["benchmark"], r["index"], r["sample"]) for r in rows} == \
        {(b, i, s) for b in BENCHMARKS for i in range(2) for s in range(2)}
    assert all(1 <= r["num_tokens"] <= 6 or r["finish_reason"] == "stop" for r in rows)
    assert all(r["num_tokens"] == 6 for r in rows if r["finish_reason"] == "length")
    summary = json.loads((out / "summary.json").read_text())
    hand = hand_summary(rows)
    for b, (p, t) in hand.items():
        assert summary["benchmarks"][b]["pass@1"] == pytest.approx(p)
        assert summary["benchmarks"][b]["tokens"] == pytest.approx(t)
    avg_p = sum(hand[b][0] for b in ("aime2024", "math500", "minerva", "olympiad_bench")) / 4
    avg_t = sum(hand[b][1] for b in ("aime2024", "math500", "minerva", "olympiad_bench")) / 4
    assert summary["average"]["pass@1"] == pytest.approx(avg_p)
    table = (out / "table.md").read_text().strip().splitlines()
    assert table[2].startswith("| base-model |") and table[3].startswith("| tiny |")
    ours = table[3].strip("| ").split(" | ")
    assert ours[-2:] == [f"{100 * avg_p:.1f}", f"{avg_t:.0f}"]
    change = table[4].strip("| ").split(" | ")
    assert change[-2:] == [f"{100 * (avg_p - 0.5):+.1f}", f"{100 * (avg_t - 4.0) / 4.0:+.1f}%"]
    png = (out / "pass_vs_tokens.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000

    # resume: drop three samples (one whole problem of two samples, one single sample), rerun
    lines = (out / SAMPLES).read_text().splitlines()
    dropped = [json.loads(x) for x in lines[-3:]]
    (out / SAMPLES).write_text("\n".join(lines[:-3]) + "\n" + '{"torn": ')  # plus a torn line
    backend = CountingBackend(tiny_model_dir)
    with MathReward(num_workers=0) as grader:
        evaluate(backend, list(BENCHMARKS), str(out), n_samples=2, sampling=EvalSampling(max_tokens=6), limit=2,
                 grader=grader, log=lambda s: None)
    assert backend.completions == 3
    rows2 = read_samples(str(out / SAMPLES))
    assert len(rows2) == 20
    assert {(r["benchmark"], r["index"], r["sample"]) for r in rows2} == \
        {(r["benchmark"], r["index"], r["sample"]) for r in rows}
    assert {(d["benchmark"], d["index"], d["sample"]) for d in dropped} <= \
        {(r["benchmark"], r["index"], r["sample"]) for r in rows2[-3:]}
    # a finished run generates nothing
    backend.calls = backend.completions = 0
    with MathReward(num_workers=0) as grader:
        evaluate(backend, list(BENCHMARKS), str(out), n_samples=2, sampling=EvalSampling(max_tokens=6), limit=2,
                 grader=grader, log=lambda s: None)
    assert backend.calls == 0
    assert os.path.exists(out / "summary.json")


def test_stated_budgets_on_the_math_benchmarks(tiny_model_dir, tmp_path, capsys):
    """--stated-budgets with math benchmarks: each problem asked once per budget, the budget stated at the end of the
    user turn (after the evaluation's instruction, inside the chat template), graded by the math reward; the
    per-budget table recomputed here from the samples."""
    from laconic_nemo.cli import main
    from laconic_nemo.eval.stated import math_stated_problems

    problems = math_stated_problems(["aime2024", "math500"], [3, 5], " Think for at most {budget} tokens.", limit=2)
    first = load_benchmark("aime2024", 1)[0].problem
    assert build_prompt(problems["stated_3"][0].problem[: -len(f"\n{INSTRUCTION} Think for at most 3 tokens.")],
                        char_tokenizer(), " Think for at most 3 tokens.") == \
        f"<|user|>{first}\n{INSTRUCTION} Think for at most 3 tokens.<|assistant|>"
    assert [len(v) for v in problems.values()] == [4, 4] and [p.index for p in problems["stated_5"]] == [0, 1, 2, 3]

    out = tmp_path / "stated"
    rc = main(["eval", "--model", tiny_model_dir, "--backend", "transformers", "--benchmarks", "aime2024,math500",
               "--stated-budgets", "3,5", "--target-instruction", " Think for at most {budget} tokens.",
               "--n-samples", "2", "--max-tokens", "6", "--limit", "2", "--output-dir", str(out),
               "--grader-workers", "0", "--name", "tiny"])
    assert rc == 0
    rows = read_samples(str(out / SAMPLES))
    assert {(r["benchmark"], r["index"], r["sample"]) for r in rows} == \
        {(f"stated_{b}", i, s) for b in (3, 5) for i in range(4) for s in range(2)}
    table = json.loads((out / "stated.json").read_text())["rows"]
    for got, b in zip(table, (3, 5)):
        lengths = [r["num_tokens"] for r in rows if r["benchmark"] == f"stated_{b}"]
        scores = [r["score"] for r in rows if r["benchmark"] == f"stated_{b}"]
        assert got["budget"] == b and got["n"] == 8
        assert got["mean_length"] == pytest.approx(sum(lengths) / 8)
        assert got["pass@1"] == pytest.approx(sum(scores) / 8)
        assert got["over_budget"] == pytest.approx(sum(x > b for x in lengths) / 8)
    assert "| 3 |" in capsys.readouterr().out

    for flags, needle in ((["--stated-budgets", "0"], "--stated-budgets: budget 0 is invalid"),
                          (["--stated-budgets", "5", "--target-instruction", " Be brief."],
                           "--target-instruction = ' Be brief.' is invalid"),
                          (["--stated-budgets", "5", "--choice-files", "x=y.jsonl"], "exclude each other")):
        assert main(["eval", "--model", tiny_model_dir, "--backend", "transformers", "--output-dir",
                     str(tmp_path / "bad"), *flags]) == 2
        assert needle in capsys.readouterr().err
