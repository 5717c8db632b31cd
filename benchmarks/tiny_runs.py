"""The README's tiny-run table, its curves (docs/tiny_cpu_curves.png) and its seed-spread line, from fresh runs.

    PYTHONPATH=. python benchmarks/tiny_runs.py            # train what is missing (~1 h on 2 cores), print the block
    PYTHONPATH=. python benchmarks/tiny_runs.py --write    # ... and write it into README.md and the PNG into docs/
    PYTHONPATH=. python benchmarks/tiny_runs.py --check    # ... and exit 1 when README.md says something else
    PYTHONPATH=. python benchmarks/tiny_runs.py --constraints --write   # the constraints-beyond-the-mean table

With ``--constraints`` the runs are the tiny recipes of the constraints beyond the mean (``CONSTRAINT_ROWS``, into
``results/constraint_runs``), and the block is the README's ``<!-- constraint-runs:begin ... -->`` table: per
constraint, its measured value over the first and the last tenth of the steps, its bound, its multiplier at the
last step and whether the last tenth is within the bound (the tail share at most q; each budget class's mean
L / B, and the reasoning span's mean / B, within 10% of 1). A recipe that does not load here (the reasoning-only
one needs the task's marker, data.synthetic.reasoning_marker) is listed as not run, with the reason.

Runs (``laconic-nemo train``, 2 local ranks each, into ``RESULTS/<name>``, all with the warm-up cache
``RESULTS/warmup_cache``): the four rows of the table with seed 7 (``tiny_cpu.yaml``, ``tiny_cpu_grpo.yaml``,
``tiny_cpu.yaml laconic.ceiling=null``, ``tiny_cpu_pid.yaml``) and ``tiny_cpu.yaml`` with the other seeds of
``--seeds`` (each seed has its own warm-up: the spread covers the whole recipe).

Idempotent and resumable: a finished run (its checkpoint at run.num_steps) is not run again, an interrupted one
continues from its checkpoint (bit for bit as if uninterrupted), and the warm-up cache is reused. The results
folder records what made it (``manifest.json``: a digest of the package's code and recipes, the torch /
megatron-core versions, the threads per rank); a rerun with other code or versions refuses to mix its runs
with those (``--fresh`` starts the folder over). The README block between the markers
``<!-- tiny-runs:begin -->`` and ``<!-- tiny-runs:end -->`` is a function of the runs alone, so ``--check`` on a
fresh clone says whether the README is what its command prints there.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- tiny-runs:begin: written by benchmarks/tiny_runs.py, do not edit by hand -->"
END = "<!-- tiny-runs:end -->"
SEED = 7
# (run folder, recipe, overrides, the table's first column)
ROWS = [
    ("tiny_cpu", "recipes/tiny_cpu.yaml", [], "`tiny_cpu.yaml` (LACONIC, B = 31)"),
    ("tiny_cpu_grpo", "recipes/tiny_cpu_grpo.yaml", [], "`tiny_cpu_grpo.yaml` (lambda = 0)"),
    ("tiny_cpu_ceiling_null", "recipes/tiny_cpu.yaml", ["laconic.ceiling=null"],
     "`tiny_cpu.yaml laconic.ceiling=null` (paper default Lambda = B / (L_max - B) = 0.477)"),
    ("tiny_cpu_pid", "recipes/tiny_cpu_pid.yaml", [], "`tiny_cpu_pid.yaml` (pid controller, beyond the paper)"),
]


C_BEGIN = "<!-- constraint-runs:begin: written by benchmarks/tiny_runs.py --constraints, do not edit by hand -->"
C_END = "<!-- constraint-runs:end -->"
CONSTRAINT_ROWS = [
    ("tiny_cpu_tail", "recipes/tiny_cpu_tail.yaml", [], "`tiny_cpu_tail.yaml`"),
    ("tiny_cpu_stated", "recipes/tiny_cpu_stated.yaml", [], "`tiny_cpu_stated.yaml`"),
    ("tiny_cpu_per_prompt", "recipes/tiny_cpu_per_prompt.yaml", [], "`tiny_cpu_per_prompt.yaml`"),
    ("tiny_cpu_reasoning", "recipes/tiny_cpu_reasoning.yaml", [], "`tiny_cpu_reasoning.yaml`"),
]


def say(msg: str) -> None:
    print(f"[tiny-runs] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ provenance
def code_digest() -> str:
    """sha256 (12 hex digits) of the package's code and recipes as they run: the syntax trees of its modules and the
    parsed recipes (docstrings and comments do not count)."""
    import yaml

    from laconic_nemo.app.warmup import normalized_source

    h = hashlib.sha256()
    pkg = ROOT / "laconic_nemo"
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode() + b"\0" + normalized_source(f.read_text()).encode())
    for f in sorted((pkg / "recipes").glob("*.yaml")):
        h.update(f.name.encode() + b"\0" + json.dumps(yaml.safe_load(f.read_text()), sort_keys=True).encode())
    return h.hexdigest()[:12]


def provenance() -> dict:
    """What the runs are a function of besides the recipes: the code, the library versions, the threads per rank
    and the instruction set of the ranks' CPU kernels (this process is pinned as the ranks are: :func:`main`)."""
    from laconic_nemo.app.warmup import library_versions
    from laconic_nemo.runtime.cpu_isa import cpu_isa
    from laconic_nemo.runtime.megatron_env import cpu_threads

    return {"code": code_digest(), "versions": library_versions(), "threads_per_rank": cpu_threads(),
            "cpu_isa": cpu_isa()}


