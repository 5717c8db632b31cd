"""The paper's Table 1 on the tiny synthetic task: the warmed-up base, GRPO and LACONIC, on held-out problems.

    PYTHONPATH=. python benchmarks/table1_tiny.py                           # train what is missing, evaluate
    PYTHONPATH=. python benchmarks/table1_tiny.py --results /work/main/results --no-train

(a) Trainings, each only when its run is not complete (a checkpoint at the recipe's run.num_steps), all with the
warm-up cache ``RESULTS/warmup_cache``: the base is the cached warm-up policy (the RL starting point; when the
cache is missing a 1-step run of ``recipes/tiny_cpu.yaml`` into ``RESULTS/tiny_cpu_warmup`` writes it),
``recipes/tiny_cpu_grpo.yaml`` into ``RESULTS/tiny_cpu_grpo`` and ``recipes/tiny_cpu.yaml`` (LACONIC) into
``RESULTS/tiny_cpu``; an interrupted training resumes from its checkpoint on a rerun.
(b) Evaluation (``laconic_nemo.eval.synthetic``): ``--problems`` held-out problems (none of them a training
prompt), ``--n-samples`` per problem at the paper's evaluation settings (temperature 0.6, top_p 0.95; limit:
the recipe's rollout.max_new_tokens), one-process megatron-core actor; per policy ``OUT/<name>/samples.jsonl``
(resumable: a rerun generates only missing samples) and ``summary.json``. Then ``OUT/table.md`` (Table 1
layout: Pass@1 and #Tokens, change vs the base in points and in % tokens; a second table per number of terms
k) and ``OUT/pass_vs_tokens.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = [  # (key, label, recipe, run folder under --results)
    ("grpo", "GRPO", "recipes/tiny_cpu_grpo.yaml", "tiny_cpu_grpo"),
    ("laconic", "LACONIC", "recipes/tiny_cpu.yaml", "tiny_cpu"),
]


def say(msg: str) -> None:
    print(f"[table1] {msg}", flush=True)


def run_complete(run_dir: Path, num_steps: int) -> bool:
    from laconic_nemo.grpo.resume import find_checkpoint

    ckpt = find_checkpoint(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else None
    return ckpt is not None and int(json.loads((ckpt / "trainer_state.json").read_text())["step"]) >= num_steps


def train(recipe: str, out: Path, cache: Path, extra: list[str] = ()) -> None:
    cmd = [sys.executable, "-m", "laconic_nemo", "train", str(ROOT / recipe), f"run.output_dir={out}",
           f"warmup.cache_dir={cache}", *extra]
    say("$ " + " ".join(cmd))
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if rc != 0:
        raise SystemExit(f"[table1] training {recipe} exited {rc}; rerun this script to resume it")
    say(f"{recipe}: done in {time.time() - t0:.0f}s")


def per_k_rows(samples: str) -> dict[int, list[dict]]:
    """problem index -> its sample rows, from a samples.jsonl."""
    from laconic_nemo.eval.runner import read_samples

    per = defaultdict(list)
    for r in read_samples(samples):
        per[r["index"]].append(r)
    return per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results", help="folder of the runs and of warmup_cache (default results)")
    ap.add_argument("--out", default=None, help="evaluation folder (default RESULTS/table1_tiny)")
    ap.add_argument("--no-train", action="store_true", help="fail instead of training a missing run")
    ap.add_argument("--problems", type=int, default=512, help="held-out problems asked for (k = 2 has fewer)")
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    from laconic_nemo.config import load_config
    from laconic_nemo.eval.backends import EvalSampling
    from laconic_nemo.eval.runner import PLOT, SAMPLES, comparison_table, evaluate, plot_pass_vs_tokens
    from laconic_nemo.eval.synthetic import (
        BENCHMARK,
        ExactAnswerGrader,
        MegatronBackend,
        benchmark_problems,
        run_config,
        warmup_policy_dir,
    )
    from laconic_nemo.runtime.cpu_isa import pin_cpu_isa
    from laconic_nemo.runtime.megatron_env import cpu_threads

    torch.set_num_threads(cpu_threads())  # the trainer's setting: the warm-up cache key names it
    pin_cpu_isa()  # the CPU trainer's kernels (before the first one here): the warm-up cache key names them too
    results = Path(args.results).resolve()
    cache_root = results / "warmup_cache"
    out = Path(args.out).resolve() if args.out else results / "table1_tiny"

    # (a) trainings
    say(f"results {results}; evaluation {out}")
    for i, (_, label, recipe, folder) in enumerate(RUNS, start=1):
        steps = int(load_config(str(ROOT / recipe)).run.num_steps)
        if run_complete(results / folder, steps):
            say(f"training {i}/{len(RUNS)} {label}: complete ({results / folder}, {steps} steps)")
            continue
        if args.no_train:
            raise SystemExit(f"[table1] {results / folder} is not complete ({steps} steps) and --no-train is set")
        say(f"training {i}/{len(RUNS)} {label}: {recipe} -> {results / folder} (warm-up first if not cached)")
        train(recipe, results / folder, cache_root)
    cfg, world = run_config(results / "tiny_cpu")
    base_dir = warmup_policy_dir(cfg, int(world), cache_root)
    if not (base_dir / "done").is_file():
        if args.no_train:
            raise SystemExit(f"[table1] the warm-up cache {base_dir} is missing and --no-train is set")
        say(f"base: warm-up cache {base_dir} missing; a 1-step run writes it")
        train("recipes/tiny_cpu.yaml", results / "tiny_cpu_warmup", cache_root, ["run.num_steps=1"])
    say(f"base: the cached warm-up policy {base_dir}")

    # (b) evaluation: one held-out set for all three (the runs share task, prompts and seed)
    policies = [("base", "base (warm-up)", base_dir)] + [(k, lbl, results / f) for k, lbl, _, f in RUNS]
    for _, _, path in policies[1:]:
        c, _ = run_config(path)
        if c.model != cfg.model or c.data != cfg.data or c.run.seed != cfg.run.seed:
            raise SystemExit(f"[table1] {path}: model, data or seed differ from {results / 'tiny_cpu'}")
    problems = benchmark_problems(cfg, args.problems, seed=args.seed)
    sampling = EvalSampling(args.temperature, args.top_p, int(cfg.rollout.max_new_tokens))
    say(f"evaluation: {len(problems)} held-out problems x {args.n_samples} samples, temperature {args.temperature}, "
        f"top_p {args.top_p}, max {sampling.max_tokens} tokens")
    backend = MegatronBackend(cfg)
    summaries = []
    for i, (key, label, path) in enumerate(policies, start=1):
        say(f"evaluating {i}/{len(policies)} {label}: {path}")
        backend.load(path, cfg)
        s = evaluate(backend, [BENCHMARK], str(out / key), n_samples=args.n_samples, sampling=sampling,
                     grader=ExactAnswerGrader(), seed=args.seed, chunk_prompts=64, model_name=label,
                     base_summary=summaries[0][1] if summaries else None, problems={BENCHMARK: problems},
                     prompt_fn=lambda text: text, log=lambda m: print(m, flush=True) if m.startswith("[") else None)
        summaries.append((label, s))
    table = comparison_table(summaries)
    # per number of terms k: pass@1 and mean tokens of each policy
    k_of = {p.index: (len(p.problem) - 3) // 2 for p in problems}
    ks = sorted(set(k_of.values()))
    lines = ["| k (problems) | " + " | ".join(f"{lbl} Pass@1 | {lbl} #Tokens" for lbl, _ in summaries) + " |",
             "|" + " --- |" * (1 + 2 * len(summaries))]
    per_policy = [per_k_rows(str(out / key / SAMPLES)) for key, _, _ in policies]
    for k in ks:
        cells = [f"{k} ({sum(1 for v in k_of.values() if v == k)})"]
        for per in per_policy:
            probs = [v for idx, v in per.items() if k_of.get(idx) == k]
            p1 = sum(sum(s["score"] for s in v) / len(v) for v in probs) / len(probs)
            tk = sum(sum(s["num_tokens"] for s in v) / len(v) for v in probs) / len(probs)
            cells += [f"{100 * p1:.1f}", f"{tk:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    by_k = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table + "\nPer number of terms k:\n\n" + by_k)
    plot_pass_vs_tokens(str(out / PLOT), summaries)
    print(table + "\n" + by_k, flush=True)
    say(f"wrote {out / 'table.md'} and {out / PLOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
