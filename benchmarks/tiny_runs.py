"""The README's main-job table, its curves (docs/tiny_cpu_curves.png): the tiny runs over a grid of seeds and CPU
kernel settings that stand for machines.

    PYTHONPATH=. python benchmarks/tiny_runs.py            # train what is missing (~2 h on 2 cores), print the block
    PYTHONPATH=. python benchmarks/tiny_runs.py --write    # ... and write it into README.md and the PNG into docs/
    PYTHONPATH=. python benchmarks/tiny_runs.py --check    # ... and exit 1 when a run here leaves the README's band
    PYTHONPATH=. python benchmarks/tiny_runs.py --seeds 7 --settings native --check   # one cell: the main job here
    PYTHONPATH=. python benchmarks/tiny_runs.py --constraints --write   # the constraints-beyond-the-mean table

The grid: every recipe of :data:`GRID` (LACONIC with the integral controller, the main job; plain GRPO; LACONIC with
the pid controller) for every seed of ``--seeds`` (each its own warm-up, prompts and samples) under every CPU kernel
setting of ``--settings`` (:data:`SETTINGS`: this machine's own kernels, ATen's AVX2 build, the pin), into
``RESULTS/<setting>/<run>_s<seed>``, with the warm-up cache ``RESULTS/warmup_cache`` (its key names the seed and
the kernels: one warm-up per cell, shared by the cell's three runs). A setting changes the floats of every kernel
it reaches, and 70 steps of sampling turn a last-bit difference into another trajectory (docs/megatron_cpu.md), so
a cell stands for a machine: the table reports each number as the median and the range over the cells, and the
claims of :data:`CLAIMS` (the band) are what must hold on every cell, on every machine. ``--check`` trains what is
missing here and exits 1 when a cell leaves the band (the claims), printing where; it does not compare the
medians, which are this machine's.

With ``--constraints`` the runs are the tiny recipes of the constraints beyond the mean (``CONSTRAINT_ROWS``, into
``results/constraint_runs``), and the block is the ``<!-- constraint-runs:begin ... -->`` table of
docs/constraints.md: per constraint, its measured value over the first and the last tenth of the steps, its bound,
its multiplier at the last step and whether the last tenth is within the bound (the tail share at most q; each
budget class's mean L / B, and the reasoning span's mean / B, within 10% of 1). A recipe that does not load here
(the reasoning-only one needs the task's marker, data.synthetic.reasoning_marker) is listed as not run, with the
reason.

Idempotent and resumable: a finished run (its checkpoint at run.num_steps) is not run again, an interrupted one
continues from its checkpoint (bit for bit as if uninterrupted), and the warm-up cache is reused. The results
folder records what made it (``manifest.json``: a digest of the package's code and recipes, the torch /
megatron-core versions, the threads per rank, the machine); a rerun with other code, versions or on another
machine refuses to mix its runs with those (``--fresh`` starts the folder over).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- tiny-runs:begin: written by benchmarks/tiny_runs.py, do not edit by hand -->"
END = "<!-- tiny-runs:end -->"
SEED = 7  # the main job's seed (recipes/tiny_cpu.yaml run.seed)
SEEDS = (7, 8, 9)
# the main job's recipes over the grid: (run name, recipe, overrides, label)
GRID = [
    ("laconic", "recipes/tiny_cpu.yaml", [], "LACONIC, integral dual step (`tiny_cpu.yaml`, the main job)"),
    ("grpo", "recipes/tiny_cpu_grpo.yaml", [], "GRPO, lambda = 0 (`tiny_cpu_grpo.yaml`)"),
    ("pid", "recipes/tiny_cpu_pid.yaml", [], "LACONIC, pid dual step (`tiny_cpu_pid.yaml`)"),
]
# kernel settings that stand for machines: name -> (what it stands for, the ranks' environment)
SETTINGS = {
    "native": ("this machine's own kernels (the default)", {"LACONIC_CPU_ISA": "native"}),
    "aten_avx2": ("ATen's AVX2 build (an AVX2 machine's ATen), MKL and oneDNN this machine's",
                  {"LACONIC_CPU_ISA": "native", "ATEN_CPU_CAPABILITY": "avx2"}),
    "pin": ("the pin: ATen AVX2, MKL's COMPATIBLE branch (the generic code MKL runs on AMD processors), oneDNN AVX2",
            {"LACONIC_CPU_ISA": "avx2"}),
}
LIB_VARS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "LACONIC_CPU_ISA")
# the band: what every cell of the grid must show, on every machine (--check)
CLAIMS = {
    "length_tol": 0.05,      # LACONIC's mean length over the last tenth within +-5% of B
    "reward_min": 0.70,      # ... its task reward over the last tenth at least 0.70 (the warm-up policy's ~0.55
                             # over the first tenth; measured 0.72-0.82 over seeds 7-9 at B = 34)
    "reward_vs_grpo_se": 2.0,  # ... and at least GRPO's in the same cell (same warm-up, prompts), up to 2 standard
                               # errors of the difference of the two last-tenth means (each from its run's
                               # step-to-step spread: ~0.015-0.025 here); 0: strictly at least GRPO's
}


C_BEGIN = "<!-- constraint-runs:begin: written by benchmarks/tiny_runs.py --constraints, do not edit by hand -->"
C_END = "<!-- constraint-runs:end -->"
CONSTRAINT_DOC = "docs/constraints.md"  # the file whose block --constraints writes
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


def made_with(made: dict, kernels: bool = True) -> str:
    """The versions, threads and (``kernels``) CPU kernels of a block's last line."""
    from laconic_nemo.runtime.cpu_isa import describe

    v = made["versions"]
    return (f"torch {v['torch']}, megatron-core {v['megatron-core']}, Python {v['python']}, "
            f"{made['threads_per_rank']} thread per rank" + (f", CPU kernels {describe(made['cpu_isa'])}" if kernels
                                                              else ""))


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