def made_with(made: dict) -> str:
    """The versions, threads and CPU kernels of the block's last line."""
    from laconic_nemo.runtime.cpu_isa import describe

    v = made["versions"]
    return (f"torch {v['torch']}, megatron-core {v['megatron-core']}, Python {v['python']}, "
            f"{made['threads_per_rank']} thread per rank, CPU kernels {describe(made['cpu_isa'])}")


def open_results(results: Path, fresh: bool) -> dict:
    """The results folder's manifest (created with today's date when new); refuses a folder made by other code."""
    manifest = results / "manifest.json"
    if fresh and results.exists():
        say(f"--fresh: removing {results}")
        shutil.rmtree(results)
    now = provenance()
    if manifest.is_file():
        made = json.loads(manifest.read_text())
        differ = [k for k in now if made.get(k) != now[k]]
        if differ:
            raise SystemExit(f"[tiny-runs] {results} holds runs of other {', '.join(differ)} ({made}; now {now}): "
                             f"rerun with --fresh, or give another --results folder")
        return made
    results.mkdir(parents=True, exist_ok=True)
    made = {**now, "date": datetime.date.today().isoformat()}
    manifest.write_text(json.dumps(made, indent=1, sort_keys=True) + "\n")
    return made


# ------------------------------------------------------------------------------------------------ training
def num_steps(recipe: str, overrides: list[str]) -> int:
    from laconic_nemo.config import load_config

    return int(load_config(str(ROOT / recipe), overrides).run.num_steps)


def run_complete(run_dir: Path, steps: int) -> bool:
    from laconic_nemo.grpo.resume import find_checkpoint

    ckpt = find_checkpoint(run_dir / "checkpoints") if (run_dir / "checkpoints").is_dir() else None
    return ckpt is not None and int(json.loads((ckpt / "trainer_state.json").read_text())["step"]) >= steps


def train(name: str, recipe: str, overrides: list[str], results: Path, k: int, n: int) -> None:
    """``laconic-nemo train`` of one run (resumed when it was interrupted); its whole output goes to
    ``RESULTS/<name>.log``, the warm-up and step lines (with their ETA) to the terminal."""
    out = results / name
    steps = num_steps(recipe, overrides)
    if run_complete(out, steps):
        say(f"[{k}/{n}] {name}: complete ({steps} steps), kept")
        return
    cmd = [sys.executable, "-m", "laconic_nemo", "train", str(ROOT / recipe), *overrides, f"run.output_dir={out}",
           f"warmup.cache_dir={results / 'warmup_cache'}", "logging.plot=false"]
    say(f"[{k}/{n}] {name}: " + ("resuming" if out.exists() else "training") + " $ " + " ".join(cmd[2:]))
    t0 = time.time()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with (results / f"{name}.log").open("a") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            if line.startswith(("warmup ", "warm-up:", "step ", "resumed from", "laconic-nemo train:")):
                print(f"  {name} | {line.rstrip()}", flush=True)
        rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"[tiny-runs] {name} exited {rc} (log: {results / f'{name}.log'}); rerun this script to "
                         f"resume it")
    say(f"[{k}/{n}] {name}: done in {time.time() - t0:.0f} s")


