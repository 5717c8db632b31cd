"""Throughput of the math reward: single process vs the worker pool on a realistic GRPO batch.

A batch is 128 prompts x 16 samples = 2048 responses built from the benchmark answers in
<repo>/../shared/data/benchmarks: about 45% give the reference in the dataset's own form (or an equivalent
number form), 35% a wrong answer (another problem's answer, or the value plus one), 20% no complete box
(no box at all, or truncated inside it). Each response carries 1-6k characters of reasoning text before
``</think>``. Every batch uses different prompts.

The same batches are scored twice in one run: with the machine as it is ("idle": no load added), then with
every core saturated by ``--saturate`` busy-looping processes per core. The per-item limit is CPU time, so the
timeout count (and every score) must be the same in both phases.

    PYTHONPATH=$PWD python benchmarks/reward_throughput.py --batches 3 --workers 0,2 --saturate 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from laconic_nemo.rewards import MathReward, normalize_reference

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ("aime2024", "amc", "math500", "minerva", "olympiad_bench")
FILLER = (
    "We expand the expression and collect terms: $(a+b)^2 = a^2 + 2ab + b^2$, so with $a = 3$ and $b = 4$ we "
    "get $49$. Checking the boundary case $x = 0$ gives $f(0) = 1$, consistent with \\frac{1}{1}. "
)


def load_rows(data_dir: Path) -> list:
    rows = []
    for name in BENCHMARKS:
        rows.extend(json.loads((data_dir / "benchmarks" / f"{name}.json").read_text()))
    return rows


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def make_response(rng: random.Random, answer, other_answer) -> str:
    raw = [str(a) for a in answer] if isinstance(answer, list) else [str(answer)]
    gold = normalize_reference(answer)[0]
    u = rng.random()
    if u < 0.45:
        final = rng.choice(raw)
        value = _as_number(gold)
        if value is not None and rng.random() < 0.3:
            final = f"{value:.1f}" if value.is_integer() else repr(value)
        tail = f"The final answer is $\\boxed{{{final}}}$."
    elif u < 0.80:
        value = _as_number(gold)
        if value is not None and rng.random() < 0.5:
            final = repr(value + 1)
        else:
            final = str(other_answer[0] if isinstance(other_answer, list) else other_answer)
        tail = f"Therefore the answer is \\boxed{{{final}}}."
    elif u < 0.9:
        tail = "I am not sure how to finish this."
    else:
        tail = f"The final answer is \\boxed{{{raw[0][: max(1, len(raw[0]) // 2)]}"  # truncated
    reasoning = FILLER * rng.randint(5, 30)
    return f"{reasoning}\n</think>\n{tail}"


def make_batches(rows: list, num_batches: int, prompts: int, group: int, seed: int):
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    batches = []
    for b in range(num_batches):
        responses, answers = [], []
        for p in range(prompts):
            idx = order[(b * prompts + p) % len(order)]
            other = rows[order[(b * prompts + p + 1) % len(order)]]["answer"]
            for _ in range(group):
                responses.append(make_response(rng, rows[idx]["answer"], other))
                answers.append(rows[idx]["answer"])
        batches.append((responses, answers))
    return batches


def _proc_cpu_s(pid: int) -> float:
    """user + system CPU seconds of a live process (Linux /proc), nan elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def _cpu_s(reward: MathReward) -> float:
    return _proc_cpu_s(os.getpid()) + sum(_proc_cpu_s(pid) for pid in reward.worker_pids)