def train(name: str, recipe: str, overrides: list[str], results: Path, k: int, n: int,
          env_extra: dict | None = None) -> None:
    """``laconic-nemo train`` of one run (resumed when it was interrupted) into ``RESULTS/<name>``; its whole output
    goes to ``RESULTS/<name>.log``, the warm-up and step lines (with their ETA) to the terminal. ``env_extra``: the
    CPU kernel setting of the run (the library variables of this environment are dropped first)."""
    out = results / name
    steps = num_steps(recipe, overrides)
    if run_complete(out, steps):
        say(f"[{k}/{n}] {name}: complete ({steps} steps), kept")
        return
    cmd = [sys.executable, "-m", "laconic_nemo", "train", str(ROOT / recipe), *overrides, f"run.output_dir={out}",
           f"warmup.cache_dir={results / 'warmup_cache'}", "logging.plot=false"]
    say(f"[{k}/{n}] {name}: " + ("resuming" if out.exists() else "training") + " $ " + " ".join(cmd[2:]))
    t0 = time.time()
    env = {k: v for k, v in os.environ.items() if env_extra is None or k not in LIB_VARS}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env_extra or {}))
    (results / name).parent.mkdir(parents=True, exist_ok=True)
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


def run_ceiling(run_dir: Path) -> float | None:
    """The run's Lambda as its controller used it (config.yaml; null -> B / (L_max - B))."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / "config.yaml")
    lc = cfg.laconic
    if lc.shaper not in ("laconic", "linear"):
        return None
    return float(lc.ceiling) if lc.ceiling is not None else float(lc.budget) / (cfg.rollout.max_new_tokens - lc.budget)


def cell_summary(run_dir: Path) -> dict:
    """One run's numbers: mean length and task reward over the first and the last tenth of its steps, the standard
    error of the last tenth's mean reward (sample standard deviation of its steps' rewards / sqrt(steps)), the last
    tenth's length relative to B, lambda at the end and the steps it spent at the ceiling, and the settling step
    (the trailing 3-step mean length stays within +-5% of B from that step on; None: not within the run)."""
    from laconic_nemo.tools.simulate import response_metrics

    rows = rows_of(run_dir)
    n = tenth(rows)
    first, last = rows[:n], rows[-n:]
    last_rewards = [float(r["task_reward"]) for r in last]
    budget = float(rows[0]["budget"])
    ceiling = run_ceiling(run_dir)
    length = mean(last, "mean_response_length")
    measures = response_metrics([r["mean_response_length"] for r in rows], budget, tol=CLAIMS["length_tol"])
    return {"steps": len(rows), "budget": budget, "length0": mean(first, "mean_response_length"), "length": length,
            "rel": length / budget - 1.0, "reward0": mean(first, "task_reward"), "reward": sum(last_rewards) / n,
            "reward_se": statistics.stdev(last_rewards) / math.sqrt(n) if n > 1 else 0.0,
            "lambda_end": float(rows[-1]["lambda_next"]), "settling": measures["settling_step"],
            "at_ceiling": sum(1 for r in rows if ceiling is not None and r["lambda_next"] >= ceiling)}


def band(values: list[float], fmt: str) -> str:
    """``median (min-max)`` of ``values``."""
    v = sorted(values)
    mid = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    return f"{format(mid, fmt)} ({format(v[0], fmt)} to {format(v[-1], fmt)})"


def settling_text(cells: list[dict]) -> str:
    steps = [c["settling"] for c in cells if c["settling"] is not None]
    never = len(cells) - len(steps)
    text = band(steps, ".0f") if steps else "-"
    return text + (f"; not within the run: {never} of {len(cells)}" if never else "")


def holds(cell: dict, grpo: dict | None) -> list[str]:
    """The claims a LACONIC cell breaks (empty: it holds the band)."""
    out = []
    if abs(cell["rel"]) > CLAIMS["length_tol"]:
        out.append(f"last tenth {100 * cell['rel']:+.1f}% of B (band +-{100 * CLAIMS['length_tol']:.0f}%)")
    if cell["reward"] < CLAIMS["reward_min"]:
        out.append(f"task reward {cell['reward']:.3f} < {CLAIMS['reward_min']}")
    if grpo is not None:
        k = CLAIMS["reward_vs_grpo_se"]
        margin = k * math.hypot(cell["reward_se"], grpo["reward_se"])
        if cell["reward"] < grpo["reward"] - margin:
            out.append(f"task reward {cell['reward']:.3f} below GRPO's {grpo['reward']:.3f}"
                       + (f" by {grpo['reward'] - cell['reward']:.3f}, more than {k:g} standard errors ({margin:.3f})"
                          if k else ""))
    return out


def present(run_dir: Path) -> bool:
    """A run of the grid that has ended: its metrics hold the steps its config asked for (a run still training, or
    never started, is left out of the block and the check)."""
    from omegaconf import OmegaConf

    if not (run_dir / "metrics.jsonl").is_file():
        return False
    rows = rows_of(run_dir)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    steps = OmegaConf.select(cfg, "run.num_steps")
    return bool(rows) and (steps is None or int(rows[-1]["step"]) >= int(steps))


def grid_cells(results: Path, seeds: list[int], settings: list[str]) -> dict[tuple[str, str, int], dict]:
    """(run, setting, seed) -> :func:`cell_summary` of every run of the grid that has ended (:func:`present`)."""
    return {(name, st, seed): cell_summary(results / st / f"{name}_s{seed}") for st in settings for seed in seeds
            for name, _recipe, _over, _label in GRID if present(results / st / f"{name}_s{seed}")}


def block(results: Path, made: dict, seeds: list[int], settings: list[str]) -> str:
    """The README's block: per run of :data:`GRID` the median (min to max) over the cells it ran in, per cell its
    numbers and whether LACONIC holds the band (:data:`CLAIMS`); a run not run in a cell says so."""
    cells = grid_cells(results, seeds, settings)
    keys = [(st, seed) for st in settings for seed in seeds]
    lac_keys = [k for k in keys if ("laconic", *k) in cells]
    if not lac_keys:
        raise SystemExit(f"[tiny-runs] no LACONIC run of the grid has ended in {results}")
    first = cells[("laconic", *lac_keys[0])]
    B, steps = first["budget"], first["steps"]
    tol = 100 * CLAIMS["length_tol"]
    lines = [BEGIN, "", f"Over {len(keys)} cells ({len(seeds)} seeds x {len(settings)} CPU kernel settings), {steps} "
             f"steps each, B = {B:g}; each number is the median (min to max) over the cells a run ran in:", "",
             "| run | cells | mean length, first tenth -> last tenth | last tenth vs B | task reward, first tenth -> "
             "last tenth | lambda at the end | settling step (within +-5% of B from then on) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, _recipe, _over, label in GRID:
        cs = [cells[(name, st, seed)] for st, seed in keys if (name, st, seed) in cells]
        if not cs:
            lines.append(f"| {label} | 0 of {len(keys)} | not run | | | | |")
            continue
        lam = band([c["lambda_end"] for c in cs], ".3f") if name != "grpo" else "0"
        if name != "grpo" and any(c["at_ceiling"] for c in cs):
            lam += f"; at the ceiling in {sum(1 for c in cs if c['at_ceiling'])} cells"
        lines.append(f"| {label} | {len(cs)} of {len(keys)} | {band([c['length0'] for c in cs], '.1f')} -> "
                     f"{band([c['length'] for c in cs], '.1f')} | {band([100 * c['rel'] for c in cs], '+.1f')}% | "
                     f"{band([c['reward0'] for c in cs], '.3f')} -> {band([c['reward'] for c in cs], '.3f')} | {lam} | "
                     f"{settling_text(cs) if name != 'grpo' else '-'} |")
    lines += ["", "Per cell (last tenth: mean length, its distance to B, task reward +- its standard error; the "
              "settling step):", "",
              "| seed | CPU kernels | LACONIC (integral) | GRPO | LACONIC (pid) | the band (LACONIC, integral) |",
              "| --- | --- | --- | --- | --- | --- |"]
    broken = 0
    for st, seed in keys:
        lac, grpo, pid = (cells.get((name, st, seed)) for name in ("laconic", "grpo", "pid"))
        why = holds(lac, grpo) if lac is not None else None
        broken += bool(why)

        def cell(c, settle=True):
            if c is None:
                return "not run"
            text = f"{c['length']:.1f} ({100 * c['rel']:+.1f}%), {c['reward']:.3f} +- {c['reward_se']:.3f}"
            return text + (f", settles at {c['settling']}" if settle and c["settling"] is not None else
                           (", not settled" if settle else ""))

        verdict = "-" if why is None else ("holds" if not why else "; ".join(why))
        lines.append(f"| {seed} | {st} | {cell(lac)} | {cell(grpo, False)} | {cell(pid)} | {verdict} |")
    main = [cells[("laconic", st, SEED)] for st in settings if ("laconic", st, SEED) in cells]
    if main:
        lines += ["", f"The main job as the README's first command runs it is seed {SEED} (`run.seed` of "
                  f"`recipes/tiny_cpu.yaml`): over {len(main)} CPU kernel setting(s) its last tenth is "
                  f"{100 * min(c['rel'] for c in main):+.1f}% to {100 * max(c['rel'] for c in main):+.1f}% of B, its "
                  f"task reward {min(c['reward'] for c in main):.3f} to {max(c['reward'] for c in main):.3f}."]
    lines += ["", f"The band (`CLAIMS` of `benchmarks/tiny_runs.py`, what `--check` asks of every cell on any machine): "
              f"LACONIC's mean length over the last tenth within +-{tol:.0f}% of B, its task reward there at least "
              f"{CLAIMS['reward_min']:.2f} and {claim_vs_grpo()}. Here {len(lac_keys) - broken} of {len(lac_keys)} "
              "cells hold it" + (f" ({len(keys) - len(lac_keys)} not run)." if len(lac_keys) < len(keys) else "."), "",
              "CPU kernel settings (each stands for a machine; docs/megatron_cpu.md): "
              + "; ".join(f"`{st}`: {SETTINGS[st][0]}" for st in settings) + ".", "",
              f"Measured {made['date']} by `PYTHONPATH=. python benchmarks/tiny_runs.py --write` on "
              f"{made['cpu_isa'].get('cpu', made['cpu_isa']['machine'])} ({made_with(made, kernels=False)}).", "",
              END]
    return "\n".join(lines)


def claim_vs_grpo() -> str:
    """The reward claim against GRPO, in words."""
    k = CLAIMS["reward_vs_grpo_se"]
    return "at least GRPO's in the same cell" + ("" if k == 0 else f", up to {k:g} standard errors of the difference "
                                                 "of the two last-tenth means (each from its steps' spread)")


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


def plot(results: Path, png: Path, seeds: list[int], settings: list[str]) -> None:
    """Every cell's mean length (B and the band shaded), task reward and lambda along its steps: LACONIC with the
    integral dual step, GRPO and LACONIC with the pid step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"laconic": "tab:blue", "grpo": "0.6", "pid": "tab:orange"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    budget = None
    for name, _recipe, _over, label in GRID:
        ran = [(st, seed) for st in settings for seed in seeds if present(results / st / f"{name}_s{seed}")]
        for i, (st, seed) in enumerate(ran):
            rows = rows_of(results / st / f"{name}_s{seed}")
            steps = [r["step"] for r in rows]
            budget = rows[0]["budget"]
            kw = {"color": colors[name], "lw": 0.9, "alpha": 0.8, "label": label.split(" (")[0] if i == 0 else None}
            axes[0].plot(steps, [r["mean_response_length"] for r in rows], **kw)
            axes[1].plot(steps, [r["task_reward"] for r in rows], **kw)
            if name != "grpo":
                axes[2].plot(steps, [r["lambda"] for r in rows], **kw)
    tol = CLAIMS["length_tol"]
    axes[0].axhline(budget, color="k", ls="--", lw=1, label="budget B")
    axes[0].axhspan(budget * (1 - tol), budget * (1 + tol), color="k", alpha=0.08, label=f"B +-{100 * tol:.0f}%")
    for ax, title in zip(axes, ("mean response length (tokens)", "task reward (accuracy)", "lambda")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best", fontsize=7)
    fig.suptitle(f"tiny_cpu over {len(seeds)} seeds x {len(settings)} CPU kernel settings")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def check_band(results: Path, seeds: list[int], settings: list[str]) -> int:
    """1 when a LACONIC cell breaks a claim of :data:`CLAIMS` (printed), else 0; a cell whose LACONIC run has not
    ended is named and left out, and GRPO's claim is left out where GRPO did not run."""
    bad = 0
    cells = grid_cells(results, seeds, settings)
    for st in settings:
        for seed in seeds:
            lac, grpo = cells.get(("laconic", st, seed)), cells.get(("grpo", st, seed))
            if lac is None:
                say(f"seed {seed}, {st}: LACONIC has not run here")
                continue
            why = holds(lac, grpo)
            vs = f" (GRPO {grpo['reward']:.3f})" if grpo is not None else " (GRPO not run)"
            say(f"seed {seed}, {st}: last tenth {lac['length']:.1f} ({100 * lac['rel']:+.1f}% of B), task reward "
                f"{lac['reward']:.3f}{vs}: " + ("holds the band" if not why else "; ".join(why)))
            bad += bool(why)
    say("every cell holds the README's band" if not bad else f"{bad} cell(s) leave the README's band")
    return int(bad > 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=None, help="folder of the runs (default results/tiny_runs, with "
                    "--constraints results/constraint_runs)")
    ap.add_argument("--constraints", action="store_true", help="the constraints-beyond-the-mean runs and table")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="seeds of the grid (default %(default)s)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="CPU kernel settings of the grid, of "
                    f"{', '.join(SETTINGS)} (default all)")
    ap.add_argument("--runs", default=",".join(name for name, *_ in GRID), help="runs of the grid to train, of "
                    f"{', '.join(name for name, *_ in GRID)} (default all; the block reports the runs present)")
    ap.add_argument("--fresh", action="store_true", help="remove RESULTS first")
    ap.add_argument("--no-train", action="store_true", help="fail instead of training a missing run")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the block into README.md and the curves PNG")
    mode.add_argument("--check", action="store_true", help="exit 1 when a cell here leaves the README's band")
    args = ap.parse_args(argv)
    seeds = sorted({int(s) for s in args.seeds.split(",") if s.strip()})
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or any(r not in {name for name, *_ in GRID} for r in runs):
        ap.error(f"--runs: {args.runs!r} (allowed {', '.join(name for name, *_ in GRID)}, not empty)")
    bad = [s for s in settings if s not in SETTINGS]
    if bad or not seeds or not settings:
        ap.error(f"--settings: unknown {bad} (allowed {', '.join(SETTINGS)}); --seeds and --settings not empty")
    results = Path(args.results or ("results/constraint_runs" if args.constraints else "results/tiny_runs")).resolve()
    made = open_results(results, args.fresh)
    if args.constraints:
        jobs = [(name, recipe, over, None) for name, recipe, over, _ in CONSTRAINT_ROWS if loads(recipe, over) is None]
    else:
        jobs = [(f"{st}/{name}_s{seed}", recipe, [*over, f"run.seed={seed}"], SETTINGS[st][1])
                for st in settings for seed in seeds for name, recipe, over, _ in GRID if name in runs]
    for k, (name, recipe, over, env) in enumerate(jobs, 1):
        if args.no_train and not run_complete(results / name, num_steps(recipe, over)):
            raise SystemExit(f"[tiny-runs] {name} is not complete in {results} (--no-train)")
        train(name, recipe, over, results, k, len(jobs), env)
    if args.constraints:
        text = constraint_block(results, made)
        print(text)
        return update_readme(text, C_BEGIN, C_END, args, "constraint-runs block", "these runs", doc=CONSTRAINT_DOC)
    text = block(results, made, seeds, settings)
    print(text)
    if args.check:
        return check_band(results, seeds, settings)
    return update_readme(text, BEGIN, END, args, "tiny-run block", "these runs", "docs/tiny_cpu_curves.png",
                         lambda: plot(results, ROOT / "docs" / "tiny_cpu_curves.png", seeds, settings))


if __name__ == "__main__":
    sys.exit(main())
