"""Batched verifiable math reward with a pool of grading worker processes and a per-item CPU-time limit.

Flow of :meth:`MathReward.score`: the parent normalises the references and extracts the last boxed answer
of every response (linear time); responses without one are "no_answer" and never leave the parent. The
extracted answers are split into chunks and handed to persistent worker processes (forkserver, or spawn,
started lazily on first use). A worker grades a chunk item by item and sends each result as soon as it has
it. Each item is bounded by CPU time, so a score does not depend on how busy the machine is: a CPU-time
interval timer interrupts it at ``SOFT_FRACTION * timeout_s`` (soft bound), and the kernel ends the worker
(``RLIMIT_CPU``, SIGXCPU) when the item reaches ``timeout_s`` CPU seconds inside C code that the timer cannot
interrupt (hard bound). The parent tracks when each worker's current item started and kills a worker still on
the same item after ``wall_timeout_s`` of wall-clock time (backstop for a worker that is descheduled, stopped
or blocked without using CPU). A killed item scores 0 as a timeout, the rest of its chunk goes back to the
queue and a fresh worker replaces it. A worker that dies otherwise scores its current item 0 as an error and
is replaced the same way.
"""

from __future__ import annotations

import ast
import math
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait

from .extract import extract_answer
from .grader import MAX_ANSWER_CHARS, WALL_BACKSTOP_FACTOR, clean_answer, grade_extracted, normalize_reference

try:
    import resource
except ImportError:  # not POSIX: no kernel CPU limit, the wall-clock backstop is the hard bound
    resource = None

# Fraction of timeout_s (CPU seconds) after which the worker's own CPU-time timer interrupts an item; the
# kernel ends the worker at timeout_s CPU seconds (rounded up to a whole second) when the timer could not.
SOFT_FRACTION = 0.8
# Seconds a new worker may take to import sympy / math-verify and report ready.
STARTUP_TIMEOUT_S = 180.0
MAX_CHUNK = 32


# Internal statuses of a distinct pair, reported as "timeout": over the CPU-time limit, or over the wall-clock
# backstop.
_CPU_TIMEOUT = "timeout"
_WALL_TIMEOUT = "timeout:wall"
_GUARD_ADVICE = (
    'Put the code that runs at import time under `if __name__ == "__main__":` (see docs/rewards.md, '
    '"Scripts"), or grade in the calling process with num_workers=0.'
)


def _reimported_main_path() -> str | None:
    """Path of the main script when worker processes (spawn, forkserver) import it again, else None
    (interactive sessions, ``python -c``, ``python -m package``: multiprocessing/spawn.py,
    ``get_preparation_data`` and ``_fixup_main_from_name``)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None:
        return None
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None
    return os.path.abspath(path)


def unguarded_line(source: str, line: int) -> bool:
    """True when line ``line`` of module source ``source`` belongs to a top-level statement that is not an
    ``if`` block, i.e. it runs whenever the module is imported (``if __name__ == "__main__":`` and any other
    top-level ``if`` count as guarded)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            return not isinstance(node, ast.If)
    return False


def _unguarded_main_call() -> tuple[str, int] | None:
    """``(script, line)`` when the current call comes from top-level code of a main script that worker
    processes import again, outside any top-level ``if`` block; else None."""
    path = _reimported_main_path()
    if path is None:
        return None
    main_globals = sys.modules["__main__"].__dict__
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is main_globals):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError):
        return None
    return (path, frame.f_lineno) if unguarded_line(source, frame.f_lineno) else None


