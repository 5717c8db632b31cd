"""Per-step overhead of the LACONIC core on a rollout batch (default 128 prompts x G=16 responses).

Times one GRPO step's worth of core work, shaping + group advantages + dual update, for each shaper,
and compares it with plain GRPO (task reward unchanged + group advantages) measured in the same run.

    PYTHONPATH=. python benchmarks/core_overhead.py [--prompts 128] [--group-size 16] [--repeats 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from laconic_nemo.core import SHAPERS, DualController, Shaper, group_advantages, next_lambda


def make_batch(prompts: int, group_size: int, max_length: int, seed: int = 0):
    """rewards, lengths, truncation flags and targets, each [prompts, group_size]."""
    g = torch.Generator().manual_seed(seed)
    shape = (prompts, group_size)
    rewards = (torch.rand(shape, generator=g) < 0.6).float()
    lengths = torch.randint(1, max_length + 1, shape, generator=g)
    lengths[torch.rand(shape, generator=g) < 0.1] = max_length
    truncated = lengths >= max_length
    targets = torch.randint(256, 3072, shape, generator=g)
    return rewards, lengths, truncated, targets


def time_step(shaper, dual, batch, repeats: int, warmup: int = 50) -> list[float]:
    rewards, lengths, truncated, targets = batch
    samples = []
    lam = 0.01
    for i in range(warmup + repeats):
        t0 = time.perf_counter_ns()
        shaped, metrics = shaper(rewards, lengths, truncated, lam, targets=targets)
        adv = group_advantages(shaped)
        lam = next_lambda(dual, lam, metrics["mean_length"])
        t1 = time.perf_counter_ns()
        if i >= warmup:
            samples.append((t1 - t0) / 1e3)
    assert adv.shape == rewards.shape
    return samples


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=4096)
    p.add_argument("--budget", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batch = make_batch(args.prompts, args.group_size, args.max_length)
    results = {}

    def run(name):
        dual = DualController(args.budget, 0.002, max_length=args.max_length, init=0.01) \
            if SHAPERS[name].lam == "dual" else None
        return time_step(Shaper(name, budget=args.budget, max_length=args.max_length), dual, batch, args.repeats)

    # baseline first and last, so drift over the run shows up
    order = ["grpo"] + [n for n in SHAPERS if n != "grpo"]
    for name in order:
        results[name] = run(name)
    base_again = run("grpo")
    base_med = statistics.median(results["grpo"])
    n = args.prompts * args.group_size
    print(f"core overhead per step, {args.prompts} prompts x G={args.group_size} = {n} responses, "
          f"{args.repeats} repeats, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"{'shaper':<10} {'median us':>10} {'p90 us':>10} {'x grpo':>8}")
    for name in order:
        xs = results[name]
        med = statistics.median(xs)
        print(f"{name:<10} {med:>10.1f} {percentile(xs, 0.9):>10.1f} {med / base_med:>8.2f}")
    print(f"{'grpo (end)':<10} {statistics.median(base_again):>10.1f} {percentile(base_again, 0.9):>10.1f} "
          f"{statistics.median(base_again) / base_med:>8.2f}")


if __name__ == "__main__":
    main()