def run_modes(worker_counts: list[int], batches, timeout_s: float) -> list[dict]:
    """Score every batch with every mode, interleaved batch by batch so that load from other processes on a
    shared machine hits all modes alike. Pools are started and every mode is warmed up before timing."""
    import sympy

    import laconic_nemo.rewards._preload  # noqa: F401 - the same warm-up the pool's forkserver does
    from laconic_nemo.rewards.grader import _parse

    _parse.cache_clear()  # every phase starts from the same cold caches (fresh pool workers do too)
    sympy.core.cache.clear_cache()

    rewards = [MathReward(num_workers=w, timeout_s=timeout_s) for w in worker_counts]
    stats = [{"times": [], "cpu": [], "graded": [], "unique": [], "max_item": 0.0, "max_item_cpu": 0.0,
              "timeouts": 0, "wall_timeouts": 0, "acc": [], "scores": []} for _ in rewards]
    try:
        for reward in rewards:
            if reward.num_workers:
                reward.start()  # pool start-up is paid once per training run, not per step
        for responses, answers in batches:
            for reward, st in zip(rewards, stats):
                cpu0 = _cpu_s(reward)
                res = reward.score(responses, answers)
                st["cpu"].append(_cpu_s(reward) - cpu0)
                st["times"].append(res.metrics["seconds"])
                st["graded"].append(res.metrics["graded"])
                st["unique"].append(res.metrics["unique_graded"])
                st["max_item"] = max(st["max_item"], res.metrics["max_item_seconds"])
                st["max_item_cpu"] = max(st["max_item_cpu"], res.metrics.get("max_item_cpu_seconds", math.nan))
                st["timeouts"] += int(res.metrics["timeouts"])
                st["wall_timeouts"] += int(res.metrics.get("wall_timeouts", 0))
                st["acc"].append(res.metrics["accuracy"])
                st["scores"].extend(res.scores)
    finally:
        for reward in rewards:
            reward.close()
    n = len(batches[0][0])
    out = []
    for w, st in zip(worker_counts, stats):
        times = st["times"]
        out.append({
            "workers": w,
            "responses_per_s": n * len(times) / sum(times),
            "graded_per_s": sum(st["graded"]) / sum(times),
            "unique_per_batch": statistics.mean(st["unique"]),
            "mean_batch_s": statistics.mean(times),
            "cpu_batch_s": statistics.mean(st["cpu"]),
            "max_batch_s": max(times),
            # worst case if every distinct answer ran into the hard timeout
            "batch_bound_s": math.ceil(max(st["unique"]) / max(1, w)) * timeout_s,
            "max_item_s": st["max_item"],
            "max_item_cpu_s": st["max_item_cpu"],
            "timeouts": st["timeouts"],
            "wall_timeouts": st["wall_timeouts"],
            "accuracy": statistics.mean(st["acc"]),
            "scores": st["scores"],
        })
    return out


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def start_hogs(count: int) -> list[subprocess.Popen]:
    """``count`` busy-looping processes (other load on the node)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("LACONIC_NEMO_DATA",
                                                                         REPO_ROOT.parent / "shared" / "data")))
    parser.add_argument("--batches", type=int, default=3, help="batches per mode (different prompts each)")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--group", type=int, default=16, help="samples per prompt (G)")
    parser.add_argument("--workers", default="0,2", help="comma-separated worker counts; 0 = single process")
    parser.add_argument("--timeout", type=float, default=5.0, help="per-item timeout_s (CPU seconds)")
    parser.add_argument("--saturate", type=int, default=2,
                        help="busy processes per core in the second phase (0: idle phase only)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (args.data / "benchmarks").is_dir():
        print(f"benchmark data not found under {args.data}", file=sys.stderr)
        return 2
    batches = make_batches(load_rows(args.data), args.batches, args.prompts, args.group, args.seed)
    modes = [int(w) for w in args.workers.split(",")]
    hog_count = args.saturate * _cores()
    print(f"batch: {args.prompts} prompts x {args.group} samples = {len(batches[0][0])} responses, "
          f"{args.batches} batches per mode, timeout_s={args.timeout} (CPU), cpus={_cores()}, "
          f"load avg {os.getloadavg()[0]:.2f}")
    phases = [("idle", 0)] + ([(f"saturated ({hog_count} busy processes)", hog_count)] if hog_count else [])
    table = []
    for phase, hogs_n in phases:
        hogs = start_hogs(hogs_n)
        try:
            t = time.perf_counter()
            results = run_modes(modes, batches, args.timeout)
            load = os.getloadavg()[0]
        finally:
            stop_hogs(hogs)
        print(f"  {phase}: done in {time.perf_counter() - t:.1f} s, load avg {load:.2f}", flush=True)
        table.append((phase, load, results))
    print()
    print("| phase | workers | responses/s | ratio | distinct answers/batch | mean batch s | CPU s/batch "
          "| max batch s | max item s (wall) | max item CPU s (limit) | timeouts | of which wall backstop "
          "| accuracy | load avg |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for phase, load, results in table:
        base = results[0]["responses_per_s"]
        for r in results:
            print(f"| {phase} | {r['workers']} | {r['responses_per_s']:.0f} | {r['responses_per_s'] / base:.2f}x | "
                  f"{r['unique_per_batch']:.0f} | {r['mean_batch_s']:.2f} | {r['cpu_batch_s']:.2f} | "
                  f"{r['max_batch_s']:.2f} | {r['max_item_s']:.3f} | {r['max_item_cpu_s']:.3f} ({args.timeout}) | "
                  f"{r['timeouts']} | {r['wall_timeouts']} | {r['accuracy']:.4f} | {load:.1f} |")
    print(f"\nload avg after: {os.getloadavg()[0]:.2f}")
    if len(table) == 2:
        same = all(a["scores"] == b["scores"] for a, b in zip(table[0][2], table[1][2]))
        print(f"every score identical idle vs saturated: {same}")
    single = next((r for r in table[0][2] if r["workers"] == 0), None)
    if single is not None:
        for r in table[0][2]:
            if r["workers"]:
                # what the pool would reach with its cores to itself: CPU work per batch, split over the workers
                ideal = single["cpu_batch_s"] / (r["cpu_batch_s"] / r["workers"])
                print(f"workers={r['workers']}: CPU per batch {r['cpu_batch_s']:.2f} s vs {single['cpu_batch_s']:.2f} s "
                      f"single -> speed-up bound with {r['workers']} idle cores: {ideal:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
