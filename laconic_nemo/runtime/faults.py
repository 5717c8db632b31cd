"""Progress heartbeats for the local launcher's watchdog, and test-only fault points.

Heartbeats: when the local launcher starts the ranks it sets ``LACONIC_HEARTBEAT_DIR``; every rank
then records its current phase there (``rank<r>.json``: phase, step, pid, time, and inside a warm-up or
GRPO step ``step_s``, the longest such step of this process so far) at start-up, at every warm-up step
and at the start of every phase of a GRPO step. The launcher reads these files to know which ranks are
ready for forwarded signals and, when no rank has made progress for the watchdog's bound
(``parallel.watchdog_s``, or inside a step ``max(parallel.watchdog_min_s, parallel.watchdog_step_factor
x step_s)``), which rank stalled first (the oldest heartbeat). Without the variable (torchrun, srun)
:func:`heartbeat` does nothing.

Fault points (tests and fault-injection runs only): ``LACONIC_FAULT`` holds comma-separated
``point@step:rank[:action]`` entries; when rank ``rank`` reaches ``point`` during 1-based step
``step`` (for warm-up points: the warm-up step), it performs ``action``:

* ``kill`` (default): SIGKILL itself, as the OOM killer or a node failure would;
* ``stop``: SIGSTOP itself (a hung rank; the watchdog must find it);
* ``term`` / ``usr1``: send itself SIGTERM / SIGUSR1 (a preemption notice at that point);
* ``oom``: raise ``torch.OutOfMemoryError`` there, as the CUDA caching allocator does when an allocation fails.

Points: the phases of a step (``generate``, ``reward``, ``shape_advantage``, ``logprobs``,
``policy_update``, ``dual_step``, ``checkpoint``), ``checkpoint_written`` (this rank's files of the
checkpoint are in the ``.tmp`` folder, before the rename), ``after_checkpoint`` (the step's
checkpoint is complete), ``metrics_torn`` (rank 0 writes half of the step's ``metrics.jsonl`` row,
then the action), ``warmup_step`` (start of a warm-up step), ``start_up`` (step 0: a rank's start,
right after its first heartbeat, before the distributed rendezvous), ``train_step`` (inside an actor's optimiser step,
after its micro-batches' forward and backward; ``step`` counts optimiser steps). Unset, every call is a dictionary
lookup and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

FAULT_ENV = "LACONIC_FAULT"
HEARTBEAT_ENV = "LACONIC_HEARTBEAT_DIR"
_ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM, "usr1": signal.SIGUSR1}


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def armed(point: str, step: int) -> str | None:
    """The action armed for ``point`` at ``step`` on this rank, or None."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    for entry in spec.split(","):
        name, _, rest = entry.strip().partition("@")
        parts = rest.split(":")
        if name != point or len(parts) < 2:
            continue
        if int(parts[0]) == int(step) and int(parts[1]) == _rank():
            return parts[2] if len(parts) > 2 else "kill"
    return None


def fire(action: str) -> None:
    """Perform ``action`` on this process (see the module docstring)."""
    if action not in _ACTIONS and action != "oom":
        raise ValueError(f"{FAULT_ENV}: unknown action {action!r} (allowed: {', '.join(_ACTIONS)}, oom)")
    print(f"[fault point] rank {_rank()} pid {os.getpid()}: {action}", flush=True)
    if action == "oom":
        import torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected at a fault point)")
    os.kill(os.getpid(), _ACTIONS[action])


def fault_point(point: str, step: int) -> None:
    """Fire the fault armed for ``point`` at ``step`` on this rank, if any."""
    action = armed(point, step)
    if action is not None:
        fire(action)


def heartbeat(phase: str, step: int = 0, step_s: float | None = None) -> None:
    """Record that this rank entered ``phase`` of ``step`` (no-op unless the launcher asked for it). ``step_s``:
    inside a warm-up or GRPO step, the longest such step this process has finished (seconds), else None."""
    folder = os.environ.get(HEARTBEAT_ENV)
    if not folder:
        return
    path = Path(folder) / f"rank{_rank()}.json"
    tmp = path.with_name(path.name + ".tmp")
    beat = {"phase": phase, "step": int(step), "pid": os.getpid(), "time": time.time()}
    if step_s is not None:
        beat["step_s"] = float(step_s)
    try:
        tmp.write_text(json.dumps(beat))
        os.replace(tmp, path)
    except OSError:  # the launcher is gone or its folder removed: nothing to report to
        pass


def read_heartbeat(folder: str | Path, rank: int) -> dict | None:
    """The last heartbeat of ``rank`` (with ``mtime``), or None before its first one."""
    path = Path(folder) / f"rank{rank}.json"
    try:
        data = json.loads(path.read_text())
        data["mtime"] = path.stat().st_mtime
        return data
    except (OSError, ValueError):
        return None


def process_state(pid: int) -> str:
    """Linux process state of ``pid`` in words ("stopped (SIGSTOP)", "sleeping", ...), "" if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    code = stat.rsplit(")", 1)[1].split()[0]
    return {"R": "running", "S": "sleeping (waiting, e.g. on a collective)", "D": "in uninterruptible I/O",
            "T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "Z": "a zombie"}.get(code, code)
