"""One run per output directory: ``<run.output_dir>/run.lock``, held while a run trains: by ``laconic-nemo train``'s
launcher (or lone process) from the end of its pre-flight, before any rank starts, to the run's end; under torchrun /
srun by rank 0. The pre-flight refuses a folder a live run holds (:func:`check_free`), so a second run is refused
with one line before anything starts.

The lock file is JSON naming its holder: host, pid, the process start time (``/proc/<pid>/stat``, so a
recycled pid is not taken for the holder), the boot id, the Slurm job id and restart count, and when it
was taken. It is created complete and atomically (written to a private file, then ``os.link``-ed to
``run.lock``, which fails when the name exists, on local disks, NFS and Lustre alike) and removed when
the run ends. A run killed with SIGKILL leaves it behind; the next run decides whether it is stale:

* same host (hostname and boot id): stale when the holder process is gone (no such pid, a zombie, or a
  different process that reuses the pid); a live holder refuses the new run;
* same Slurm job, another restart (``SLURM_JOB_ID`` equal, ``SLURM_RESTART_COUNT`` different): stale on
  any host - Slurm runs one instance of a job at a time, so a requeued job takes over the lock its
  previous run left, whichever node it lands on;
* another host otherwise: the holder's processes cannot be checked from here, so the lock counts as
  held and the run is refused, naming host, pid, job and the file. Once that run is known to be gone
  (``squeue``, ``ps`` on that host), delete the file by hand.

Taking over a stale lock moves it aside under a private name first and checks that what was moved is
the lock judged stale, so two runs starting together cannot both take it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = "run.lock"


class OutputDirLocked(RuntimeError):
    """Another live run holds the output directory (the message names it and what to do)."""


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _proc_start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), None if unknown."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "pid (comm)": state is fields[0], starttime fields[19]
    return fields[19] if len(fields) > 19 else None


def _proc_state(pid: int) -> str | None:
    stat = _read_text(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[-1].split()[0] if stat else None


def _boot_id() -> str | None:
    text = _read_text("/proc/sys/kernel/random/boot_id")
    return text.strip() if text else None


def identity(pid: int | None = None) -> dict:
    """What a lock records about the process ``pid`` (default: this one)."""
    pid = os.getpid() if pid is None else pid
    return {
        "host": socket.gethostname(), "pid": pid, "start_time": _proc_start_time(pid), "boot_id": _boot_id(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT",
                                                                                             "0"),
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def process_alive(pid: int, start_time: str | None = None) -> bool:
    """Whether ``pid`` runs on this host (and, when ``start_time`` is given, is the process that had it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    if _proc_state(pid) in ("Z", "X"):  # exited, not yet reaped
        return False
    if start_time is not None:
        now = _proc_start_time(pid)
        if now is not None and now != start_time:
            return False  # the pid was recycled
    return True


def stale_reason(holder: dict, me: dict | None = None) -> str | None:
    """Why the lock of ``holder`` can be taken over by ``me`` (None: it is held)."""
    me = me or identity()
    job = holder.get("slurm_job_id")
    if job and job == me.get("slurm_job_id") and holder.get("slurm_restart_count") != me.get("slurm_restart_count"):
        return f"left by an earlier run of Slurm job {job} (restart {holder.get('slurm_restart_count')})"
    if holder.get("host") != me["host"]:
        return None
    if holder.get("boot_id") and me.get("boot_id") and holder["boot_id"] != me["boot_id"]:
        return "its host has rebooted since"
    if not process_alive(int(holder.get("pid", -1)), holder.get("start_time")):
        return f"process {holder.get('pid')} on this host is gone"
    return None


def _describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job_id']} restart {holder.get('slurm_restart_count')}" \
        if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}, since {holder.get('taken_at')}"


def _refusal(output_dir: Path, lock: Path, holder: dict) -> OutputDirLocked:
    here = holder.get("host") == socket.gethostname()
    gone = ("" if here else f"; a process on host {holder.get('host')} cannot be checked from here: once that run "
            f"is gone, delete {lock}")
    return OutputDirLocked(f"run.output_dir = {output_dir} is in use by another run: {lock} is held by "
                           f"{_describe(holder)}. Wait for that run to end or choose another run.output_dir{gone}.")


def read_holder(output_dir: str | os.PathLike) -> dict | None:
    """The holder recorded in the lock of ``output_dir``, or None when there is no lock."""
    text = _read_text(str(Path(output_dir) / LOCK_NAME))
    if text is None:
        return None
    try:
        holder = json.loads(text)
    except ValueError:
        holder = None
    return holder if isinstance(holder, dict) else {"host": "?", "pid": "?", "corrupt": text[:200]}


def check_free(output_dir: str | os.PathLike) -> None:
    """Raise :class:`OutputDirLocked` when a live run holds ``output_dir`` (no lock is taken)."""
    holder = read_holder(output_dir)
    if holder is not None and stale_reason(holder) is None:
        raise _refusal(Path(output_dir), Path(output_dir) / LOCK_NAME, holder)


class OutputDirLock:
    """The lock on one output directory, held by this process until :meth:`release`."""

    def __init__(self, output_dir: str | os.PathLike, record: dict):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_NAME
        self.record = record
        self.took_over: str | None = None  # why a stale lock was taken over, if one was

    @classmethod
    def acquire(cls, output_dir: str | os.PathLike) -> OutputDirLock:
        """Take the lock (creating ``output_dir``), taking over a stale one; raise :class:`OutputDirLocked` when a
        live run holds it, OSError when the folder cannot be created or written."""
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        me = identity()
        lock = cls(out, me)
        private = out / f".{LOCK_NAME}.{me['host']}.{me['pid']}"
        private.write_text(json.dumps(me) + "\n")
        try:
            for _ in range(3):
                try:
                    os.link(private, lock.path)
                    return lock
                except FileExistsError:
                    pass
                text = _read_text(str(lock.path))
                if text is None:
                    continue  # released in between: try again
                holder = read_holder(out) or {}
                reason = stale_reason(holder, me) if "corrupt" not in holder else None
                if reason is None:
                    raise _refusal(out, lock.path, holder)
                aside = out / f".{LOCK_NAME}.stale.{me['host']}.{me['pid']}"
                try:
                    os.rename(lock.path, aside)
                except FileNotFoundError:
                    continue
                if _read_text(str(aside)) != text:  # another run took over first: give its lock back
                    try:
                        os.link(aside, lock.path)
                    except FileExistsError:
                        pass
                    os.unlink(aside)
                    continue
                os.unlink(aside)
                lock.took_over = reason
            raise OutputDirLocked(f"run.output_dir = {out}: could not take {lock.path} (other runs keep taking it)")
        finally:
            private.unlink(missing_ok=True)

    def release(self) -> None:
        """Remove the lock if it is still this process's."""
        holder = read_holder(self.output_dir)
        if holder is not None and holder.get("pid") == self.record["pid"] and holder.get("host") == self.record["host"]:
            self.path.unlink(missing_ok=True)


def hold_output_dir(output_dir: str | os.PathLike, rank: int) -> OutputDirLock | None:
    """Collective over the default torch.distributed group (if initialised): rank 0 takes the lock, every rank
    raises :class:`OutputDirLocked` (or OSError's message as one) when it could not. Returns the lock on rank 0."""
    import torch.distributed as dist

    lock, refusal = None, [None]
    if rank == 0:
        try:
            lock = OutputDirLock.acquire(output_dir)
        except OutputDirLocked as exc:
            refusal = [str(exc)]
        except OSError as exc:
            refusal = [f"run.output_dir = {output_dir}: cannot create its lock file ({exc})"]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise OutputDirLocked(refusal[0])
    return lock
