"""`laconic-nemo eval --benchmarks synthetic`: the tiny task's held-out problems, its grader, and a TP=2 run's
policies (the cached warm-up and the latest checkpoint) reloaded into a one-process megatron-core actor."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from laconic_nemo.config import load_config  # noqa: E402
from laconic_nemo.eval.synthetic import ExactAnswerGrader, benchmark_problems, heldout_problems  # noqa: E402

DIST = Path(__file__).resolve().parent / "dist"  # on sys.path through tests/conftest.py


def test_heldout_problems_are_disjoint_from_the_training_prompts():
    from laconic_nemo.app.task import build_task

    cfg = load_config("tiny_cpu")
    trained = {p for p, _ in build_task(cfg).prompts}  # the prompts the trainer samples from
    assert len(trained) > 1500
    held = heldout_problems(cfg, 512)
    prompts = [p.prompt for p in held]
    assert not set(prompts) & trained
    assert len(set(prompts)) == len(prompts)
    # quota 512 // 7 = 73 (+1 for k = 2, the first of the 512 % 7 = 1 remainder); k = 2 has fewer unseen ones: all
    unseen2 = 100 - sum(1 for p in trained if len(p) == len("Q:a1b2\n"))
    counts = Counter(len(p.terms) for p in held)
    assert counts[2] == unseen2 < 74
    assert [counts[k] for k in range(3, 9)] == [73] * 6
    # interleaved: the first 7 problems have 7 different k, so any prefix keeps the mix
    assert len({len(p.terms) for p in held[:7]}) == 7
    assert heldout_problems(cfg, 512) == held  # deterministic
    assert heldout_problems(cfg, 512, seed=1) != held
    rows = benchmark_problems(cfg, 512, limit=5)
    assert [(r.index, r.problem, r.answer) for r in rows] == [(i, p.prompt, p.answer) for i, p in enumerate(held[:5])]
    assert all(str(sum(p.terms) % 10) == p.answer for p in held)


def test_exact_answer_grader_follows_the_training_reward():
    texts = ["a3:3,b4:7,\\boxed{7}", "\\boxed{3}\\boxed{7}", "a3b7", "\\boxed{ 7 }", "\\boxed{17}", ""]
    result = ExactAnswerGrader().score(texts, ["7"] * len(texts))
    assert result.scores == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]  # the last boxed answer counts
    assert result.statuses == ["correct", "correct", "no_answer", "correct", "wrong", "no_answer"]


@pytest.mark.slow
def test_tp2_run_policies_reload_and_evaluate(tmp_path):
    import synthetic_policy_checks

    from laconic_nemo.cli import main
    from laconic_nemo.eval.runner import SAMPLES, read_samples
    from laconic_nemo.eval.synthetic import MegatronBackend, run_config, warmup_policy_dir
    from laconic_nemo.grpo.interfaces import TrainBatch
    from laconic_nemo.runtime.megatron_env import destroy_distributed

    run = tmp_path / "run"
    synthetic_policy_checks.launch(str(run))
    ref = torch.load(run / "policy_logprobs.pt", weights_only=False)
    assert (ref["trained"] - ref["warmup"]).abs().max() > 1e-2  # the step moved the policy
    cfg, world = run_config(run)
    assert world == 2
    warm_dir = warmup_policy_dir(cfg, world)
    assert (warm_dir / "done").is_file()  # the key the trainer's own warm-up wrote its cache under
    tokens = ref["tokens"]
    n, t = tokens.shape
    batch = TrainBatch(tokens, torch.full((n,), 1), torch.full((n,), t - 1), torch.ones(n, t - 1))
    try:
        backend = MegatronBackend(cfg)
        assert backend.actor.info.tp_size == 1
        backend.load(warm_dir, cfg)
        assert (backend.actor.logprobs(batch) - ref["warmup"]).abs().max() < 2e-5
        backend.load(run)
        assert (backend.actor.logprobs(batch) - ref["trained"]).abs().max() < 2e-5
    finally:
        destroy_distributed()

    out = tmp_path / "eval"
    args = ["eval", "--model", str(run), "--benchmarks", "synthetic", "--n-samples", "2", "--limit", "5",
            "--max-tokens", "12", "--temperature", "1.0", "--top-p", "1.0"]
    # the warm-up cache is looked up before anything is built
    assert main(args + ["--warmed-up", "--warmup-cache", str(tmp_path / "none"), "--output-dir", str(out / "x")]) == 2
    base = {"model": "base", "benchmarks": {"synthetic": {"pass@1": 0.5, "tokens": 8.0}}, "average": None}
    (tmp_path / "base.json").write_text(json.dumps(base))
    try:
        assert main(args + ["--output-dir", str(out / "rl"), "--base-summary", str(tmp_path / "base.json")]) == 0
    finally:
        destroy_distributed()
    held = {p.index: p for p in benchmark_problems(cfg, 512, limit=5)}
    rows = read_samples(str(out / "rl" / SAMPLES))
    assert sorted((r["index"], r["sample"]) for r in rows) == [(i, s) for i in range(5) for s in range(2)]
    grader = ExactAnswerGrader()
    for r in rows:
        # one character per token, EOS not counted (an untrained policy may also sample <pad>, decoded as nothing)
        assert len(r["response"]) <= r["num_tokens"] <= 12
        assert (r["finish_reason"] == "length") == (r["num_tokens"] == 12)
        assert r["score"] == grader.score([r["response"]], [held[r["index"]].answer]).scores[0]
    summary = json.loads((out / "rl" / "summary.json").read_text())
    assert summary["benchmarks"]["synthetic"]["tokens"] == pytest.approx(sum(r["num_tokens"] for r in rows) / 10)
    p1, tok = summary["benchmarks"]["synthetic"]["pass@1"], summary["benchmarks"]["synthetic"]["tokens"]
    # --stated-budgets through the real backend: every (budget, problem, sample) once, the table from those samples
    try:
        assert main(args + ["--output-dir", str(out / "stated"), "--stated-budgets", "8,12"]) == 0
    finally:
        destroy_distributed()
    stated = read_samples(str(out / "stated" / SAMPLES))
    assert sorted((r["benchmark"], r["index"], r["sample"]) for r in stated) == [
        (f"stated_{b}", i, s) for b in (12, 8) for i in range(5) for s in range(2)]
    got = json.loads((out / "stated" / "stated.json").read_text())
    assert got["instruction"] == "max{target}"
    for row in got["rows"]:
        mine = [r for r in stated if r["benchmark"] == f"stated_{row['budget']}"]
        lengths = [r["num_tokens"] for r in mine]
        assert all(len(r["response"]) <= r["num_tokens"] <= 12 for r in mine)
        assert row["n"] == 10 and row["mean_length"] == pytest.approx(sum(lengths) / 10)
        assert row["pass@1"] == pytest.approx(sum(r["score"] for r in mine) / 10)
        assert row["within_10"] == pytest.approx(sum(abs(n - row["budget"]) <= 0.1 * row["budget"] for n in lengths) / 10)
    table = (out / "rl" / "table.md").read_text().splitlines()
    assert table[0] == "| Model | Synthetic Pass@1 | Synthetic #Tokens |"  # no Avg columns: no paper benchmark
    assert table[2:] == ["| base | 50.0 | 8 |", f"| run | {100 * p1:.1f} | {tok:.0f} |",
                         f"| change | {100 * (p1 - 0.5):+.1f} | {100 * (tok - 8) / 8:+.1f}% |"]
