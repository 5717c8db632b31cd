"""`laconic-nemo eval --benchmarks synthetic --stated-budgets`: the budgets stated in the prompt as training states
them, the per-budget table against hand-worked values and a float64 recomputation, the refusals, and the marker the
tiny task's warm-up teaches (a real one-process warm-up and sampling)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from laconic_nemo.config import load_config, to_yaml
from laconic_nemo.eval.stated import (
    benchmark_name,
    parse_stated_budgets,
    stated_problems,
    stated_prompt,
    stated_rows,
)

ROOT = Path(__file__).resolve().parent.parent
L1 = ROOT / "recipes" / "tiny_cpu_l1_stated.yaml"


def test_parse_stated_budgets_refuses_bad_lists_naming_the_flag():
    assert parse_stated_budgets("16, 24,32") == [16, 24, 32]
    assert parse_stated_budgets("1") == [1]
    for bad, needle in (("", "comma-separated"), (" , ", "comma-separated"), ("16,0", "budget 0"),
                        ("16,-3", "budget -3"), ("16,x", "'x' is not an integer"), ("8,8", "given twice"),
                        ("16,,24", "'' is not an integer")):
        with pytest.raises(ValueError, match="--stated-budgets") as exc:
            parse_stated_budgets(bad)
        assert needle in str(exc.value), bad


def _row(b, L, score):
    return {"benchmark": benchmark_name(b), "index": 0, "sample": 0, "num_tokens": L, "score": score}


def test_stated_rows_hand_worked_and_against_a_float64_recomputation():
    samples = [_row(10, L, s) for L, s in ((9, 1.0), (10, 0.0), (12, 1.0), (11, 1.0))]
    samples += [_row(1, L, s) for L, s in ((1, 0.0), (2, 1.0))]
    samples += [_row(7, 3, 1.0)]  # a budget not asked for: not counted
    by = {r["budget"]: r for r in stated_rows(samples, [10, 1])}
    assert list(by) == [10, 1]
    # budget 10: mean (9+10+12+11)/4 = 10.5; within 10% = |L-10| <= 1: 9, 10, 11 -> 3/4; in the band [9, 10]:
    # 9, 10 -> 2/4; over 10: 12, 11 -> 2/4
    assert by[10] == {"budget": 10, "n": 4, "mean_length": 10.5, "length_ratio": 1.05, "pass@1": 0.75,
                      "within_10": 0.75, "in_band": 0.5, "over_budget": 0.5}
    # budget 1: within 10% = |L-1| <= 0.1 holds for L = 1 only (in the band [0.9, 1] too); L = 2 is over
    assert by[1] == {"budget": 1, "n": 2, "mean_length": 1.5, "length_ratio": 1.5, "pass@1": 0.5,
                     "within_10": 0.5, "in_band": 0.5, "over_budget": 0.5}
    # another band: [5, 10] holds 9 and 10 of budget 10 (12 and 11 over), [0.5, 1] holds L = 1 of budget 1
    assert [r["in_band"] for r in stated_rows(samples, [10, 1], band=0.5)] == [0.5, 0.5]
    with pytest.raises(ValueError, match="stated budget 5"):
        stated_rows(samples, [5])
    # random samples: float64 numpy recomputation, budgets interleaved in the rows
    rng = np.random.default_rng(0)
    budgets = [16, 24, 32, 40]
    b_of = rng.choice(budgets, 400)
    L = rng.integers(5, 70, 400)
    s = rng.integers(0, 2, 400).astype(np.float64)
    rows = stated_rows([_row(int(b), int(x), float(y)) for b, x, y in zip(b_of, L, s)], budgets, band=0.7)
    for r in rows:
        m = b_of == r["budget"]
        Lb = L[m].astype(np.float64)
        assert r["n"] == int(m.sum())
        assert r["mean_length"] == pytest.approx(Lb.mean(), rel=1e-12)
        assert r["length_ratio"] == pytest.approx(Lb.mean() / r["budget"], rel=1e-12)
        assert r["pass@1"] == pytest.approx(s[m].mean(), rel=1e-12)
        assert r["within_10"] == pytest.approx(np.mean(np.abs(Lb - r["budget"]) <= 0.1 * r["budget"]), rel=1e-12)
        assert r["over_budget"] == pytest.approx(np.mean(Lb > r["budget"]), rel=1e-12)
        assert r["in_band"] == pytest.approx(np.mean((Lb >= 0.7 * r["budget"]) & (Lb <= r["budget"])), rel=1e-12)


def test_the_stated_prompt_is_the_prompt_training_states():
    """The evaluation states budget b exactly as GRPOTrainer._prompt_texts states a drawn target b."""
    from laconic_nemo.eval.synthetic import benchmark_problems
    from laconic_nemo.grpo.trainer import GRPOTrainer

    cfg = load_config(L1)
    problems = stated_problems(cfg, [16, 48], 20)
    prompts = [(p.problem, p.answer) for p in benchmark_problems(cfg, 20)]
    actor = SimpleNamespace(dp_rank=0, dp_size=1, dp_group=None)
    trainer = GRPOTrainer(cfg, actor, encode=list, decode=str, prompts=prompts, reward_fn=None, eos_id=1)
    texts, targets = trainer._prompt_texts(5, list(range(20)))
    assert all(16 <= t <= 48 for t in targets) and len(set(targets)) > 5
    assert texts == [stated_prompt(prompts[i][0], cfg.data.target_instruction, t) for i, t in enumerate(targets)]
    for b in (16, 48):  # the recipe's instruction after the held-out problem, the same problems for every budget
        assert [(p.problem, p.answer) for p in problems[benchmark_name(b)]] == [(t + f"max{b}\n", a)
                                                                            for t, a in prompts]


class _FakeBackend:
    """Answers each prompt with a response whose length follows the stated budget: ``budget // 2`` filler tokens
    (``length = budget // 2 + 9``), right for odd budgets, wrong for even ones; records the prompts."""

    def __init__(self):
        self.prompts = []

    def generate(self, prompts, n, settings, seeds):
        from laconic_nemo.eval.backends import Completion

        out = []
        for p in prompts:
            self.prompts.append(p)
            b = int(re.search(r"max(\d+)\n$", p).group(1))
            answer = str(sum(int(c) for c in re.findall(r"[a-l](\d)", p.split("\n")[0])) % 10)
            box = f"\\boxed{{{answer if b % 2 else (int(answer) + 1) % 10}}}"
            text = "h" * (b // 2) + box
            out.append([Completion(text, len(text), "stop") for _ in range(n)])
        return out


def test_stated_evaluation_table_json_and_plot_from_known_responses(tmp_path, capsys):
    from laconic_nemo.eval.backends import EvalSampling
    from laconic_nemo.eval.cli import _stated

    cfg = load_config(L1)
    backend = _FakeBackend()
    args = SimpleNamespace(stated_budgets="17,24", synthetic_problems=14, seed=0, n_samples=2, limit=5,
                           chunk_prompts=3, base_summary=None, output_dir=str(tmp_path), band=None)
    assert _stated(args, cfg, backend, EvalSampling(1.0, 1.0, 96), "l1") == 0
    assert len(backend.prompts) == 2 * 5 and {p[-6:] for p in backend.prompts} == {"max17\n", "max24\n"}
    got = json.loads((tmp_path / "stated.json").read_text())
    assert got["instruction"] == "max{target}\n" and got["model"] == "l1"
    assert got["band"] == 0.9  # the run has no laconic.band: the default band [0.9 B, B]
    # 17: 8 fillers + 9 = 17 tokens, right; 24: 12 + 9 = 21 tokens (21/24 = 0.875, not within 10%, below the
    # band [21.6, 24]), wrong
    assert got["rows"] == [
        {"budget": 17, "n": 10, "mean_length": 17.0, "length_ratio": 1.0, "pass@1": 1.0, "within_10": 1.0,
         "in_band": 1.0, "over_budget": 0.0},
        {"budget": 24, "n": 10, "mean_length": 21.0, "length_ratio": 0.875, "pass@1": 0.0, "within_10": 0.0,
         "in_band": 0.0, "over_budget": 0.0}]
    table = (tmp_path / "stated.md").read_text()
    assert "share in band [0.9 B, B]" in table
    assert "| 17 | 17.0 | 1.00 | 1.000 | 1.000 | 1.000 | 0.000 |" in table
    assert "| 24 | 21.0 | 0.88 | 0.000 | 0.000 | 0.000 | 0.000 |" in table
    assert table in capsys.readouterr().out
    assert (tmp_path / "stated_budgets.png").stat().st_size > 1000
    # rerun with fewer samples: nothing generated again, the table counts this evaluation's samples only
    args.n_samples, args.limit = 1, 2
    assert _stated(args, cfg, backend, EvalSampling(1.0, 1.0, 96), "l1") == 0
    assert len(backend.prompts) == 10
    assert [r["n"] for r in json.loads((tmp_path / "stated.json").read_text())["rows"]] == [2, 2]


def _run_dir(tmp_path, recipe, overrides=()):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(recipe, list(overrides))))
    return run


