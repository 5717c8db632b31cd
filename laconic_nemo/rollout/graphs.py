"""Batch-size buckets and the graph runner of the decode engine.

A decode step is a function of STATIC buffers only (the engine's token, position, counter and KV-cache
tensors, allocated once): it reads them and writes its results back into them, and allocates nothing that
outlives it. :class:`GraphRunner` runs such a function

* on CUDA (``enabled``): captured once per key (batch-size bucket, KV length, sampling settings) into a
  ``torch.cuda.CUDAGraph`` and replayed afterwards. Capture follows PyTorch's recipe
  (``torch/cuda/graphs.py``, ``torch.cuda.graph``; the CUDA-graphs section of the CUDA semantics notes):
  warm-up iterations on a side stream, then the capture on that stream with ``capture_error_mode=
  "thread_local"`` (another thread's CUDA calls, e.g. NCCL's watchdog, do not break it); all graphs share
  one memory pool, which is safe here because no graph leaves a live tensor in the pool (every result is
  copied into a static buffer) and replays never overlap.
* elsewhere (CPU, or ``enabled=False``): by calling the very same function on the very same buffers.

Warm-up runs the step for real, so it would advance the engine's state; the runner therefore snapshots
the tensors named in ``state`` first and restores them before every warm-up iteration and after the last
one, so that each warm-up computes exactly the step that the first replay then recomputes (its writes into
the KV cache and the output buffers are the same values at the same places). ``rehearse=True`` runs this
warm-up / restore sequence on CPU too (tests use it: everything but the capture itself is exercised).
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, Iterable, Sequence

import torch


def bucket_for(n: int, buckets: Sequence[int], cap: int) -> int:
    """Smallest bucket >= n among ``buckets`` that are <= ``cap``, else ``cap`` (the cache's rows: the largest
    bucket)."""
    if not 1 <= n <= cap:
        raise ValueError(f"rows {n} must be in [1, {cap}]")
    fitting = [b for b in buckets if n <= b <= cap]
    return min(fitting) if fitting else cap


def kv_length(need: int, block: int, cap: int) -> int:
    """Positions attention reads: ``need`` rounded up to a multiple of ``block``, at most ``cap``."""
    return min(cap, -(-need // block) * block)


class GraphRunner:
    """Runs step functions over static buffers, captured per key on CUDA (see the module docstring).

    device: where the buffers live; enabled: capture on CUDA (``rollout.cuda_graphs``); warmup: eager
    iterations before a capture; rehearse: run the warm-up / restore sequence also where nothing is captured."""

    def __init__(self, device: torch.device | str, enabled: bool = True, warmup: int = 2, rehearse: bool = False):
        self.device = torch.device(device)
        self.capture = bool(enabled) and self.device.type == "cuda"
        self.warmup = int(warmup)
        self.rehearse = bool(rehearse)
        self.graphs: dict[Hashable, object] = {}
        self.rehearsed: set[Hashable] = set()
        self._pool = None
        self.captures = 0          # graphs captured (or rehearsed) since the runner was made
        self.capture_seconds = 0.0  # wall time of their warm-ups and captures (device synchronised)

    def reset(self) -> None:
        """Forget every captured graph (the buffers or the weights they read moved)."""
        self.graphs.clear()
        self.rehearsed.clear()
        self._pool = None

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def _warm(self, fn: Callable[[], None], state: Iterable[torch.Tensor]) -> None:
        state = list(state)
        saved = [t.clone() for t in state]

        def restore():
            for t, s in zip(state, saved):
                t.copy_(s)

        for _ in range(self.warmup):
            restore()
            fn()
        restore()

    def run(self, key: Hashable, fn: Callable[[], None], state: Iterable[torch.Tensor] = ()) -> None:
        """Run ``fn`` (no arguments, no result: it reads and writes static buffers) under ``key``.

        state: the tensors ``fn`` updates in place beyond idempotent writes (counters, flags, positions);
        restored after warm-up iterations."""
        if not self.capture:
            if self.rehearse and key not in self.rehearsed:
                t0 = time.perf_counter()
                self._warm(fn, state)
                self.rehearsed.add(key)
                self.captures += 1
                self.capture_seconds += time.perf_counter() - t0
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._warm(fn, state)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                fn()
            if self._pool is None:
                self._pool = graph.pool()
            self.graphs[key] = graph
            torch.cuda.synchronize(self.device)
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0
        graph.replay()
