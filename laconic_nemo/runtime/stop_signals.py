"""The signals that stop a run (SIGUSR1 from Slurm before a preemption, SIGTERM, SIGINT / Ctrl-C) and how a handler
is set for all of them: by the entry points while a run starts up, by the trainer once it runs, ignored once it is
done. Pure Python (no torch): the entry points set theirs before anything heavy is imported."""

from __future__ import annotations

import signal
from typing import Any

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def handle_stop_signals(handler: Any) -> None:
    """``handler`` (``f(signum, frame)``, or ``signal.SIG_IGN``) for every one of :data:`STOP_SIGNALS`; nothing
    outside the main thread, where Python refuses to set one (e.g. under some test runners)."""
    for s in STOP_SIGNALS:
        try:
            signal.signal(s, handler)
        except ValueError:  # not the main thread
            pass