def test_stated_budgets_bad_input_is_refused_naming_the_flag(tmp_path, capsys):
    from laconic_nemo.cli import main

    run = _run_dir(tmp_path, L1)
    base = ["eval", "--model", str(run), "--benchmarks", "synthetic", "--output-dir", str(tmp_path / "o")]
    for value, needle in (("0", "--stated-budgets: budget 0 is invalid"), ("", "--stated-budgets = ''"),
                          ("16,16", "--stated-budgets: budget 16 is given twice")):
        assert main([*base, "--stated-budgets", value]) == 2
        assert needle in capsys.readouterr().err
    # the longest stated prompt (19 + len("max99999\n")) leaves 128 - 28 = 100 tokens; more is refused
    assert main([*base, "--stated-budgets", "16,99999", "--max-tokens", "101"]) == 2
    assert "--max-tokens = 101 is invalid: allowed 1..100" in capsys.readouterr().err
    # a run whose instruction the synthetic tokenizer cannot encode (the L1 paper's default wording)
    (tmp_path / "p").mkdir()
    plain = _run_dir(tmp_path / "p", "tiny_cpu")
    assert main(["eval", "--model", str(plain), "--benchmarks", "synthetic", "--output-dir", str(tmp_path / "o2"),
                 "--stated-budgets", "16"]) == 2
    assert "--stated-budgets: the run's data.target_instruction ' Think for {target} tokens.'" in \
        capsys.readouterr().err
    # the math benchmarks take stated budgets too (tests/test_eval.py); a bad list is named before the model is read
    assert main(["eval", "--model", str(run), "--output-dir", str(tmp_path / "o3"), "--stated-budgets", "16,x"]) == 2
    assert "--stated-budgets: 'x' is not an integer" in capsys.readouterr().err


