"""Seconds per GRPO + LACONIC step of the tiny CPU run, split into phases.

Runs `laconic-nemo train recipes/tiny_cpu.yaml` for a few steps (reusing the cached warm-up) — or
reads an existing metrics.jsonl with --metrics — and prints, per phase, the mean seconds per step
and the share of the step: generation, reward, shaping + advantages (LACONIC's own bookkeeping),
log-probs of pi_old, policy update, dual step (LACONIC's all-reduce + lambda update), checkpoint.
The ratio printed last is LACONIC's bookkeeping (shaping + advantages + dual step) against the
whole step, both measured in the same run.

    python benchmarks/step_breakdown.py                  # 12 steps, skips the first 2 (warm-up of caches)
    python benchmarks/step_breakdown.py --metrics results/tiny_cpu/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ["generate", "reward", "shape_advantage", "logprobs", "policy_update", "dual_step", "checkpoint"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", type=Path, help="read this metrics.jsonl instead of running")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps to leave out")
    ap.add_argument("--recipe", default="recipes/tiny_cpu.yaml")
    args = ap.parse_args()
    path = args.metrics
    if path is None:
        out = Path(tempfile.mkdtemp(prefix="laconic_bench_"))
        cmd = [sys.executable, "-m", "laconic_nemo", "train", args.recipe, f"run.num_steps={args.steps}",
               f"run.output_dir={out}", "checkpoint.every_n_steps=0", "logging.plot=false"]
        print("running:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][args.skip:]
    if not rows:
        print("no steps to summarise", file=sys.stderr)
        return 1
    step = statistics.mean(r["step_seconds"] + r.get("time/checkpoint", 0.0) for r in rows)
    print(f"\n{len(rows)} steps, mean {step:.3f} s/step\n")
    print("| phase | s/step | share |\n| --- | ---: | ---: |")
    for ph in PHASES:
        v = statistics.mean(r.get(f"time/{ph}", 0.0) for r in rows)
        print(f"| {ph} | {v:.4f} | {100 * v / step:5.1f}% |")
    other = step - sum(statistics.mean(r.get(f"time/{ph}", 0.0) for r in rows) for ph in PHASES)
    print(f"| other (decode, metrics all-reduce) | {other:.4f} | {100 * other / step:5.1f}% |")
    laconic = statistics.mean(r["time/shape_advantage"] + r["time/dual_step"] for r in rows)
    print(f"\nLACONIC bookkeeping (shaping + advantages + dual step): {1e3 * laconic:.2f} ms/step = "
          f"{100 * laconic / step:.2f}% of the step (ratio {laconic / step:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
