"""The chunked log-prob backward of both actors (``laconic_nemo.actors.megatron_logprobs.chunked_token_logprobs``):
seconds and peak memory of its backward, beside the per-chunk slicing it replaced, measured in the same run.

    PYTHONPATH=. python benchmarks/logprob_backward.py                    # CPU: [2, 512, 8192] float32, 16 chunks
    PYTHONPATH=. python benchmarks/logprob_backward.py --device cuda      # [1, 16384, 151936] bf16, 16 chunks of 1024
    PYTHONPATH=. python benchmarks/gpu_step.py --device cpu ...           # the same rows in the step benchmark

Before: every chunk a slice ``logits[:, a:a + chunk]`` under activation checkpointing; the backward of each slice
allocates a zero-filled tensor of the whole ``[b, s, V]`` logits and adds it into their gradient. After: one
gradient of the logits' size, each chunk's gradient written into it (``ChunkedLogprobs``). Both give the same
gradient, element for element (checked here on every run). Peak: the most bytes the backward holds at once beyond
what existed before it (CPU: the profiler's allocation events, ``laconic_nemo/runtime/host_memory.py``; CUDA:
``torch.cuda.max_memory_allocated``); time: the least of ``--repeats`` backward passes (without the profiler), wall
and CPU seconds (the CPU time of this process's threads, less disturbed by other processes on a shared machine).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from laconic_nemo.actors import megatron_logprobs  # noqa: E402
from laconic_nemo.runtime.host_memory import host_allocations  # noqa: E402

# (rows, positions, vocabulary, chunk): the CPU shape is 32 MiB of float32 logits in 16 chunks; the GPU one a
# packed micro-batch of the flagship recipe (16,384 tokens, Qwen2.5's padded vocabulary, logprob_chunk_size 1024)
CPU_SHAPE = (2, 512, 8192, 32)
GPU_SHAPE = (1, 16384, 151936, 1024)


def sliced_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk: int, vocab_size: int, tp_rank: int = 0,
                    temperature: float = 1.0) -> torch.Tensor:
    """The baseline: log p(labels) [b, s] from logits [b, s, V/tp] in slices of ``chunk`` positions, each under
    activation checkpointing (the chunked log-probs before ``ChunkedLogprobs``)."""
    parts = []
    for a in range(0, logits.shape[1], chunk):
        parts.append(torch.utils.checkpoint.checkpoint(
            megatron_logprobs._chunk_logprobs, logits[:, a : a + chunk], labels[:, a : a + chunk], temperature,
            vocab_size, tp_rank, use_reentrant=False))
    return torch.cat(parts, dim=1)


def chunked_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk: int, vocab_size: int, tp_rank: int = 0,
                     temperature: float = 1.0) -> torch.Tensor:
    """The actors' chunked log-probs."""
    return megatron_logprobs.chunked_token_logprobs(logits, labels, chunk, vocab_size, tp_rank, temperature)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, chunk: int,
            repeats: int) -> dict:
    """Backward seconds (the least of ``repeats``: wall, and CPU time of this process's threads), its peak bytes
    beyond what existed before it, its allocations of the logits' size, and the gradient, for the log-probs
    ``fn``."""
    device, vocab = logits.device, logits.shape[-1]
    leaf = logits.detach().requires_grad_(True)

    def loss():
        return (fn(leaf, labels, chunk, vocab) * weights).sum()

    seconds, cpu = [], []
    for _ in range(repeats + 1):  # the first pass warms the allocator up
        value = loss()
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        (grad,) = torch.autograd.grad(value, leaf)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        del grad
    value = loss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        (grad,) = torch.autograd.grad(value, leaf)
        peak, full = torch.cuda.max_memory_allocated(device) - base, None
    else:
        with host_allocations() as trace:
            (grad,) = torch.autograd.grad(value, leaf)
        peak, full = trace.peak_bytes, trace.count_at_least(leaf.nbytes)
    return {"s": min(seconds[1:]), "cpu_s": min(cpu[1:]), "peak": peak, "full_allocs": full, "grad": grad}


def rows(device: torch.device, dtype: torch.dtype, add: Callable, shape: tuple[int, int, int, int] | None = None,
         repeats: int = 5) -> dict:
    """Print the before / after rows through ``add(section, variant, measured, throughput, ratio)`` (the step
    benchmark's table) and return both measurements."""
    b, s, v, chunk = shape or (CPU_SHAPE if device.type == "cpu" else GPU_SHAPE)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, s, v, generator=g).to(device=device, dtype=dtype)
    labels = torch.randint(0, v, (b, s), generator=g).to(device)
    weights = torch.randn(b, s, generator=g).to(device)
    before = measure(sliced_logprobs, logits, labels, weights, chunk, repeats)
    after = measure(chunked_logprobs, logits, labels, weights, chunk, repeats)
    same = torch.equal(before.pop("grad"), after.pop("grad"))
    gib = logits.nbytes / 2**30
    what = (f"[{b}, {s}, {v}] {str(dtype).replace('torch.', '')} logits ({gib * 1024:.0f} MiB), "
            f"{-(-s // chunk)} chunks of {chunk}")
    for name, r in (("sliced chunks (before)", before), ("one gradient buffer (after)", after)):
        full = "" if r["full_allocs"] is None else f", {r['full_allocs']} logit-sized allocations"
        add("logprob-backward", f"{name}, {what}",
            f"{r['s']:.3f} s ({r['cpu_s']:.3f} s CPU), peak {r['peak'] / 2**20:,.0f} MiB{full}", "-",
            f"{r['s'] / before['s']:.2f} time, {r['cpu_s'] / before['cpu_s']:.2f} CPU, "
            f"{r['peak'] / max(before['peak'], 1):.2f} peak")
    add("logprob-backward", "gradients before / after", "identical" if same else "DIFFERENT", "-", "-")
    return {"before": before, "after": after, "identical": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default=None, help="rows,positions,vocab,chunk (default: 2,512,8192,32 on cpu; "
                    "1,16384,151936,1024 on cuda)")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="default: float32 on cpu, bf16")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    shape = tuple(int(x) for x in args.shape.split(",")) if args.shape else None
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    init_distributed(1, 1, backend="gloo" if device.type == "cpu" else "auto", seed=0)
    print(f"# logprob_backward: device {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'} | "
          f"torch {torch.__version__} | {torch.get_num_threads()} threads")
    table = []

    def add(*row):
        table.append(row)

    result = rows(device, dtype, add, shape, args.repeats)
    print("| section | variant | measured | throughput | ratio to before |")
    print("| --- | --- | --- | --- | --- |")
    for r in table:
        print("| " + " | ".join(r) + " |")
    destroy_distributed()
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
