"""Integral vs pid lambda controller on the main job: measured response beside the simulator's prediction.

Compares two runs' metrics.jsonl (default: results/tiny_cpu and results/tiny_cpu_pid) on the settling step
(the trailing 3-step mean of the length stays within +-5% of B from there on), the first step at or below B,
the undershoot below B, the final error and the task reward over the last tenth, and the final lambda. Beside
each, the prediction of `laconic-nemo simulate`'s model fitted to the integral run, simulated with that
run's recipe settings (noise-free and the median over noisy runs).

    PYTHONPATH=. python benchmarks/dual_controllers.py                      # compare existing runs
    PYTHONPATH=. python benchmarks/dual_controllers.py --train              # train both recipes first (~16 min, 2 cores)
    PYTHONPATH=. python benchmarks/dual_controllers.py --integral A/metrics.jsonl --pid B/metrics.jsonl
    PYTHONPATH=. python benchmarks/dual_controllers.py --scale inf --sigma 1.04   # the model tiny_cpu_pid was tuned on
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
from laconic_nemo.simulate import SCALES, fit_length_model, read_trajectory, response_metrics, simulate


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


def predicted(model, recipe: str, steps: int, seeds: int) -> dict:
    lc = load_config(recipe).laconic
    ceiling = None if lc.ceiling is None else float(lc.ceiling)

    def dual():
        return DualController(float(lc.budget), float(lc.eta), ceiling=ceiling, init=float(lc.lambda_init),
                              floor=float(lc.floor), controller=str(lc.controller), kp=float(lc.kp), kd=float(lc.kd),
                              max_length=int(load_config(recipe).rollout.max_new_tokens) if ceiling is None else None)

    det = response_metrics(simulate(model, dual(), steps, seed=None)[1], float(lc.budget))
    noisy = [response_metrics(simulate(model, dual(), steps, seed=s)[1], float(lc.budget)) for s in range(seeds)]
    settle = [r["settling_step"] if r["settling_step"] is not None else math.inf for r in noisy]
    return {"settling_step": det["settling_step"], "settling_median": float(np.median(settle)) if noisy else None,
            "undershoot": det["undershoot"], "final_error": det["final_error"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--integral", default="results/tiny_cpu/metrics.jsonl")
    ap.add_argument("--pid", default="results/tiny_cpu_pid/metrics.jsonl")
    ap.add_argument("--integral-recipe", default="tiny_cpu")
    ap.add_argument("--pid-recipe", default="tiny_cpu_pid")
    ap.add_argument("--train", action="store_true", help="run `laconic-nemo train` on both recipes first")
    ap.add_argument("--scale", default=None, help="fit the model with these scales only (e.g. inf)")
    ap.add_argument("--sigma", type=float, default=None, help="measurement noise instead of the fitted one")
    ap.add_argument("--seeds", type=int, default=40)
    args = ap.parse_args(argv)
    if args.train:
        for recipe in (args.integral_recipe, args.pid_recipe):
            subprocess.run([sys.executable, "-m", "laconic_nemo.cli", "train", recipe], check=True)
    lam, length, _ = read_trajectory(args.integral)
    scales = SCALES if args.scale is None else [float(x) for x in args.scale.split(",")]
    model = fit_length_model(lam, length, scales=scales)
    if args.sigma is not None:
        model.sigma = float(args.sigma)
    print(f"model fitted to {args.integral}: tau {model.tau:.2f}, a {model.a:.1f}, b {model.b:.1f}, "
          f"scale {model.scale:g}, delay {model.delay}, sigma {model.sigma:.2f}")
    head = (f"{'run':<14} {'settle':>7} {'pred.':>6} {'pred. med':>9} {'first<=B':>8} {'undershoot':>10} "
            f"{'pred.':>6} {'final err':>9} {'pred.':>7} {'reward(last 10%)':>16} {'lambda end':>10}")
    print(head)
    for name, path, recipe in (("integral", args.integral, args.integral_recipe), ("pid", args.pid, args.pid_recipe)):
        p = predicted(model, recipe, len(length), args.seeds)
        if not Path(path).is_file():
            m = {k: None for k in ("settling_step", "first_at_budget", "undershoot", "final_error",
                                   "task_reward_last_tenth", "final_lambda")}
        else:
            m = measured(path)

        def pct(v):
            return "-" if v is None else f"{100 * v:+.1f}%"

        print(f"{name:<14} {str(m['settling_step']):>7} {str(p['settling_step']):>6} {p['settling_median']:>9g} "
              f"{str(m['first_at_budget']):>8} {pct(m['undershoot']):>10} {pct(p['undershoot']):>6} "
              f"{pct(m['final_error']):>9} {pct(p['final_error']):>7} "
              f"{'-' if m['task_reward_last_tenth'] is None else format(m['task_reward_last_tenth'], '.3f'):>16} "
              f"{'-' if m['final_lambda'] is None else format(m['final_lambda'], '.3f'):>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
