"""Batched verifiable math reward with a pool of grading worker processes and a hard per-item timeout.

Flow of :meth:`MathReward.score`: the parent normalises the references and extracts the last boxed answer
of every response (linear time); responses without one are "no_answer" and never leave the parent. The
extracted answers are split into chunks and handed to persistent worker processes (forkserver, or spawn,
started lazily on first use). A worker grades a chunk item by item, sends each result as soon as it has it,
and bounds each item with an interval timer (soft bound). The parent tracks when each worker's current
item started; a worker still on the same item at ``timeout_s`` is killed (hard bound: a computation stuck
inside C code), its item scores 0 as a timeout, the rest of its chunk goes back to the queue and a fresh
worker replaces it. A worker that dies scores its current item 0 as an error and is replaced the same way.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait

from .extract import extract_answer
from .grader import MAX_ANSWER_CHARS, clean_answer, grade_extracted, normalize_reference

# Fraction of timeout_s after which the worker's own interval timer interrupts an item; the parent kills
# the worker at the full timeout_s when the timer could not interrupt it.
SOFT_FRACTION = 0.8
# Seconds a new worker may take to import sympy / math-verify and report ready.
STARTUP_TIMEOUT_S = 180.0
MAX_CHUNK = 32


@dataclass
class RewardResult:
    """Scores of one batch.

    scores: per response, ``(1 - format_weight) * correct + format_weight * has_boxed_answer``; 0 for an
        item that timed out or crashed its worker.  Shape [N].
    metrics: graded (responses with a boxed answer), unique_graded (distinct answer/reference pairs sent
        to the verifier), correct, no_answer, timeouts, errors (counts over responses);
        accuracy (correct / N); seconds (wall time of the call); max_item_seconds (longest single item).
    statuses: per response, "correct" | "wrong" | "no_answer" | "timeout" | "error".  Shape [N].
    """

    scores: list[float]
    metrics: dict[str, float]
    statuses: list[str] = field(default_factory=list)


def _worker_main(conn, soft_timeout_s: float, max_answer_chars: int, checker) -> None:
    """Worker loop: receive chunks ``[(index, answer, golds), ...]``, send ``(index, status, seconds)`` per item."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    conn.send(("ready", os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for index, pred, golds in chunk:
            t0 = time.perf_counter()
            status = grade_extracted(pred, golds, timeout_s=soft_timeout_s, max_answer_chars=max_answer_chars,
                                     checker=checker)
            conn.send((index, status, time.perf_counter() - t0))


