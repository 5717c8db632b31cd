"""The README's stated-budget table and its plot (docs/stated_budgets.png), from fresh runs and evaluations.

    PYTHONPATH=. python benchmarks/stated_budgets.py            # train / evaluate what is missing, print the block
    PYTHONPATH=. python benchmarks/stated_budgets.py --write    # ... and write it into README.md, the PNG into docs/
    PYTHONPATH=. python benchmarks/stated_budgets.py --check    # ... and exit 1 when README.md says something else

Runs (``laconic-nemo train``, 2 local ranks each, into ``RESULTS/<name>``, warm-up cache ``RESULTS/warmup_cache``):
the rows of :data:`RUNS` whose recipe exists: ``tiny_cpu_l1_stated.yaml`` (L1-Max, a fixed coefficient alpha) and
``tiny_cpu_stated.yaml`` (LACONIC with one multiplier per stated-budget class) when that recipe is present. Each run
is evaluated by ``laconic-nemo eval --benchmarks synthetic --stated-budgets`` at the budgets of :data:`BUDGETS`
(stated in the prompt by the run's own ``data.target_instruction``, all inside the range the runs were trained on),
and the first run's warm-up policy (its RL starting point, which never saw a stated budget) with the same prompts
is the reference row. Every evaluation asks the same held-out problems (``--synthetic-problems``, seed 0).

Idempotent and resumable like ``benchmarks/tiny_runs.py`` (whose training and provenance helpers it uses): a
finished run is kept, an interrupted one continues from its checkpoint, an evaluation continues from its
samples.jsonl; the results folder's ``manifest.json`` refuses runs of other code (``--fresh`` starts over). The
README block between ``<!-- stated-budgets:begin ... -->`` and ``<!-- stated-budgets:end -->`` is a function of
the evaluations alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_runs  # noqa: E402  (the training and provenance helpers of the tiny-run table)

ROOT = tiny_runs.ROOT
BEGIN = "<!-- stated-budgets:begin: written by benchmarks/stated_budgets.py, do not edit by hand -->"
END = "<!-- stated-budgets:end -->"
BUDGETS = [16, 24, 32, 40, 48]
# (run folder, recipe, overrides, label); a row whose recipe is absent is skipped
RUNS = [
    ("tiny_cpu_l1_stated", "recipes/tiny_cpu_l1_stated.yaml", [], "L1-Max, alpha = 0.03, 70 steps (`tiny_cpu_l1_stated.yaml`)"),
    ("tiny_cpu_l1_stated_210", "recipes/tiny_cpu_l1_stated.yaml", ["run.num_steps=210"],
     "L1-Max, alpha = 0.03, 210 steps (`tiny_cpu_l1_stated.yaml run.num_steps=210`)"),
    ("tiny_cpu_stated", "recipes/tiny_cpu_stated.yaml", [], "LACONIC, a multiplier per class (`tiny_cpu_stated.yaml`)"),
]
WARMUP_LABEL = "warm-up policy (no RL; never saw a stated budget)"
# the plot's legend: the labels above without the recipe in parentheses (a legend inside the length panel)
def short(label: str) -> str:
    return label.split(" (")[0]


def say(msg: str) -> None:
    print(f"[stated-budgets] {msg}", flush=True)


def runs() -> list[tuple[str, str, list[str], str]]:
    return [r for r in RUNS if (ROOT / r[1]).is_file()]


def evaluate(model: Path, out: Path, args, warmed_up: bool = False, cache: Path | None = None) -> dict:
    """``laconic-nemo eval --stated-budgets`` of one policy (continued when interrupted); its stated.json."""
    cmd = [sys.executable, "-m", "laconic_nemo", "eval", "--model", str(model), "--benchmarks", "synthetic",
           "--stated-budgets", ",".join(map(str, BUDGETS)), "--synthetic-problems", str(args.problems),
           "--n-samples", str(args.n_samples), "--output-dir", str(out)]
    if warmed_up:
        cmd += ["--warmed-up", "--warmup-cache", str(cache)]
    done = out / "stated.json"
    if done.is_file():
        made = json.loads(done.read_text())
        if made.get("n_samples") == args.n_samples and made.get("synthetic_problems") == args.problems:
            return made
    say("$ " + " ".join(cmd[2:]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with (out.parent / f"{out.name}.log").open("a") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"[stated-budgets] evaluation of {model} exited {rc} (log: {out.parent / f'{out.name}.log'})")
    return json.loads(done.read_text())


def block(evals: list[tuple[str, dict]], made: dict, args) -> str:
    lines = [BEGIN, "", "| policy | stated budget | mean length | mean length / budget | pass@1 | share within 10% "
             "| share over budget |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, ev in evals:
        for r in ev["rows"]:
            lines.append(f"| {label} | {r['budget']} | {r['mean_length']:.1f} | {r['length_ratio']:.2f} | "
                         f"{r['pass@1']:.3f} | {r['within_10']:.3f} | {r['over_budget']:.3f} |")
    first = evals[0][1]
    v = made["versions"]
    held = first["rows"][0]["n"] // first["n_samples"]  # fewer than asked when k = 2 has too few unseen problems
    lines += ["", f"Each row: {first['n_samples']} samples of each of {held} held-out problems ({args.problems} asked "
              f"for; the same for every budget and policy), temperature {first['temperature']}, top-p {first['top_p']}, at most "
              f"{first['max_tokens']} tokens. Measured {made['date']} by `PYTHONPATH=. python "
              f"benchmarks/stated_budgets.py --write` (seed {tiny_runs.SEED}; torch {v['torch']}, megatron-core "
              f"{v['megatron-core']}, Python {v['python']}, {made['threads_per_rank']} thread per rank).", "", END]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results/stated_budgets", help="folder of the runs and evaluations")
    ap.add_argument("--problems", type=int, default=128, help="held-out problems per stated budget")
    ap.add_argument("--n-samples", type=int, default=4, help="samples per problem and budget")
    ap.add_argument("--fresh", action="store_true", help="remove RESULTS first")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the block into README.md and the plot PNG")
    mode.add_argument("--check", action="store_true", help="exit 1 when README.md's block differs")
    args = ap.parse_args(argv)
    results = Path(args.results).resolve()
    made = tiny_runs.open_results(results, args.fresh)
    todo = runs()
    for k, (name, recipe, over, _label) in enumerate(todo, 1):
        tiny_runs.train(name, recipe, over, results, k, len(todo))
    first = todo[0][0]
    evals = [(WARMUP_LABEL, evaluate(results / first, results / "eval_warmup", args, warmed_up=True,
                                     cache=results / "warmup_cache"))]
    evals += [(label, evaluate(results / name, results / f"eval_{name}", args)) for name, _r, _o, label in todo]
    text = block(evals, made, args)
    print(text)
    from laconic_nemo.eval.stated import plot

    return tiny_runs.update_readme(
        text, BEGIN, END, args, "stated-budget block", "these evaluations", "docs/stated_budgets.png",
        lambda: plot(str(ROOT / "docs" / "stated_budgets.png"), [(short(label), ev["rows"]) for label, ev in evals]),
        tell=say)


if __name__ == "__main__":
    sys.exit(main())