def test_warmup_teaches_the_reasoning_marker():
    """A real one-process warm-up (megatron-core actor, the trainer's supervised_warmup) of a small model on the task
    with reasoning_marker "ok.": its samples close their reasoning with the marker (marker, then the boxed answer)
    in most cases."""
    pytest.importorskip("megatron.core")
    import torch

    from laconic_nemo.app.warmup import supervised_warmup
    from laconic_nemo.data.synthetic import CharTokenizer, SyntheticTask, closes_reasoning
    from laconic_nemo.eval.synthetic import MegatronBackend
    from laconic_nemo.grpo.interfaces import SamplingParams
    from laconic_nemo.runtime.megatron_env import destroy_distributed

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = load_config("tiny_cpu", ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=128",
                                   "model.max_position_embeddings=64", "data.synthetic.max_terms=4"])
    tok = CharTokenizer()
    task = SyntheticTask(min_terms=2, max_terms=4, max_filler=2, reasoning_marker="ok.")

    def example(rng):
        prompt, response = task.warmup_example(rng)
        return tok.encode(prompt), tok.encode(response) + [tok.eos_id]

    try:
        actor = MegatronBackend(cfg).actor
        before = actor.generate([tok.encode(p.prompt) for p in task.problems(48, seed=123)],
                                SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=40, eos_id=tok.eos_id,
                                               seed=1))
        actor.set_learning_rate(3e-3)
        supervised_warmup(actor, example, 150, 32, 32, seed=0, pad_id=tok.pad_id, log=lambda s: None)
        gen = actor.generate([tok.encode(p.prompt) for p in task.problems(48, seed=123)],
                             SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=40, eos_id=tok.eos_id, seed=1))
    finally:
        destroy_distributed()
        torch.set_num_threads(threads)

    def share(g):
        texts = [tok.decode(g.tokens[j, int(p): int(p) + int(n)].tolist())
                 for j, (p, n) in enumerate(zip(g.prompt_lengths, g.lengths))]
        return sum(closes_reasoning(t, "ok.") for t in texts) / len(texts)

    assert share(before) == 0.0  # the untrained policy does not write it
    assert share(gen) >= 0.75, share(gen)  # measured 0.94 (45 of 48) at 150 steps


