"""Whether W&B can still write its files: what :class:`laconic_nemo.grpo.metrics.WandbSink` checks before each step
it hands W&B, and after it opened and closed its run.

W&B says nothing when it cannot write (wandb 0.31): its service (a separate process) writes the run file and loses
what it cannot write without a word to the training process (offline, the run file stays at 0 bytes), and its own
log (``debug.log``, through Python's logging) meets the OSError in each log call, where ``logging`` prints a
``--- Logging error ---`` traceback to the console for every line (over a hundred for a short run) and goes on. So:

* :class:`LogWriteErrors` keeps those tracebacks off the console and records the OSError instead: every handler W&B
  adds to its logger (``wandb``; ``wandb/sdk/lib/wb_logging.py``, ``add_file_handler``) gets an error handler that
  records an OSError and passes any other error to logging's own;
* :func:`no_space` reads the free space of W&B's folder: none left means W&B's next write fails (a write that
  fails for want of space fills what was left).

Either is raised as the OSError of the step where it was found, and the sink's caller names it once and leaves W&B
out for the rest of the session (the next session sends W&B the rows it lacks from ``metrics.jsonl``).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import weakref
from pathlib import Path

WANDB_LOGGER = "wandb"  # the logger W&B's modules log through (their handlers hang on it)


class LogWriteErrors:
    """The OSErrors W&B's log handlers met writing (``errors``, oldest first), instead of a traceback each on the
    console. One per process (:meth:`install`); a reader takes the errors after its own start (:meth:`since`)."""

    _installed: "LogWriteErrors | None" = None

    def __init__(self) -> None:
        self.errors: list[OSError] = []
        self.quieted: weakref.WeakSet = weakref.WeakSet()
        self.logger = logging.getLogger(WANDB_LOGGER)
        add = self.logger.addHandler

        def add_handler(handler: logging.Handler) -> None:
            self.quiet(handler)
            add(handler)

        self.logger.addHandler = add_handler  # this logger only: W&B adds its run's file handler through it
        for handler in self.logger.handlers:
            self.quiet(handler)

    @classmethod
    def install(cls) -> "LogWriteErrors":
        if cls._installed is None:
            cls._installed = cls()
        return cls._installed

    def quiet(self, handler: logging.Handler) -> None:
        """Give ``handler`` an error handler that records an OSError (any other error goes to logging's own)."""
        if handler in self.quieted:
            return
        default = handler.handleError

        def handle_error(record: logging.LogRecord) -> None:
            exc = sys.exc_info()[1]
            if isinstance(exc, OSError):
                self.errors.append(exc)
            else:
                default(record)

        handler.handleError = handle_error
        self.quieted.add(handler)

    def since(self, start: int) -> OSError | None:
        """The first error recorded after the first ``start`` ones, or None."""
        return self.errors[start] if len(self.errors) > start else None


def no_space(folder: str | Path) -> OSError | None:
    """ENOSPC naming ``folder`` when its file system has no space left for this user, else None (also when the
    folder cannot be read: its writes then fail on their own)."""
    try:
        free = os.statvfs(folder)
    except OSError:
        return None
    if free.f_bavail > 0:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
