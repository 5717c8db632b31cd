"""The stated-budget block of docs/stated_budgets.md and its plots (docs/stated_budgets.png,
docs/stated_budgets_training.png): one policy that follows the budget it is told, LACONIC's per-class multipliers
(upper bound only, and with the band's lower bound) against L1's fixed alpha.

    PYTHONPATH=. python benchmarks/stated_budgets.py            # train / evaluate what is missing, print the block
    PYTHONPATH=. python benchmarks/stated_budgets.py --write    # ... and write it into docs/stated_budgets.md and the PNGs
    PYTHONPATH=. python benchmarks/stated_budgets.py --check    # ... and exit 1 when the file says something else
    ... --doc README.md                                          # the block of another file (its markers)

Runs (``laconic-nemo train``, 2 local ranks each, into ``RESULTS/<name>``, warm-up cache ``RESULTS/warmup_cache``;
RESULTS defaults to ``results/constraint_runs``, the folder of ``benchmarks/tiny_runs.py --constraints``, whose
table reads the same stated and per-prompt runs):

* :data:`RUNS`, the stated budgets: ``tiny_cpu_stated.yaml`` (LACONIC, one multiplier per stated budget),
  ``tiny_cpu_stated_band.yaml`` (the same with the band: a lower bound rho B and its multiplier per budget),
  ``tiny_cpu_stated_l1_max.yaml`` (L1-Max) and ``tiny_cpu_stated_l1_exact.yaml`` (L1-Exact), the same warm-up (the
  budget-aware one, ``data.synthetic.stated_share``: it states budgets in the RL prompts' words), the same stated
  budgets (``data.target_lengths``) and the same number of steps;
* :data:`PER_PROMPT`: ``tiny_cpu_per_prompt.yaml``, budgets from the data (each row's ``data.budget_key`` field, a
  function of the problem's number of terms), nothing stated, the main job's warm-up.

The block: (1) training, per stated budget and run, the first and the last tenth of the steps (mean L / B, share
within 10% of B, share over B, pass@1) and each LACONIC class multiplier along the run (with the band its
lambda_lo too); (2) held-out evaluation, ``laconic-nemo eval --benchmarks synthetic --stated-budgets`` of each
trained policy and of the warm-up policy at :data:`EVAL_BUDGETS` (the trained budgets, budgets between them and
outside them; every policy measured against the band run's band, ``--band``); (3) per policy the held-out mean
L / B at the trained budgets and between them, pass@1, and the slope of the mean length over the stated budget
(least squares over the held-out budgets from the smallest to the largest trained one), and whether the band run
meets :data:`TARGETS`; (4) the per-prompt classes in training and on held-out problems (``laconic-nemo eval
--benchmarks synthetic``, each sample's B_i from its problem's k, grouped into the recipe's bins). Every
evaluation asks the same held-out problems (seed 0).

Idempotent and resumable like ``benchmarks/tiny_runs.py`` (whose training and provenance helpers it uses): a
finished run is kept, an interrupted one continues from its checkpoint, an evaluation continues from its
samples.jsonl; the results folder's ``manifest.json`` refuses runs of other code (``--fresh`` starts over). The
block between ``<!-- stated-budgets:begin ... -->`` and ``<!-- stated-budgets:end -->`` (of docs/stated_budgets.md,
or ``--doc``) is a function of the runs and evaluations alone; its last line names the CPU kernels
(``LACONIC_CPU_ISA``) the runs were made with.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_runs  # noqa: E402  (the training and provenance helpers of the tiny-run table)

ROOT = tiny_runs.ROOT
BEGIN = "<!-- stated-budgets:begin: written by benchmarks/stated_budgets.py, do not edit by hand -->"
END = "<!-- stated-budgets:end -->"
DOC = "docs/stated_budgets.md"
# (run folder, recipe, overrides, label): LACONIC first (the other rows are compared with it), the band second
RUNS = [
    ("tiny_cpu_stated", "recipes/tiny_cpu_stated.yaml", [], "LACONIC, a multiplier per budget"),
    ("tiny_cpu_stated_band", "recipes/tiny_cpu_stated_band.yaml", [], "LACONIC with the band"),
    ("tiny_cpu_stated_l1_max", "recipes/tiny_cpu_stated_l1_max.yaml", [], "L1-Max, alpha 0.03"),
    ("tiny_cpu_stated_l1_exact", "recipes/tiny_cpu_stated_l1_exact.yaml", [], "L1-Exact, alpha 0.03"),
]
BAND_RUN = 1  # the index in RUNS of the band run, whose laconic.band every evaluation's band share uses
# what the band run is to reach on held-out problems: mean L / B within [0.9, 1.1] at every held-out budget from the
# smallest to the largest trained one, the slope of the mean length over the budget at least 0.8, pass@1 at the
# largest two trained budgets at least the upper-bound run's
TARGETS = {"ratio": (0.9, 1.1), "slope": 0.8}
PER_PROMPT = ("tiny_cpu_per_prompt", "recipes/tiny_cpu_per_prompt.yaml", [],
              "LACONIC, per-prompt budgets from the data")
# the held-out evaluation's stated budgets: the trained ones (tiny_cpu_stated.yaml: 20, 25, 30, 35), one between
# each pair of them, and one outside the trained range on either side
EVAL_BUDGETS = [15, 20, 22, 25, 27, 30, 32, 35, 40]
WARMUP_LABEL = "warm-up policy (no RL)"
WITHIN = 0.1


def say(msg: str) -> None:
    print(f"[stated-budgets] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ evaluation
def evaluate(model: Path, out: Path, args, budgets: list[int] | None, warmed_up: bool = False,
             cache: Path | None = None, band: float | None = None) -> Path:
    """``laconic-nemo eval --benchmarks synthetic`` of one policy (``--stated-budgets`` when ``budgets``, the share
    inside the band [band B, B] with ``band``), continued when interrupted; returns its output folder."""
    cmd = [sys.executable, "-m", "laconic_nemo", "eval", "--model", str(model), "--benchmarks", "synthetic",
           "--synthetic-problems", str(args.problems), "--n-samples", str(args.n_samples), "--output-dir", str(out)]
    if budgets is not None:
        cmd += ["--stated-budgets", ",".join(map(str, budgets))]
        if band is not None:
            cmd += ["--band", f"{band:g}"]
    if warmed_up:
        cmd += ["--warmed-up", "--warmup-cache", str(cache)]
    done = out / ("stated.json" if budgets is not None else "summary.json")
    stamp = out / "asked.json"
    asked = {"problems": args.problems, "n_samples": args.n_samples, "budgets": budgets}
    if band is not None:
        asked["band"] = band
    if done.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == asked:
        return out
    say("$ " + " ".join(cmd[2:]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with (out.parent / f"{out.name}.log").open("a") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"[stated-budgets] evaluation of {model} exited {rc} (log: {out.parent / f'{out.name}.log'})")
    stamp.write_text(json.dumps(asked))
    return out


def stated_eval_rows(out: Path) -> list[dict]:
    return json.loads((out / "stated.json").read_text())["rows"]


def per_class_eval(run_dir: Path, out: Path, args) -> dict[str, dict]:
    """Per budget class of a per-prompt run, over its held-out samples (plain prompts): each sample's B_i from its
    problem's number of terms (data.synthetic.budgets_by_terms), grouped into the run's bins; the mean of L / B_i,
    the shares within 10% and over, pass@1."""
    from laconic_nemo.core import BudgetClasses
    from laconic_nemo.eval.runner import read_samples
    from laconic_nemo.eval.synthetic import _task, heldout_problems, run_config

    cfg, _ = run_config(run_dir)
    task = _task(cfg)
    problems = heldout_problems(cfg, args.problems)
    classes = BudgetClasses([float(b) for b in cfg.data.synthetic.budgets_by_terms], cfg.laconic.budget_classes,
                            eta=0.0, ceiling=0.0)
    acc: dict[str, list] = {n: [] for n in classes.names}
    for r in read_samples(str(out / "samples.jsonl")):
        if r["sample"] >= args.n_samples or r["index"] >= len(problems):
            continue
        b = float(task.budget_of(problems[r["index"]]))
        name = classes.names[classes.class_of_budget[classes.budgets.index(b)]]
        acc[name].append((int(r["num_tokens"]), b, float(r["score"])))
    return {n: summarize(v) for n, v in acc.items() if v}


def summarize(samples: list[tuple[int, float, float]]) -> dict:
    """(L, B, score) samples -> mean of L / B, within 10%, over, pass@1, n."""
    n = len(samples)
    return {"length_ratio": sum(L / b for L, b, _ in samples) / n,
            "within_10": sum(abs(L - b) <= WITHIN * b for L, b, _ in samples) / n,
            "over_budget": sum(L > b for L, b, _ in samples) / n, "pass@1": sum(s for *_, s in samples) / n, "n": n}


# ------------------------------------------------------------------------------------------------ training tables
def class_names(rows: list[dict]) -> list[str]:
    names = {k.split("/")[1] for r in rows for k in r if k.startswith("budget_class/")}
    return sorted(names, key=lambda x: float(x.split("-")[0]))


def avg(rows: list[dict], key: str) -> float:
    vals = [float(r[key]) for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else math.nan


def training_summary(rows: list[dict]) -> dict[str, dict]:
    """Per class: the first and the last tenth's means of the report (budget_class/<name>/...), the multiplier at
    steps 10, 30, 50 and the last (LACONIC's classes; with the band its lambda_lo too), the task reward over the
    last tenth."""
    n = tiny_runs.tenth(rows)
    first, last = rows[:n], rows[-n:]
    steps = [s for s in (10, 30, 50, len(rows)) if s <= len(rows)]
    out = {}
    for name in class_names(rows):
        k = f"budget_class/{name}/"
        lam = [rows[s - 1].get(f"laconic/lambda/class_{name}") for s in steps]
        lam_lo = [rows[s - 1].get(f"laconic/lambda_lo/class_{name}") for s in steps]
        out[name] = {"ratio": (avg(first, k + "length_ratio"), avg(last, k + "length_ratio")),
                     "within_10": avg(last, k + "within_10"), "over_budget": avg(last, k + "over_budget"),
                     "pass@1": (avg(first, k + "pass@1"), avg(last, k + "pass@1")),
                     "lambda": None if lam[-1] is None else lam,
                     "lambda_lo": None if lam_lo[-1] is None else lam_lo}
    return out


def held(ratio: float) -> str:
    return "yes" if abs(ratio - 1) <= WITHIN else "no"


def lam_path(lam, lam_lo=None) -> str:
    if lam is None:
        return "none (fixed alpha)"
    path = " -> ".join(f"{x:.2f}" for x in lam)
    return path if lam_lo is None else f"{path}; lambda_lo {' -> '.join(f'{x:.2f}' for x in lam_lo)}"


def training_table(runs: list[tuple[str, dict, int]]) -> list[str]:
    lines = ["| run | stated budget | mean L / B, first -> last tenth | within 10% | over budget | pass@1, first -> "
             "last tenth | multiplier at steps 10, 30, 50, end | held (last tenth) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, summ, _ in runs:
        for name, s in summ.items():
            (a, b), (p0, p1) = s["ratio"], s["pass@1"]
            lines.append(f"| {label} | {name} | {a:.2f} -> {b:.2f} | {s['within_10']:.2f} | {s['over_budget']:.2f} | "
                         f"{p0:.3f} -> {p1:.3f} | {lam_path(s['lambda'], s.get('lambda_lo'))} | {held(b)} |")
    return lines


def kind_of(budget: int, trained: list[int]) -> str:
    if budget in trained:
        return "trained"
    if min(trained) < budget < max(trained):
        return "between"
    return "outside"


def eval_table(evals: list[tuple[str, list[dict]]], trained: list[int], band: float) -> list[str]:
    lines = [f"| policy | stated budget | mean length | mean length / budget | pass@1 | in band [{band:g} B, B] | "
             "within 10% | over budget |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, rows in evals:
        for r in rows:
            b = r["budget"]
            lines.append(f"| {label} | {b} ({kind_of(b, trained)}) | {r['mean_length']:.1f} | {r['length_ratio']:.2f} "
                         f"| {r['pass@1']:.3f} | {r['in_band']:.2f} | {r['within_10']:.2f} | {r['over_budget']:.2f} |")
    return lines


def slope(rows: list[dict], trained: list[int]) -> float:
    """Least-squares slope of the held-out mean length over the stated budget, over the held-out budgets from the
    smallest to the largest trained one (tokens of length per token of budget; 1 follows the budget one to one)."""
    pts = [(r["budget"], r["mean_length"]) for r in rows if min(trained) <= r["budget"] <= max(trained)]
    if len({b for b, _ in pts}) < 2:
        return math.nan
    mx = sum(b for b, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((b - mx) * (y - my) for b, y in pts) / sum((b - mx) ** 2 for b, _ in pts)


def adherence_table(evals: list[tuple[str, list[dict]]], trained: list[int]) -> list[str]:
    """Per policy: held-out mean L / B and pass@1 at each budget from the smallest to the largest trained one, and
    the slope of length over budget."""
    inside = [r["budget"] for r in evals[0][1] if min(trained) <= r["budget"] <= max(trained)]
    head = ", ".join(f"{b}{'' if b in trained else ' (between)'}" for b in inside)
    lines = [f"| policy | mean L / B at {head} | pass@1 at {head} | slope of length over budget |",
             "| --- | --- | --- | --- |"]
    for label, rows in evals:
        by = {r["budget"]: r for r in rows}
        ratios = ", ".join(f"{by[b]['length_ratio']:.2f}" for b in inside)
        passes = ", ".join(f"{by[b]['pass@1']:.3f}" for b in inside)
        lines.append(f"| {label} | {ratios} | {passes} | {slope(rows, trained):.2f} |")
    return lines


def verdict(evals: dict[str, list[dict]], trained: list[int], band_label: str, upper_label: str) -> str:
    """Where the band run meets :data:`TARGETS` on held-out problems and where not (one paragraph)."""
    lo, hi = TARGETS["ratio"]
    band, upper = ({r["budget"]: r for r in evals[x]} for x in (band_label, upper_label))
    inside = [b for b in sorted(band) if min(trained) <= b <= max(trained)]
    ok = [b for b in inside if lo <= band[b]["length_ratio"] <= hi]
    off = [f"{b} ({band[b]['length_ratio']:.2f})" for b in inside if b not in ok]
    k = slope(evals[band_label], trained)
    top = sorted(trained)[-2:]
    acc = [f"{b}: {band[b]['pass@1']:.3f} vs {upper[b]['pass@1']:.3f} "
           f"({'met' if band[b]['pass@1'] >= upper[b]['pass@1'] else 'not met'})" for b in top]
    return (f"Targets of the band run on held-out problems: mean L / B within [{lo:g}, {hi:g}] at every budget from "
            f"{min(trained)} to {max(trained)}: " + ("met at all of them" if not off else
                                                       f"met at {', '.join(map(str, ok)) or 'none'}; not at "
                                                       f"{', '.join(off)}")
            + f". Slope of length over budget {k:.2f} (target >= {TARGETS['slope']:g}: "
            f"{'met' if k >= TARGETS['slope'] else 'not met'}). pass@1 against the upper-bound run at "
            + "; ".join(acc) + ".")


def per_prompt_table(train: dict[str, dict], held_out: dict[str, dict], warm: dict[str, dict]) -> list[str]:
    lines = ["| budget class (B_i = 3.5 k + 9) | training: mean L / B_i, first -> last tenth | within 10% | over | "
             "pass@1, last tenth | multiplier at steps 10, 30, 50, end | held-out: mean L / B_i | within 10% | over "
             "| pass@1 | warm-up on the same problems: mean L / B_i, pass@1 | held (training, held-out) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in train.items():
        h, w = held_out[name], warm[name]
        (a, b), (_, p1) = s["ratio"], s["pass@1"]
        lines.append(f"| {name} | {a:.2f} -> {b:.2f} | {s['within_10']:.2f} | {s['over_budget']:.2f} | {p1:.3f} | "
                     f"{lam_path(s['lambda'])} | {h['length_ratio']:.2f} | {h['within_10']:.2f} | "
                     f"{h['over_budget']:.2f} | {h['pass@1']:.3f} | {w['length_ratio']:.2f}, {w['pass@1']:.3f} | "
                     f"{held(b)}, {held(h['length_ratio'])} |")
    return lines


def block(runs, evals, per_prompt, trained, made: dict, args, steps: int, band: float | None = None) -> str:
    """The block; ``band``: rho of the band run (None: no band run among ``evals``, no target line)."""
    held_evals = {label: rows for label, rows in evals}
    lines = [BEGIN, "", f"Training ({steps} steps each, the same budget-aware warm-up; the last tenth is the last "
             f"{tiny_runs.tenth([0] * steps)} steps; pass@1 is the training reward's accuracy at temperature 1):", ""]
    lines += training_table(runs)
    lines += ["", f"Held-out evaluation (`laconic-nemo eval --benchmarks synthetic --stated-budgets "
              f"{','.join(map(str, EVAL_BUDGETS))}`; trained: a budget of the runs, between: between two of them, "
              "outside: beyond them):", ""]
    lines += eval_table(evals, trained, 0.9 if band is None else band)
    lines += ["", "Held-out adherence per policy (the stated budgets from the smallest to the largest trained one; "
              "slope: least squares of the mean length over the stated budget there):", ""]
    lines += adherence_table(evals, trained)
    if band is not None:
        lines += ["", verdict(held_evals, trained, RUNS[BAND_RUN][3], RUNS[0][3])]
    if per_prompt is None:
        lines += ["", f"Per-prompt budgets from the data (`{Path(PER_PROMPT[1]).name}`): not measured in this block "
                  "(`PYTHONPATH=. python benchmarks/stated_budgets.py --write` trains and evaluates it)."]
    else:
        train_pp, held_pp, warm_pp = per_prompt
        lines += ["", f"Per-prompt budgets from the data (`{Path(PER_PROMPT[1]).name}`, {steps} steps, nothing "
                  "stated; held-out: `laconic-nemo eval --benchmarks synthetic`, each sample's B_i from its problem):",
                  ""]
        lines += per_prompt_table(train_pp, held_pp, warm_pp)
    first = json.loads((args.results / "eval_tiny_cpu_stated" / "stated.json").read_text())
    skip = " --skip-per-prompt" if per_prompt is None else ""
    rows0 = next(iter(held_evals.values()))
    held_n = rows0[0]["n"] // args.n_samples  # fewer than asked when k = 2 has too few unseen problems
    lines += ["", f"Held-out: {args.n_samples} samples of each of {held_n} problems ({args.problems} asked for; the "
              f"same for every budget and policy; none of them an RL prompt), temperature {first['temperature']}, "
              f"top-p {first['top_p']}, at most {first['max_tokens']} tokens. Measured {made['date']} by "
              f"`LACONIC_CPU_ISA={kernels(made)} PYTHONPATH=. python benchmarks/stated_budgets.py --write{skip}` "
              f"(every row in the one run of the script; seed {tiny_runs.SEED}; {tiny_runs.made_with(made)}).",
              "", END]
    return "\n".join(lines)


def kernels(made: dict) -> str:
    """The ``LACONIC_CPU_ISA`` setting the runs were made with: the pinned choice's name, else ``native`` (the
    machine's own kernels; the manifest's cpu_isa names the CPU)."""
    return made["cpu_isa"].get("pin") or "native"


# ------------------------------------------------------------------------------------------------ plots
def plot_training(path: Path, runs: list[tuple[str, list[dict]]]) -> None:
    """Per run, each class's mean L / B along training (one panel per run, the 10% band shaded) and, in a last
    panel, the class multipliers of the LACONIC runs (solid: lambda; dashed: the band run's lambda_lo)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs) + 1, figsize=(4.2 * (len(runs) + 1), 3.6))
    for ax, (label, rows) in zip(axes, runs):
        steps = [r["step"] for r in rows]
        ax.axhspan(1 - WITHIN, 1 + WITHIN, color="gray", alpha=0.15)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        for name in class_names(rows):
            ys = [r.get(f"budget_class/{name}/length_ratio") for r in rows]
            ax.plot(steps, [math.nan if y is None else y for y in ys], label=f"budget {name}")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("mean L / B")
        ax.set_ylim(0, 2.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    named = set()
    for i, (_label, rows) in enumerate(runs):
        steps = [r["step"] for r in rows]
        for j, name in enumerate(class_names(rows)):
            for key, ls in (("lambda", "-" if i == 0 else "-."), ("lambda_lo", "--")):
                if any(f"laconic/{key}/class_{name}" in r for r in rows):
                    ax.plot(steps, [r.get(f"laconic/{key}/class_{name}", math.nan) for r in rows], color=f"C{j}",
                            ls=ls, lw=1, label=None if name in named else f"budget {name}")
                    named.add(name)
    ax.set_title("multipliers: solid lambda (upper-bound run),\ndash-dot lambda and dashed lambda_lo (band run)",
                 fontsize=8)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="results/constraint_runs", help="folder of the runs and evaluations")
    ap.add_argument("--problems", type=int, default=128, help="held-out problems per stated budget")
    ap.add_argument("--n-samples", type=int, default=4, help="samples per problem and budget")
    ap.add_argument("--fresh", action="store_true", help="remove RESULTS first")
    ap.add_argument("--skip-per-prompt", action="store_true",
                    help="leave the per-prompt run out (neither trained nor evaluated): the block says it is not "
                         "measured and names the command that measures it")
    ap.add_argument("--doc", default=DOC, help="the markdown file (under the repository) whose block --write replaces "
                    "and --check compares (default %(default)s; README.md where the block sits there)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the block into --doc and the plot PNGs")
    mode.add_argument("--check", action="store_true", help="exit 1 when --doc's block differs")
    args = ap.parse_args(argv)
    from laconic_nemo.config import load_config
    from laconic_nemo.runtime.cpu_isa import pin_cpu_isa

    pin_cpu_isa()  # as the ranks' launcher pins them (CPU runs): the manifest and the block name it
    args.results = results = Path(args.results).resolve()
    made = tiny_runs.open_results(results, args.fresh)
    todo = [*RUNS] if args.skip_per_prompt else [*RUNS, PER_PROMPT]
    for k, (name, recipe, over, _label) in enumerate(todo, 1):
        tiny_runs.train(name, recipe, over, results, k, len(todo))
    trained = sorted(load_config(str(ROOT / RUNS[0][1]), RUNS[0][2]).data.stated_budgets())
    steps = tiny_runs.num_steps(RUNS[0][1], RUNS[0][2])
    band = float(load_config(str(ROOT / RUNS[BAND_RUN][1]), RUNS[BAND_RUN][2]).laconic.band)
    cache = results / "warmup_cache"
    evals = [(WARMUP_LABEL, stated_eval_rows(evaluate(results / RUNS[0][0], results / "eval_stated_warmup", args,
                                                      EVAL_BUDGETS, warmed_up=True, cache=cache, band=band)))]
    evals += [(label, stated_eval_rows(evaluate(results / name, results / f"eval_{name}", args, EVAL_BUDGETS,
                                                band=band)))
              for name, _r, _o, label in RUNS]
    metrics = [(label, tiny_runs.rows_of(results / name)) for name, _r, _o, label in RUNS]
    runs = [(label, training_summary(rows), len(rows)) for label, rows in metrics]
    pp = results / PER_PROMPT[0]
    per_prompt = None if args.skip_per_prompt else (
        training_summary(tiny_runs.rows_of(pp)),
        per_class_eval(pp, evaluate(pp, results / f"eval_{PER_PROMPT[0]}", args, None), args),
        per_class_eval(pp, evaluate(pp, results / "eval_per_prompt_warmup", args, None, warmed_up=True, cache=cache),
                       args))
    text = block(runs, evals, per_prompt, trained, made, args, steps, band)
    print(text)
    from laconic_nemo.eval.stated import plot

    def draw():
        plot(str(ROOT / "docs" / "stated_budgets.png"), [(label, rows) for label, rows in evals], band)
        plot_training(ROOT / "docs" / "stated_budgets_training.png", metrics)

    return tiny_runs.update_readme(text, BEGIN, END, args, "stated-budget block", "these runs and evaluations",
                                   "docs/stated_budgets.png and docs/stated_budgets_training.png", draw, tell=say,
                                   doc=args.doc)


if __name__ == "__main__":
    sys.exit(main())