# ------------------------------------------------------------------------------------------------ the table
def rows_of(run_dir: Path) -> list[dict]:
    from laconic_nemo.grpo.resume import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")[0]


def tenth(rows: list[dict]) -> int:
    return max(1, math.ceil(len(rows) / 10))


def mean(rows: list[dict], key: str) -> float:
    return sum(float(r[key]) for r in rows) / len(rows)


def summary(rows: list[dict], ceiling: float | None) -> dict:
    n = tenth(rows)
    first, last = rows[:n], rows[-n:]
    peak = max(rows, key=lambda r: r["lambda_next"])
    at_ceiling = [r["step"] for r in rows if ceiling is not None and r["lambda_next"] >= ceiling]
    return {"length": (mean(first, "mean_response_length"), mean(last, "mean_response_length")),
            "reward": (mean(first, "task_reward"), mean(last, "task_reward")),
            "last_lengths": (min(r["mean_response_length"] for r in last), max(r["mean_response_length"] for r in last)),
            "lambda_end": float(rows[-1]["lambda_next"]), "peak": (float(peak["lambda_next"]), int(peak["step"])),
            "at_ceiling": (at_ceiling[0], at_ceiling[-1], len(at_ceiling)) if at_ceiling else None}


def run_ceiling(run_dir: Path) -> float | None:
    """The run's Lambda as its controller used it (config.yaml; null -> B / (L_max - B))."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / "config.yaml")
    lc = cfg.laconic
    if lc.shaper not in ("laconic", "linear"):
        return None
    return float(lc.ceiling) if lc.ceiling is not None else float(lc.budget) / (cfg.rollout.max_new_tokens - lc.budget)


def table_row(label: str, s: dict, shaper_lambda: bool, ceiling: float | None) -> str:
    (l0, l1), (r0, r1), (lo, hi) = s["length"], s["reward"], s["last_lengths"]
    if not shaper_lambda:
        lam = f"{s['lambda_end']:.3g}"
    else:
        lam = f"{s['lambda_end']:.3f} (peak {s['peak'][0]:.3f} at step {s['peak'][1]}"
        if s["at_ceiling"] is not None:
            a, b, k = s["at_ceiling"]
            lam += f"; at the ceiling {ceiling:.3f} for {k} steps between {a} and {b}"
        elif ceiling is not None:
            lam += f"; ceiling {ceiling:.3g}"
        lam += ")"
    return (f"| {label} | {l0:.1f} -> {l1:.1f} (steps of the last tenth: {lo:.1f}-{hi:.1f}) | {r0:.3f} -> {r1:.3f} "
            f"| {lam} |")


def spread_line(per_seed: dict[int, dict]) -> str:
    seeds = sorted(per_seed)

    def stat(key, i, fmt):
        vals = [per_seed[s][key][i] if i is not None else per_seed[s][key] for s in seeds]
        return (", ".join(format(v, fmt) for v in vals)
                + f" (mean {format(sum(vals) / len(vals), fmt)}, range {format(max(vals) - min(vals), fmt)})")

    return (f"Spread across seeds {', '.join(map(str, seeds))} of `tiny_cpu.yaml` (`run.seed=...`: each its own "
            f"warm-up, prompts and samples): mean length over the last tenth {stat('length', 1, '.1f')}; task reward "
            f"over the last tenth {stat('reward', 1, '.3f')}; lambda at the end {stat('lambda_end', None, '.3f')}.")


def block(results: Path, made: dict, seeds: list[int]) -> str:
    lines = [BEGIN, "", "| run | mean length, first tenth -> last tenth | task reward, first -> last tenth | "
             "lambda at the end |", "| --- | --- | --- | --- |"]
    for name, _recipe, _over, label in ROWS:
        rows = rows_of(results / name)
        ceiling = run_ceiling(results / name)
        lines.append(table_row(label, summary(rows, ceiling), name != "tiny_cpu_grpo", ceiling))
    per_seed = {SEED: summary(rows_of(results / "tiny_cpu"), run_ceiling(results / "tiny_cpu"))}
    for s in seeds:
        if s != SEED:
            per_seed[s] = summary(rows_of(results / f"tiny_cpu_seed{s}"), None)
    lines += ["", spread_line(per_seed), "",
              f"Measured {made['date']} by `PYTHONPATH=. python benchmarks/tiny_runs.py --write` (seed {SEED} unless "
              f"said; {made_with(made)}).", "", END]
    return "\n".join(lines)


def loads(recipe: str, overrides: list[str]) -> str | None:
    """None when the recipe loads here, else why not (one line)."""
    from laconic_nemo.config import ConfigError

    try:
        num_steps(recipe, overrides)
    except ConfigError as exc:
        return str(exc)
    return None


def constraint_rows(label: str, rows: list[dict], cfg) -> list[str]:
    """The table rows of one run: one per constraint (per budget class)."""
    n = tenth(rows)
    first, last = rows[:n], rows[-n:]
    r0, r1 = mean(first, "task_reward"), mean(last, "task_reward")
    reward = f"{r0:.3f} -> {r1:.3f}"
    lc = cfg.laconic
    out = []

    def avg(rs, key):
        vals = [float(r[key]) for r in rs if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else math.nan

    if lc.tail_budget is not None:
        a, b = avg(first, "laconic/tail_share"), avg(last, "laconic/tail_share")
        out.append(f"| {label} | tail: share of L > {lc.tail_budget:g} | {a:.3f} -> {b:.3f} | <= q = {lc.tail_share:g} "
                   f"| mu {rows[-1]['laconic/mu_tail']:.3f} | {'yes' if b <= lc.tail_share else 'no'} | {reward} |")
    keys = sorted({k[len("laconic/length_ratio/class_"):] for r in rows for k in r
                   if k.startswith("laconic/length_ratio/class_")}, key=lambda x: float(x.split("-")[0]))
    for name in keys:
        a, b = avg(first, f"laconic/length_ratio/class_{name}"), avg(last, f"laconic/length_ratio/class_{name}")
        out.append(f"| {label} | budget class {name}: mean L / B | {a:.3f} -> {b:.3f} | 1 (within 10%) | lambda "
                   f"{rows[-1][f'laconic/lambda/class_{name}']:.3f} | {'yes' if abs(b - 1) <= 0.1 else 'no'} | "
                   f"{reward} |")
    if lc.reasoning_marker is not None:
        a, b = avg(first, "laconic/reasoning_length_mean"), avg(last, "laconic/reasoning_length_mean")
        out.append(f"| {label} | reasoning span before {lc.reasoning_marker!r}: mean L | {a:.1f} -> {b:.1f} | "
                   f"B = {lc.budget:g} (within 10%) | lambda {rows[-1]['lambda']:.3f} | "
                   f"{'yes' if abs(b / lc.budget - 1) <= 0.1 else 'no'} | {reward} |")
    if lc.tail_budget is not None and not lc.per_prompt_budget:
        a, b = mean(first, "mean_response_length"), mean(last, "mean_response_length")
        out.append(f"| {label} | mean L (beside the tail) | {a:.1f} -> {b:.1f} | <= B = {lc.budget:g} | lambda "
                   f"{rows[-1]['lambda']:.3f} | {'yes' if b <= 1.1 * lc.budget else 'no'} | {reward} |")
    return out


def constraint_block(results: Path, made: dict) -> str:
    from laconic_nemo.config import load_config

    lines = [C_BEGIN, "", "| run | constraint | measured, first tenth -> last tenth | bound | multiplier at the last "
             "step | held (last tenth) | task reward, first -> last tenth |", "| --- | --- | --- | --- | --- | --- | --- |"]
    skipped = []
    for name, recipe, over, label in CONSTRAINT_ROWS:
        why = loads(recipe, over)
        if why is not None:
            skipped.append(f"{label}: not run here ({why})")
            continue
        lines += constraint_rows(label, rows_of(results / name), load_config(str(ROOT / recipe), over))
    lines += [""] + [f"{x}." for x in skipped] + ([""] if skipped else []) + [
        f"Measured {made['date']} by `PYTHONPATH=. python benchmarks/tiny_runs.py --constraints --write` (seed "
        f"{SEED}; {made_with(made)}).", "", C_END]
    return "\n".join(lines)


def readme_block(text: str, begin: str = BEGIN, end: str = END, name: str = "README.md") -> tuple[int, int]:
    a, b = text.find(begin), text.find(end)
    if a < 0 or b < a:
        raise SystemExit(f"[tiny-runs] {name} has no block between {begin!r} and {end!r}")
    return a, b + len(end)


def undated(text: str) -> str:
    """``text`` without the date of its "Measured YYYY-MM-DD" line: the day a results folder was made is not a
    function of its runs, so ``--check`` on a fresh clone (whose folder is made today) compares the rest."""
    import re

    return re.sub(r"Measured \d{4}-\d{2}-\d{2}", "Measured <date>", text)


def update_readme(text: str, begin: str, end: str, args, block: str, source: str, figure: str | None = None,
                  draw=None, tell=say, doc: str = "README.md") -> int:
    """The block between ``begin`` and ``end`` of ``doc`` (a markdown file under the repository, default README.md):
    with ``--write`` replaced by ``text`` (and ``draw()`` writes ``figure``, a path under the repository), with
    ``--check`` compared with it but for the date of its "Measured" line (1 when it differs); ``block`` and
    ``source`` name the block and what made it in the messages given to ``tell``. Returns the exit status."""
    readme = ROOT / doc
    current = readme.read_text()
    a, b = readme_block(current, begin, end, doc)
    if args.write:
        readme.write_text(current[:a] + text + current[b:])
        if figure is not None:
            draw()
        tell(f"wrote {doc}" + ("" if figure is None else f" and {figure}"))
    elif args.check:
        if undated(current[a:b]) != undated(text):
            tell(f"{doc}'s {block} differs from {source} (above); --write replaces it")
            return 1
        tell(f"{doc}'s {block} is what {source} give")
    return 0


def plot(results: Path, png: Path) -> None:
    from laconic_nemo.app.plots import plot_training_curves

    plot_training_curves(results / "tiny_cpu" / "metrics.jsonl", png, title="tiny_cpu: shaper laconic, B=31")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=None, help="folder of the runs (default results/tiny_runs, with "
                    "--constraints results/constraint_runs)")
    ap.add_argument("--constraints", action="store_true", help="the constraints-beyond-the-mean runs and table")
    ap.add_argument("--seeds", default="7,8,9", help="seeds of tiny_cpu.yaml for the spread line (7 included)")
    ap.add_argument("--fresh", action="store_true", help="remove RESULTS first")
    ap.add_argument("--no-train", action="store_true", help="fail instead of training a missing run")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the block into README.md and the curves PNG")
    mode.add_argument("--check", action="store_true", help="exit 1 when README.md's block differs")
    args = ap.parse_args(argv)
    from laconic_nemo.runtime.cpu_isa import pin_cpu_isa

    pin_cpu_isa()  # as the ranks' launcher pins them (CPU runs): the manifest and the block name it
    seeds = sorted({int(s) for s in args.seeds.split(",")} | {SEED})
    results = Path(args.results or ("results/constraint_runs" if args.constraints else "results/tiny_runs")).resolve()
    made = open_results(results, args.fresh)
    if args.constraints:
        jobs = [(name, recipe, over) for name, recipe, over, _ in CONSTRAINT_ROWS if loads(recipe, over) is None]
    else:
        jobs = [(name, recipe, over) for name, recipe, over, _ in ROWS]
        jobs += [(f"tiny_cpu_seed{s}", "recipes/tiny_cpu.yaml", [f"run.seed={s}"]) for s in seeds if s != SEED]
    for k, (name, recipe, over) in enumerate(jobs, 1):
        if args.no_train and not run_complete(results / name, num_steps(recipe, over)):
            raise SystemExit(f"[tiny-runs] {name} is not complete in {results} (--no-train)")
        train(name, recipe, over, results, k, len(jobs))
    text = constraint_block(results, made) if args.constraints else block(results, made, seeds)
    print(text)
    if args.constraints:
        return update_readme(text, C_BEGIN, C_END, args, "tiny-run block", "these runs")
    return update_readme(text, BEGIN, END, args, "tiny-run block", "these runs", "docs/tiny_cpu_curves.png",
                         lambda: plot(results, ROOT / "docs" / "tiny_cpu_curves.png"))


if __name__ == "__main__":
    sys.exit(main())