class _Worker:
    def __init__(self, ctx, soft_timeout_s: float, max_answer_chars: int, checker):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main, args=(child_conn, soft_timeout_s, max_answer_chars, checker), daemon=True,
            name="math-reward-worker",
        )
        self.proc.start()
        child_conn.close()
        self.conn = parent_conn
        self.ready = False
        self.started_at = time.monotonic()
        self.chunk: deque = deque()
        self.item_started = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class MathReward:
    """Verifiable math reward for a batch of responses.

    Args:
        num_workers: grading worker processes (>= 0). 0 grades in the calling process, bounded by an
            interval timer when called from the main thread (no hard kill: a computation stuck in C code
            cannot be interrupted there, so use workers for training).
        timeout_s: hard per-item time limit in seconds (> 0); an item over it scores 0 and is counted.
        format_weight: weight in [0, 1] of the format term; reward =
            (1 - format_weight) * correct + format_weight * has_boxed_answer.
        max_answer_chars: boxed answers longer than this are graded wrong without parsing.
        checker: optional picklable, deterministic ``checker(pred, golds) -> bool`` replacing the math-verify
            check (identical answer/reference pairs of a batch are graded once).
        start_method: "forkserver" (default where available) or "spawn".

    Use as a context manager or call :meth:`close`; the pool is created on the first :meth:`score` call.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0, format_weight: float = 0.0, *,
                 max_answer_chars: int = MAX_ANSWER_CHARS, checker=None, start_method: str | None = None):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"MathReward: num_workers must be an int >= 0, got {num_workers!r}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"MathReward: timeout_s must be a finite number > 0, got {timeout_s!r}")
        if not (isinstance(format_weight, (int, float)) and 0.0 <= format_weight <= 1.0):
            raise ValueError(f"MathReward: format_weight must be in [0, 1], got {format_weight!r}")
        if not isinstance(max_answer_chars, int) or max_answer_chars < 1:
            raise ValueError(f"MathReward: max_answer_chars must be an int >= 1, got {max_answer_chars!r}")
        available = mp.get_all_start_methods()
        if start_method is None:
            start_method = "forkserver" if "forkserver" in available else "spawn"
        if start_method not in ("forkserver", "spawn") or start_method not in available:
            raise ValueError(
                f"MathReward: start_method must be one of {[m for m in ('forkserver', 'spawn') if m in available]}, "
                f"got {start_method!r}"
            )
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.format_weight = float(format_weight)
        self.max_answer_chars = max_answer_chars
        self.checker = checker
        self.start_method = start_method
        self._ctx = None
        self._workers: list[_Worker] = []
        self._closed = False
        self.replaced_workers = 0  # workers killed (timeout) or found dead (crash) and replaced, over the lifetime

    # ------------------------------------------------------------------ pool management
    def _new_worker(self) -> _Worker:
        if self._ctx is None:
            self._ctx = mp.get_context(self.start_method)
            if self.start_method == "forkserver":
                # Workers fork from a server that already imported the grader, so a replacement is cheap.
                self._ctx.set_forkserver_preload(["laconic_nemo.rewards._preload"])
        return _Worker(self._ctx, SOFT_FRACTION * self.timeout_s, self.max_answer_chars, self.checker)

    def start(self) -> None:
        """Create the worker pool now (otherwise done on the first :meth:`score`) and wait until it is ready."""
        if self._closed:
            raise RuntimeError("MathReward: start() after close()")
        while len(self._workers) < self.num_workers:
            self._workers.append(self._new_worker())
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for w in self._workers:
            while not w.ready:
                left = deadline - time.monotonic()
                if left <= 0 or not mp_wait([w.conn, w.proc.sentinel], timeout=left):
                    raise RuntimeError(f"MathReward: a grading worker did not start within {STARTUP_TIMEOUT_S} s")
                self._drain(w, statuses=None)
                if not w.proc.is_alive() and not w.ready:
                    raise RuntimeError(f"MathReward: a grading worker died at start (exit code {w.proc.exitcode})")

    def close(self) -> None:
        """Stop the workers (politely, then by kill). Idempotent."""
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            w.kill()
        self._workers = []

    def __enter__(self) -> MathReward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if self._workers:
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    # ------------------------------------------------------------------ scoring
    def score(self, responses: list[str], answers: list) -> RewardResult:
        """Score ``responses[i]`` against ``answers[i]`` (str, int, float or list of acceptable answers).

        Returns a :class:`RewardResult` with one score per response (shape [N]).
        """
        if self._closed:
            raise RuntimeError("MathReward: score() after close()")
        if len(responses) != len(answers):
            raise ValueError(
                f"MathReward.score: responses and answers must have the same length, got {len(responses)} "
                f"and {len(answers)}"
            )
        t0 = time.perf_counter()
        n = len(responses)
        statuses = ["no_answer"] * n
        gold_cache: dict = {}
        unique: dict[tuple, list[int]] = {}  # (answer, references) -> indices of the responses giving it
        graded = 0
        for i, (response, answer) in enumerate(zip(responses, answers)):
            if not isinstance(response, str):
                raise ValueError(f"MathReward.score: responses[{i}] must be str, got {type(response).__name__}")
            golds = self._references(answer, i, gold_cache)
            pred = extract_answer(response)
            if pred is None:
                continue
            graded += 1
            pred = clean_answer(pred)
            if not pred or len(pred) > self.max_answer_chars:
                statuses[i] = "wrong"
                continue
            unique.setdefault((pred, golds), []).append(i)

        # Grading is deterministic: each distinct (answer, references) pair is graded once (the G samples of
        # a prompt often agree), which also keeps one pathological answer from costing G timeouts.
        items = [(u, pred, golds) for u, (pred, golds) in enumerate(unique)]
        unique_status = ["error"] * len(items)
        item_seconds = [0.0]
        if self.num_workers == 0:
            for u, pred, golds in items:
                t_item = time.perf_counter()
                unique_status[u] = grade_extracted(pred, golds, timeout_s=self.timeout_s,
                                                   max_answer_chars=self.max_answer_chars, checker=self.checker)
                item_seconds.append(time.perf_counter() - t_item)
        elif items:
            self._grade_in_pool(items, unique_status, item_seconds)
        for status, indices in zip(unique_status, unique.values()):
            for i in indices:
                statuses[i] = status

        fw = self.format_weight
        scores = []
        for s in statuses:
            if s in ("timeout", "error"):
                scores.append(0.0)
            else:
                scores.append((1.0 - fw) * (s == "correct") + fw * (s != "no_answer"))
        correct = sum(s == "correct" for s in statuses)
        metrics = {
            "graded": float(graded),
            "unique_graded": float(len(items)),
            "correct": float(correct),
            "no_answer": float(sum(s == "no_answer" for s in statuses)),
            "timeouts": float(sum(s == "timeout" for s in statuses)),
            "errors": float(sum(s == "error" for s in statuses)),
            "accuracy": correct / n if n else 0.0,
            "seconds": time.perf_counter() - t0,
            "max_item_seconds": max(item_seconds),
        }
        return RewardResult(scores=scores, metrics=metrics, statuses=statuses)

    @staticmethod
    def _references(answer, i: int, cache: dict) -> tuple[str, ...]:
        try:
            key = (type(answer).__name__, tuple(answer) if isinstance(answer, list) else answer)
            hash(key)
        except TypeError:
            key = None
        golds = cache.get(key) if key is not None else None
        if golds is None:
            try:
                golds = tuple(normalize_reference(answer))
            except ValueError as exc:
                raise ValueError(f"MathReward.score: answers[{i}]: {exc}") from exc
            if key is not None:
                cache[key] = golds
        return golds

    def _drain(self, w: _Worker, statuses: list[str] | None, item_seconds: list[float] | None = None) -> None:
        """Read every message waiting from worker ``w``; results go to ``statuses`` / ``item_seconds``."""
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    w.ready = True
                    continue
                index, status, seconds = msg
                if w.chunk and w.chunk[0][0] == index:
                    w.chunk.popleft()
                    if statuses is not None:
                        statuses[index] = status
                    if item_seconds is not None:
                        item_seconds.append(seconds)
                w.item_started = time.monotonic()
        except (EOFError, OSError):
            pass  # dead worker: handled by the caller through its exit code

    def _replace(self, w: _Worker, status: str, statuses: list[str], queue: deque, item_seconds: list[float]) -> None:
        """Kill ``w``, give its current item ``status``, requeue the rest of its chunk, start a replacement."""
        w.kill()
        if w.chunk:
            index = w.chunk.popleft()[0]
            statuses[index] = status
            item_seconds.append(time.monotonic() - w.item_started)
            if w.chunk:
                queue.appendleft(list(w.chunk))
        self._workers[self._workers.index(w)] = self._new_worker()
        self.replaced_workers += 1

    def _grade_in_pool(self, items: list, statuses: list[str], item_seconds: list[float]) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(self._new_worker())
        per = max(1, min(MAX_CHUNK, math.ceil(len(items) / (4 * self.num_workers))))
        queue = deque(items[k : k + per] for k in range(0, len(items), per))
        startup_failures = 0
        while True:
            for w in self._workers:
                if w.ready and not w.chunk and queue:
                    chunk = queue.popleft()
                    w.chunk = deque(chunk)
                    try:
                        w.conn.send(chunk)
                    except (OSError, ValueError):
                        pass  # dead: found below through its sentinel
                    w.item_started = time.monotonic()
            if not queue and all(not w.chunk for w in self._workers):
                break
            now = time.monotonic()
            deadlines = [w.item_started + self.timeout_s for w in self._workers if w.chunk]
            deadlines += [w.started_at + STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.0
            handles = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
            mp_wait(handles, timeout=wait_s)
            now = time.monotonic()
            for w in list(self._workers):
                self._drain(w, statuses, item_seconds)
                if not w.proc.is_alive():
                    self._drain(w, statuses, item_seconds)
                    if not w.ready:
                        startup_failures += 1
                        if startup_failures > 3 * self.num_workers:
                            raise RuntimeError(
                                f"MathReward: grading workers keep dying at start (exit code {w.proc.exitcode})"
                            )
                    self._replace(w, "error", statuses, queue, item_seconds)
                elif w.chunk and now - w.item_started >= self.timeout_s:
                    self._replace(w, "timeout", statuses, queue, item_seconds)
                elif not w.ready and now - w.started_at >= STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"MathReward: a grading worker did not start within {STARTUP_TIMEOUT_S} s")
