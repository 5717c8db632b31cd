"""Ranks die with their launcher: ``die_with_parent`` in each rank process that ``laconic-nemo train`` starts.

On Linux the kernel sends the rank SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``, set through
ctypes; it survives ``exec`` and is checked right after setting, in case the launcher died first).
Elsewhere a daemon thread polls the parent pid once a second. Without this, a launcher killed with
SIGKILL leaves its ranks training as orphans, holding the output directory. SIGKILL, not SIGTERM:
a rank whose launcher is gone cannot report its exit code to anyone, and the last complete
checkpoint is where a rerun resumes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _poll_parent(parent_pid: int, interval_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent_pid: int, poll_interval_s: float = 1.0) -> str:
    """Make this process die when ``parent_pid`` (its parent) does. Returns "prctl" or "poll"."""
    mode = "poll"
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
                mode = "prctl"
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the launcher is already gone (re-parented before prctl took effect)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "poll":
        threading.Thread(target=_poll_parent, args=(parent_pid, poll_interval_s), daemon=True,
                         name="laconic-parent-watch").start()
    return mode