def test_train_refuses_a_synthetic_instruction_the_tokenizer_cannot_encode(tmp_path, capsys):
    """A tiny-task run with stated targets is refused before anything starts when its data.target_instruction (the
    L1 paper's default wording here) or its reasoning marker has characters the character tokenizer lacks."""
    from laconic_nemo.cli import main

    out = f"run.output_dir={tmp_path / 'out'}"
    for overrides, needle in (
            (["laconic.shaper=l1_max", "data.target_length_range=[16,48]"],
             "data.target_instruction = ' Think for {target} tokens.' is invalid"),
            (["data.target_instruction=max", "laconic.shaper=l1_max", "data.target_length_range=[16,48]"],
             "data.target_instruction = 'max' is invalid: allowed a te"),  # a template / a text holding {target}
            (["data.synthetic.reasoning_marker=done"], "data.synthetic.reasoning_marker = 'done' is invalid")):
        assert main(["train", "tiny_cpu", *overrides, out]) == 2
        text = capsys.readouterr()
        assert needle in text.err + text.out and "launching" not in text.out + text.err
    load_config(L1)  # the tiny L1 recipe's instruction is accepted


def test_the_marker_is_part_of_the_warmup_cache_key(tmp_path):
    """A warm-up with a marker (other answers, another policy) never shares a cached policy with one without or with
    another marker; without a marker the key holds no marker entry (the task's key before the option)."""
    from laconic_nemo.app.warmup import warmup_cache_dir, warmup_cache_key

    base = [f"warmup.cache_dir={tmp_path}"]
    plain = load_config("tiny_cpu", base)
    assert "reasoning_marker" not in warmup_cache_key(plain, 2, 1)["synthetic"]
    marked = load_config(ROOT / "recipes" / "tiny_cpu_marker.yaml", base)
    assert warmup_cache_key(marked, 2, 1)["synthetic"]["reasoning_marker"] == "ok."
    dirs = {warmup_cache_dir(c, 2, 1) for c in (plain, marked, load_config("tiny_cpu", [*base, "data.synthetic."
                                                                                        "reasoning_marker=hm."]))}
    assert len(dirs) == 3


