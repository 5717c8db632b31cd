"""Integral vs pid lambda controller on the main job: measured response beside the simulator's prediction.

Compares two runs' metrics.jsonl (default: results/tiny_cpu and results/tiny_cpu_pid) on the settling step
(the trailing 3-step mean of the length stays within +-5% of B from there on), the first step at or below B,
the undershoot below B, the final error and the task reward over the last tenth, and the final lambda. Beside
each, the prediction of `laconic-nemo simulate`'s model fitted to the integral run, simulated with that
run's recipe settings (noise-free and the median over noisy runs).

    PYTHONPATH=. python benchmarks/dual_controllers.py                      # compare existing runs
    PYTHONPATH=. python benchmarks/dual_controllers.py --train              # train both recipes first (~16 min, 2 cores)
    PYTHONPATH=. python benchmarks/dual_controllers.py --integral RUN_DIR_A --pid RUN_DIR_B   # run dirs or metrics.jsonl
    PYTHONPATH=. python benchmarks/dual_controllers.py --pid /tmp/run --pid-set laconic.kp=2   # that run's gains

Settling is compared as such when a run never settles: "None" (measured) or "inf" (the median of noisy runs
most of which do not settle) means not within the run's steps.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

from laconic_nemo.config import load_config
from laconic_nemo.core.dual import DualController
from laconic_nemo.tools.simulate import SCALES, fit_length_model, predict, read_trajectory, response_metrics


def metrics_path(path: str | Path) -> Path:
    """A run directory's metrics.jsonl, or the file itself."""
    p = Path(path)
    return p / "metrics.jsonl" if p.is_dir() else p


def measured(path: str | Path) -> dict:
    rows = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[int(r["step"])] = r
    lam, length, budget = read_trajectory(path)
    tail = max(len(rows) // 10, 1)
    steps = sorted(rows)[-tail:]
    out = response_metrics(length, budget)
    out["task_reward_last_tenth"] = float(np.mean([float(rows[s]["task_reward"]) for s in steps]))
    out["final_lambda"] = float(rows[max(rows)].get("lambda_next", lam[-1]))
    return out


def predicted(model, recipe: str, steps: int, seeds: int, overrides=()) -> dict:
    cfg = load_config(recipe, list(overrides))
    lc = cfg.laconic
    ceiling = None if lc.ceiling is None else float(lc.ceiling)

    def dual():
        return DualController(float(lc.budget), float(lc.eta), ceiling=ceiling, init=float(lc.lambda_init),
                              floor=float(lc.floor), controller=str(lc.controller), kp=float(lc.kp), kd=float(lc.kd),
                              max_length=int(cfg.rollout.max_new_tokens) if ceiling is None else None)

    return predict(model, dual, steps, seeds=seeds)


def run_recipe(path: str | Path, recipe: str) -> str:
    """The settings a run was trained with: its run directory's config.yaml when there is one, else the recipe."""
    cfg = Path(path) / "config.yaml"
    return str(cfg) if Path(path).is_dir() and cfg.is_file() else recipe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--integral", default="results/tiny_cpu", help="run directory or its metrics.jsonl")
    ap.add_argument("--pid", default="results/tiny_cpu_pid", help="run directory or its metrics.jsonl")
    ap.add_argument("--integral-recipe", default="tiny_cpu",
                    help="settings to simulate when --integral is not a run directory with a config.yaml")
    ap.add_argument("--pid-recipe", default="tiny_cpu_pid",
                    help="settings to simulate when --pid is not a run directory with a config.yaml")
    ap.add_argument("--train", action="store_true", help="run `laconic-nemo train` on both recipes first")
    ap.add_argument("--scale", default=None, help="fit the model with these scales only (e.g. inf)")
    ap.add_argument("--sigma", type=float, default=None, help="measurement noise instead of the fitted one")
    ap.add_argument("--seeds", type=int, default=40)
    args = ap.parse_args(argv)
    if args.train:
        for recipe in (args.integral_recipe, args.pid_recipe):
            subprocess.run([sys.executable, "-m", "laconic_nemo.cli", "train", recipe], check=True)
    lam, length, _ = read_trajectory(metrics_path(args.integral))
    scales = SCALES if args.scale is None else [float(x) for x in args.scale.split(",")]
    model = fit_length_model(lam, length, scales=scales)
    if args.sigma is not None:
        model.sigma = float(args.sigma)
    print(f"model fitted to {metrics_path(args.integral)}: tau {model.tau:.2f}, a {model.a:.1f}, b {model.b:.1f}, "
          f"scale {model.scale:g}, delay {model.delay}, sigma {model.sigma:.2f}")
    print("measured (predicted noise-free, median of noisy runs)")
    print(f"{'run':<10} {'settle':>16} {'first<=B':>16} {'undershoot':>22} {'final err':>22} {'reward(last 10%)':>16} "
          f"{'lambda end':>10}")

    def pct(v, sign=""):
        return "-" if v is None else f"{100 * v:{sign}.1f}%"

    def num(v):
        return "None" if v is None else ("inf" if v == math.inf else f"{v:g}")

    for name, path, recipe in (("integral", args.integral, args.integral_recipe), ("pid", args.pid, args.pid_recipe)):
        settings = run_recipe(path, recipe)
        p = predicted(model, settings, len(length), args.seeds)
        p.setdefault("settling_step_median", None)
        if not metrics_path(path).is_file():
            m = {k: None for k in ("settling_step", "first_at_budget", "undershoot", "final_error",
                                   "task_reward_last_tenth", "final_lambda")}
        else:
            m = measured(metrics_path(path))
        med = {k: p.get(f"{k}_median") for k in ("settling_step", "first_at_budget", "undershoot", "final_error")}
        cols = [f"{num(m[k])} ({num(p[k])}, {num(med[k])})" for k in ("settling_step", "first_at_budget")]
        cols += [f"{pct(m[k], s)} ({pct(p[k], s)}, {pct(med[k], s)})" for k, s in (("undershoot", ""), ("final_error", "+"))]
        reward = "-" if m["task_reward_last_tenth"] is None else format(m["task_reward_last_tenth"], ".3f")
        lam_end = "-" if m["final_lambda"] is None else format(m["final_lambda"], ".3f")
        print(f"{name:<10} {cols[0]:>16} {cols[1]:>16} {cols[2]:>22} {cols[3]:>22} {reward:>16} {lam_end:>10}  "
              f"[{settings}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