@dataclass
class RewardResult:
    """Scores of one batch.

    scores: per response, ``(1 - format_weight) * correct + format_weight * has_boxed_answer``; 0 for an
        item that timed out or crashed its worker.  Shape [N].
    metrics: graded (responses with a boxed answer), unique_graded (distinct answer/reference pairs sent
        to the verifier), correct, no_answer, timeouts, errors (counts over responses); wall_timeouts (the
        part of timeouts ended by the wall-clock backstop, not by the CPU-time limit); accuracy (correct / N);
        seconds (wall time of the call); max_item_seconds, max_item_cpu_seconds (longest single item, wall
        and CPU time; the CPU time of a killed item counts as its limit).
    statuses: per response, "correct" | "wrong" | "no_answer" | "timeout" | "error".  Shape [N].
    """

    scores: list[float]
    metrics: dict[str, float]
    statuses: list[str] = field(default_factory=list)


def _limit_cpu(seconds_from_now: float) -> None:
    """Kernel CPU-time limit of this process: SIGXCPU (which ends it) once it has used ``seconds_from_now``
    more CPU seconds, rounded up to a whole second (the unit of ``RLIMIT_CPU``)."""
    if resource is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(time.process_time() + seconds_from_now)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _worker_main(conn, soft_timeout_s: float, hard_timeout_s: float, max_answer_chars: int, checker) -> None:
    """Worker loop: receive chunks ``[(index, answer, golds), ...]``, send ``(index, status, wall seconds,
    CPU seconds)`` per item. Each item gets ``soft_timeout_s`` CPU seconds before its timer interrupts it and
    ``hard_timeout_s`` before the kernel ends the worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    if resource is not None:  # a worker ended by SIGXCPU leaves no core file
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    conn.send(("ready", os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for index, pred, golds in chunk:
            t0, c0 = time.perf_counter(), time.process_time()
            _limit_cpu(hard_timeout_s)
            status = grade_extracted(pred, golds, timeout_s=soft_timeout_s, max_answer_chars=max_answer_chars,
                                     checker=checker)
            conn.send((index, status, time.perf_counter() - t0, time.process_time() - c0))


class _Worker:
    def __init__(self, ctx, soft_timeout_s: float, hard_timeout_s: float, max_answer_chars: int, checker):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(
            target=_worker_main, args=(child_conn, soft_timeout_s, hard_timeout_s, max_answer_chars, checker),
            daemon=True, name="math-reward-worker",
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
        num_workers: grading worker processes (>= 0). 0 grades in the calling process, bounded by interval
            timers when called from the main thread (no hard kill: a computation stuck in C code cannot be
            interrupted there, so use workers for training).
        timeout_s: per-item limit in CPU seconds (> 0); an item over it scores 0 and is counted as a timeout.
            CPU time, not wall-clock time, so that a score does not depend on the load of the machine.
        wall_timeout_s: per-item wall-clock backstop in seconds (>= timeout_s; default
            ``WALL_BACKSTOP_FACTOR * timeout_s``) for a worker that is descheduled or hung without using CPU.
        format_weight: weight in [0, 1] of the format term; reward =
            (1 - format_weight) * correct + format_weight * has_boxed_answer.
        max_answer_chars: boxed answers longer than this are graded wrong without parsing.
        checker: optional picklable, deterministic ``checker(pred, golds) -> bool`` replacing the math-verify
            check (identical answer/reference pairs of a batch are graded once).
        start_method: "forkserver" (default where available) or "spawn".

    Use as a context manager or call :meth:`close`; the pool is created on the first :meth:`score` call.
    Worker processes re-import the main script: a script that scores at import time must keep that code
    under ``if __name__ == "__main__":`` (checked before the pool starts; see docs/rewards.md).
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0, format_weight: float = 0.0, *,
                 max_answer_chars: int = MAX_ANSWER_CHARS, checker=None, start_method: str | None = None,
                 wall_timeout_s: float | None = None):
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"MathReward: num_workers must be an int >= 0, got {num_workers!r}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"MathReward: timeout_s must be a finite number > 0, got {timeout_s!r}")
        if not (isinstance(format_weight, (int, float)) and 0.0 <= format_weight <= 1.0):
            raise ValueError(f"MathReward: format_weight must be in [0, 1], got {format_weight!r}")
        if wall_timeout_s is None:
            wall_timeout_s = WALL_BACKSTOP_FACTOR * float(timeout_s)
        if not (isinstance(wall_timeout_s, (int, float)) and math.isfinite(wall_timeout_s)
                and wall_timeout_s >= timeout_s):
            raise ValueError(
                f"MathReward: wall_timeout_s must be a finite number >= timeout_s ({timeout_s}), got {wall_timeout_s!r}"
            )
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
        self.wall_timeout_s = float(wall_timeout_s)
        self.format_weight = float(format_weight)
        self.max_answer_chars = max_answer_chars
        self.checker = checker
        self.start_method = start_method
        self._ctx = None
        self._workers: list[_Worker] = []
        self._closed = False
        self._main_checked = False
        self.replaced_workers = 0  # workers killed (timeout) or found dead (crash) and replaced, over the lifetime

    # ------------------------------------------------------------------ pool management
    def _new_worker(self) -> _Worker:
        if self._ctx is None:
            self._ctx = mp.get_context(self.start_method)
            if self.start_method == "forkserver":
                # Workers fork from a server that already imported the grader, so a replacement is cheap.
                self._ctx.set_forkserver_preload(["laconic_nemo.rewards._preload"])
        return _Worker(self._ctx, SOFT_FRACTION * self.timeout_s, self.timeout_s, self.max_answer_chars,
                       self.checker)

    def _check_main_module(self) -> None:
        """Refuse to start workers from code that every worker would run again (see :func:`_unguarded_main_call`)."""
        if getattr(mp.current_process(), "_inheriting", False):
            raise RuntimeError(
                "MathReward: the grading pool was started while this process was importing the main script to "
                f"become a worker process. {_GUARD_ADVICE}"
            )
        if self._main_checked:
            return
        self._main_checked = True
        where = _unguarded_main_call()
        if where is not None:
            raise RuntimeError(
                f"MathReward: the grading pool is started from top-level code of the main script {where[0]} "
                f"(line {where[1]}), outside `if __name__ == \"__main__\":`. Each grading worker ({self.start_method}) "
                f"imports that script again and would run this line again. {_GUARD_ADVICE}"
            )

    def _startup_failure(self, what: str, exitcode) -> RuntimeError:
        msg = f"MathReward: {what} (exit code {exitcode})."
        main = _reimported_main_path()
        if main is not None:
            msg += (f" The workers ({self.start_method}) import the main script {main} again: if that script "
                    f"creates a MathReward, scores, or starts processes at import time, that is the cause. {_GUARD_ADVICE}")
        return RuntimeError(msg)

    def start(self) -> None:
        """Create the worker pool now (otherwise done on the first :meth:`score`) and wait until it is ready."""
        if self._closed:
            raise RuntimeError("MathReward: start() after close()")
        if len(self._workers) < self.num_workers:
            self._check_main_module()
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
                    raise self._startup_failure("a grading worker died at start", w.proc.exitcode)

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
        # per distinct pair: a status, "timeout" being split into _CPU_TIMEOUT / _WALL_TIMEOUT until fanned out
        unique_status = ["error"] * len(items)
        item_seconds = [0.0]
        item_cpu_seconds = [0.0]
        if self.num_workers == 0:
            for u, pred, golds in items:
                t_item, c_item = time.perf_counter(), time.process_time()
                status = grade_extracted(pred, golds, timeout_s=self.timeout_s, max_answer_chars=self.max_answer_chars,
                                         checker=self.checker, wall_timeout_s=self.wall_timeout_s)
                item_seconds.append(time.perf_counter() - t_item)
                item_cpu_seconds.append(time.process_time() - c_item)
                if status == "timeout":
                    status = _CPU_TIMEOUT if item_cpu_seconds[-1] >= self.timeout_s else _WALL_TIMEOUT
                unique_status[u] = status
        elif items:
            self._grade_in_pool(items, unique_status, item_seconds, item_cpu_seconds)
        wall_timeouts = 0
        for status, indices in zip(unique_status, unique.values()):
            wall_timeouts += len(indices) * (status == _WALL_TIMEOUT)
            for i in indices:
                statuses[i] = "timeout" if status in (_CPU_TIMEOUT, _WALL_TIMEOUT) else status

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
            "wall_timeouts": float(wall_timeouts),
            "errors": float(sum(s == "error" for s in statuses)),
            "accuracy": correct / n if n else 0.0,
            "seconds": time.perf_counter() - t0,
            "max_item_seconds": max(item_seconds),
            "max_item_cpu_seconds": max(item_cpu_seconds),
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

    def _drain(self, w: _Worker, statuses: list[str] | None, item_seconds: list[float] | None = None,
               item_cpu_seconds: list[float] | None = None) -> None:
        """Read every message waiting from worker ``w``; results go to ``statuses`` / ``item_seconds`` /
        ``item_cpu_seconds``."""
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    w.ready = True
                    continue
                index, status, seconds, cpu_seconds = msg
                if w.chunk and w.chunk[0][0] == index:
                    w.chunk.popleft()
                    if statuses is not None:
                        statuses[index] = _CPU_TIMEOUT if status == "timeout" else status
                    if item_seconds is not None:
                        item_seconds.append(seconds)
                    if item_cpu_seconds is not None:
                        item_cpu_seconds.append(cpu_seconds)
                w.item_started = time.monotonic()
        except (EOFError, OSError):
            pass  # dead worker: handled by the caller through its exit code

    def _replace(self, w: _Worker, status: str, statuses: list[str], queue: deque, item_seconds: list[float],
                 item_cpu_seconds: list[float]) -> None:
        """Kill ``w``, give its current item ``status``, requeue the rest of its chunk, start a replacement."""
        w.kill()
        if w.chunk:
            index = w.chunk.popleft()[0]
            statuses[index] = status
            item_seconds.append(time.monotonic() - w.item_started)
            if status == _CPU_TIMEOUT:
                item_cpu_seconds.append(self.timeout_s)  # ended by the kernel at (at least) its CPU limit
            if w.chunk:
                queue.appendleft(list(w.chunk))
        self._workers[self._workers.index(w)] = self._new_worker()
        self.replaced_workers += 1

    def _grade_in_pool(self, items: list, statuses: list[str], item_seconds: list[float],
                       item_cpu_seconds: list[float]) -> None:
        if len(self._workers) < self.num_workers:
            self._check_main_module()
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
            deadlines = [w.item_started + self.wall_timeout_s for w in self._workers if w.chunk]
            deadlines += [w.started_at + STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
            wait_s = max(0.0, min(deadlines) - now) if deadlines else 0.0
            handles = [w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers]
            mp_wait(handles, timeout=wait_s)
            now = time.monotonic()
            for w in list(self._workers):
                self._drain(w, statuses, item_seconds, item_cpu_seconds)
                if not w.proc.is_alive():
                    self._drain(w, statuses, item_seconds, item_cpu_seconds)
                    if not w.ready:
                        startup_failures += 1
                        if startup_failures > 3 * self.num_workers:
                            raise self._startup_failure("grading workers keep dying at start", w.proc.exitcode)
                    # SIGXCPU: the kernel ended the worker at the item's CPU-time limit
                    cpu_limit = w.ready and w.proc.exitcode == -getattr(signal, "SIGXCPU", -1)
                    self._replace(w, _CPU_TIMEOUT if cpu_limit else "error", statuses, queue, item_seconds,
                                  item_cpu_seconds)
                elif w.chunk and now - w.item_started >= self.wall_timeout_s:
                    self._replace(w, _WALL_TIMEOUT, statuses, queue, item_seconds, item_cpu_seconds)
                elif not w.ready and now - w.started_at >= STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"MathReward: a grading worker did not start within {STARTUP_TIMEOUT_S} s")