def test_the_stated_budget_block_says_when_the_per_prompt_run_is_left_out(tmp_path):
    """benchmarks/stated_budgets.py --skip-per-prompt: the block says the per-prompt run is not measured and names
    the command that measures it; with the run, its class table is there instead."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import stated_budgets as sb

    (tmp_path / "eval_tiny_cpu_stated").mkdir()
    (tmp_path / "eval_tiny_cpu_stated" / "stated.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "max_tokens": 96}))
    made = {"date": "2026-01-01", "threads_per_rank": 1,
            "versions": {"torch": "t", "megatron-core": "m", "python": "3.11"},
            "cpu_isa": {"aten": "AVX2", "machine": "x86_64", "mkl_cbwr": "COMPATIBLE", "onednn_max_cpu_isa": "AVX2",
                        "pin": "avx2"}}
    args = SimpleNamespace(results=tmp_path, n_samples=4, problems=8)
    cls = {"ratio": (1.2, 1.05), "within_10": 0.5, "over_budget": 0.4, "pass@1": (0.3, 0.6), "lambda": [0.1, 0.2]}
    runs = [("LACONIC", {"20": cls}, 70)]
    evals = [("LACONIC", [{"budget": 20, "mean_length": 21.0, "length_ratio": 1.05, "pass@1": 0.6,
                           "within_10": 0.5, "in_band": 0.3, "over_budget": 0.4, "n": 32}])]
    text = sb.block(runs, evals, None, [20], made, args, 70)
    assert "(`tiny_cpu_per_prompt.yaml`): not measured in this block" in text
    assert "`LACONIC_CPU_ISA=avx2 PYTHONPATH=. python benchmarks/stated_budgets.py --write --skip-per-prompt`" in text
    assert "budget class (B_i" not in text
    held = {"length_ratio": 0.97, "within_10": 0.6, "over_budget": 0.3, "pass@1": 0.7}
    text = sb.block(runs, evals, ({"16-24": cls}, {"16-24": held}, {"16-24": held}), [20], made, args, 70)
    assert "not measured" not in text and "--skip-per-prompt" not in text
    assert "| 16-24 | 1.20 -> 1.05 | 0.50 | 0.40 | 0.600 | 0.10 -> 0.20 | 0.97 | 0.60 | 0.30 | 0.700 |" in text
    assert text.startswith(sb.BEGIN) and text.endswith(sb.END)


def test_the_band_share_and_plot_follow_the_runs_band_or_the_flag(tmp_path, capsys):
    """The reported band is [rho B, B] with rho from --band, else the run's laconic.band, else 0.9; the table names
    it, the plot shades it (another rho, another picture)."""
    from laconic_nemo.cli import main
    from laconic_nemo.eval.backends import EvalSampling
    from laconic_nemo.eval.cli import _run_band, _stated

    cfg = load_config(L1)
    cfg.laconic.band = 0.8  # as a band run's config holds it
    outs = {}
    for flag, want_band, want_24 in ((None, 0.8, 1.0), (0.9, 0.9, 0.0)):
        out = tmp_path / f"band_{flag}"
        args = SimpleNamespace(stated_budgets="17,24", synthetic_problems=14, seed=0, n_samples=1, limit=3,
                               chunk_prompts=3, base_summary=None, output_dir=str(out), band=flag)
        assert _stated(args, cfg, _FakeBackend(), EvalSampling(1.0, 1.0, 96), "band") == 0
        got = json.loads((out / "stated.json").read_text())
        # 24: 21 tokens, inside [19.2, 24] (rho 0.8), below [21.6, 24] (rho 0.9)
        assert got["band"] == want_band and [r["in_band"] for r in got["rows"]] == [1.0, want_24]
        assert f"share in band [{want_band:g} B, B]" in (out / "stated.md").read_text()
        outs[flag] = (out / "stated_budgets.png").read_bytes()
    assert outs[None] != outs[0.9]
    # the run's band: from its config (a run folder), none for a folder that is not a run
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(ROOT / "recipes" / "tiny_cpu_stated.yaml",
                                                         ["laconic.band=0.85"])))
    assert _run_band(str(run)) == 0.85 and _run_band(str(tmp_path / "band_None")) is None
    for value in ("1.5", "0"):
        assert main(["eval", "--model", str(run), "--benchmarks", "synthetic", "--output-dir", str(tmp_path / "o"),
                     "--stated-budgets", "16", "--band", value]) == 2
        assert f"--band = {float(value)} is invalid: allowed a number in (0, 1)" in capsys.readouterr().err


def test_stated_budgets_on_math_report_the_band_with_the_transformers_backend(tmp_path, capsys):
    """A tiny Qwen2 model through the transformers backend on CPU, --band 0.5: the share inside [0.5 b, b] per
    stated budget, recomputed here from the samples; the table and the plot."""
    from laconic_nemo.cli import main
    from laconic_nemo.eval.runner import SAMPLES, read_samples
    from tests.hf_fixtures import save_tiny_qwen2

    model = save_tiny_qwen2(tmp_path / "tiny_qwen2")
    out = tmp_path / "stated"
    assert main(["eval", "--model", str(model), "--backend", "transformers", "--benchmarks", "aime2024",
                 "--stated-budgets", "4,8", "--target-instruction", " Think for at most {budget} tokens.",
                 "--band", "0.5", "--n-samples", "3", "--max-tokens", "8", "--limit", "2", "--output-dir", str(out),
                 "--grader-workers", "0", "--name", "tiny"]) == 0
    samples = read_samples(str(out / SAMPLES))
    got = json.loads((out / "stated.json").read_text())
    assert got["band"] == 0.5
    for row, b in zip(got["rows"], (4, 8)):
        lengths = [r["num_tokens"] for r in samples if r["benchmark"] == f"stated_{b}"]
        assert row["n"] == len(lengths) == 6
        assert row["in_band"] == pytest.approx(sum(0.5 * b <= x <= b for x in lengths) / 6)
        assert row["length_ratio"] == pytest.approx(sum(lengths) / 6 / b)
    table = capsys.readouterr().out
    assert "share in band [0.5 B, B]" in table and "| 8 |" in table
    assert (out / "stated_budgets.png").stat().st_size > 1000


def test_the_stated_budget_block_measures_the_band_run_against_its_targets(tmp_path):
    """benchmarks/stated_budgets.py: the held-out adherence per policy (mean L / B and pass@1 at each budget from
    the smallest to the largest trained one, the least-squares slope of length over budget, hand-worked here) and
    the line that says where the band run meets its targets and where not; the kernels named in the last line."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import stated_budgets as sb

    def rows(lengths, passes):
        return [{"budget": b, "mean_length": x, "length_ratio": x / b, "pass@1": p, "within_10": 0.5, "in_band": 0.5,
                 "over_budget": 0.1, "n": 8} for b, x, p in zip((15, 20, 25, 30, 40), lengths, passes)]

    upper = rows([14.0, 21.0, 24.0, 24.0, 30.0], [0.3, 0.6, 0.7, 0.60, 0.7])
    # budgets 20, 25, 30 (trained 20 and 30; 25 between): lengths 19, 24.5, 29 -> slope (29 - 19) / 10 = 1.0
    band = rows([14.0, 19.0, 24.5, 29.0, 31.0], [0.3, 0.6, 0.7, 0.65, 0.7])
    assert sb.slope(band, [20, 30]) == pytest.approx(1.0)
    # 21, 24, 24: mean x 25, mean y 23; sum (x - 25)(y - 23) = -5 * -2 + 0 + 5 * 1 = 15, over 50 -> 0.3
    assert sb.slope(upper, [20, 30]) == pytest.approx(0.3)
    labels = (sb.RUNS[0][3], sb.RUNS[sb.BAND_RUN][3])
    evals = [(labels[0], upper), (labels[1], band)]
    table = "\n".join(sb.adherence_table(evals, [20, 30]))
    assert "| policy | mean L / B at 20, 25 (between), 30 | pass@1 at 20, 25 (between), 30 | slope" in table
    assert f"| {labels[1]} | 0.95, 0.98, 0.97 | 0.600, 0.700, 0.650 | 1.00 |" in table
    line = sb.verdict(dict(evals), [20, 30], labels[1], labels[0])
    assert "met at all of them" in line and "Slope of length over budget 1.00 (target >= 0.8: met)" in line
    assert "20: 0.600 vs 0.600 (met); 30: 0.650 vs 0.600 (met)" in line
    short = rows([14.0, 17.0, 24.5, 24.0, 31.0], [0.3, 0.6, 0.7, 0.5, 0.7])
    line = sb.verdict({labels[0]: upper, labels[1]: short}, [20, 30], labels[1], labels[0])
    assert "met at 25; not at 20 (0.85), 30 (0.80)" in line and "30: 0.500 vs 0.600 (not met)" in line
    assert "Slope of length over budget 0.70 (target >= 0.8: not met)" in line  # (-5)(-4.83) + 5 (2.17) = 35, / 50
    made = {"cpu_isa": {"pin": None, "aten": "AVX512"}}
    assert sb.kernels(made) == "native" and sb.kernels({"cpu_isa": {"pin": "avx2"}}) == "avx2"
