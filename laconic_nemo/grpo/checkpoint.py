"""Checkpoint files of a run: ``<output_dir>/checkpoints/step_XXXXXX`` folders and the ``latest`` pointer.

A step folder holds the model + optimiser shard of each (TP, PP) coordinate (written by DP rank 0), every
rank's RNG state, ``trainer_state.json`` (step, shaper / lambda-controller state, layout, config), a copy of the
run's ``metrics.jsonl`` rows up to the step (a resume restores them when the run's own file lost them) and
``manifest.json`` (every file's size and CRC-32). It is written into ``step_XXXXXX.tmp``: each rank fsyncs the
files it wrote, rank 0 writes the manifest last and fsyncs it and the folder, renames the folder and fsyncs
the parent; ``latest`` is replaced the same way. A crash or a power cut therefore never leaves a renamed
folder whose files are not on disk, and resume never picks a half-written one. On resume every rank
compares the CRC-32 of the files it reads with the manifest (:meth:`CheckpointManager.verify`); a damaged
checkpoint is skipped for the previous complete one (:func:`laconic_nemo.grpo.resume.choose_checkpoint`).
Only the ``checkpoint.keep_last`` newest folders are kept.

A write that fails (a full disk: torch would only say "basic_ios::clear: iostream error") raises
:class:`CheckpointWriteError` naming the file and the operating system's reason ("No space left on device").

An actor whose state lives in files of its own (the NeMo-Aligner actor's distributed checkpoint) passes a
:class:`CheckpointHook`: it writes them before the step folder that refers to them and prunes them with it.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import zlib
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch
import torch.distributed as dist

from laconic_nemo.config import Config
from laconic_nemo.grpo.interfaces import PolicyActor
from laconic_nemo.grpo.resume import MANIFEST, METRICS_COPY, read_manifest, read_metrics
from laconic_nemo.runtime.faults import fault_point, heartbeat


class CheckpointWriteError(OSError):
    """A checkpoint file could not be written; the message names the file and the reason."""


class CheckpointDamaged(ValueError):
    """A checkpoint file does not match its manifest (size or CRC-32); the message names the file."""


class _Summing:
    """A write-only file wrapper that counts the bytes written and their CRC-32 (torch.save only writes)."""

    def __init__(self, f):
        self.f, self.size, self.crc = f, 0, 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, obj: Any = None, data: bytes | None = None) -> dict[str, int]:
    """Write ``obj`` with torch.save (or the bytes ``data``) to ``path``, flush and fsync it. Returns
    ``{"size", "crc32"}``. An OS error (ENOSPC, EDQUOT, EIO) raises CheckpointWriteError naming the file."""
    try:
        with open(path, "wb") as f:
            w = _Summing(f)
            if data is not None:
                w.write(data)
            else:
                torch.save(obj, w)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as caught:
        exc = _os_error(caught)
        if exc is None:  # a torch error that is not the file system's
            raise
        reason = exc.strerror or os.strerror(exc.errno or errno.EIO)
        free = ""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                free = f"; {shutil.disk_usage(path.parent).free} bytes free there"
            except OSError:
                pass
        raise CheckpointWriteError(exc.errno, f"cannot write {path}: {reason}{free}") from exc
    return {"size": w.size, "crc32": w.crc}


def _os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc``: itself, or the one torch's writer was handling when it raised its own
    RuntimeError ("unexpected pos ...")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def file_crc32(path: Path, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


class CheckpointHook(Protocol):
    """Checkpoint files an actor keeps beside the trainer's step folders (every method runs on every rank)."""

    def save(self, root: Path, step: int, trainer_state: dict[str, Any]) -> None:
        """Write the actor's checkpoint of ``step`` under ``root`` (collective), before the step folder."""
        ...

    def prune(self, root: Path, kept: set[str]) -> None:
        """Remove the actor's checkpoints of steps whose folder (name in ``kept``) is gone (rank 0 only)."""
        ...


def dist_ready() -> bool:
    """torch.distributed is initialised (False in a single process without a group)."""
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait for every rank (no-op without torch.distributed)."""
    if dist_ready():
        dist.barrier()


def allreduce_sum(values: Sequence[float] | torch.Tensor, group=None, dtype=torch.float64) -> torch.Tensor:
    """Sum of ``values`` over ``group`` (no-op without torch.distributed). Returns a CPU tensor."""
    t = torch.as_tensor(values, dtype=dtype).clone()
    if dist_ready():
        backend = dist.get_backend(group)
        if backend == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.cpu()


def find_resume_checkpoint(cfg: Config, notes: list[str] | None = None) -> Path | None:
    """The complete, intact checkpoint to resume (``checkpoint.resume`` auto / never / a folder, see
    :func:`laconic_nemo.grpo.resume.resume_source`); never a ``.tmp`` folder. FileNotFoundError when impossible.
    ``notes`` receives a line per damaged checkpoint skipped."""
    from laconic_nemo.config import ConfigError
    from laconic_nemo.grpo.resume import resume_source

    try:
        return resume_source(cfg, notes)
    except ConfigError as exc:
        raise FileNotFoundError(str(exc)) from exc


class CheckpointManager:
    """Writes, prunes and reads the step folders under ``root`` for one rank.

    root: ``<output_dir>/checkpoints``.
    keep_last: how many complete step folders to keep.
    rank: this process's global rank (rank 0 renames, points ``latest`` and prunes).
    hook: the actor's own checkpoint files, or None.
    """

    def __init__(self, root: Path, keep_last: int, rank: int, hook: CheckpointHook | None = None):
        self.root, self.keep_last, self.rank, self.hook = Path(root), int(keep_last), int(rank), hook
        self.is_logger = self.rank == 0

    def step_dir(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    @staticmethod
    def shard_name(actor: PolicyActor) -> str:
        tp = getattr(actor, "tp_rank", 0)
        pp = getattr(actor, "pp_rank", 0)
        return f"model_tp{tp:02d}_pp{pp:02d}.pt"

    def save(self, step: int, actor: PolicyActor, trainer_state: Callable[[], dict[str, Any]],
             metrics_file: Path | None = None) -> Path:
        """Write the checkpoint of a completed ``step`` (1-based count of finished steps); collective.

        trainer_state: builds ``trainer_state.json``'s content (called once, on the ranks that need it: rank 0,
        and every rank when a hook writes it beside the actor's files).
        metrics_file: the run's ``metrics.jsonl``; rank 0 keeps a copy of its rows up to ``step`` in the folder."""
        heartbeat("checkpoint", step)  # not a step phase: the watchdog's unscaled bound (parallel.watchdog_s)
        state = trainer_state() if self.is_logger or self.hook is not None else None
        if self.hook is not None:
            self.hook.save(self.root, step, state)
        fault_point("checkpoint", step)
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.is_logger:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        barrier()
        files: dict[str, dict[str, int]] = {}
        if actor.dp_rank == 0:
            name = self.shard_name(actor)
            files[name] = write_durable(tmp / name, actor.state_dict_for_checkpoint())
        name = f"rng_rank{self.rank:05d}.pt"
        files[name] = write_durable(tmp / name, {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        })
        if self.is_logger:
            files["trainer_state.json"] = write_durable(tmp / "trainer_state.json",
                                                        data=json.dumps(state, indent=1).encode())
            if metrics_file is not None:
                rows = [r for r in read_metrics(metrics_file)[0] if r["step"] <= step]
                files[METRICS_COPY] = write_durable(tmp / METRICS_COPY,
                                                    data="".join(json.dumps(r) + "\n" for r in rows).encode())
        fault_point("checkpoint_written", step)
        every = [files]
        if dist_ready():  # every rank's file sizes and checksums to rank 0 (also the barrier before the rename)
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, files)
        if self.is_logger:
            manifest = {"step": step, "files": {k: v for part in every for k, v in part.items()}}
            write_durable(tmp / MANIFEST, data=json.dumps(manifest, indent=1, sort_keys=True).encode())
            fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
            latest_tmp = self.root / "latest.tmp"
            write_durable(latest_tmp, data=final.name.encode())
            os.replace(latest_tmp, self.root / "latest")
            fsync_dir(self.root)
            self.prune()
        barrier()
        return final

    def prune(self):
        """Keep the ``keep_last`` newest complete step folders (and the hook's files of those steps)."""
        done = sorted(p for p in self.root.glob("step_*") if not p.name.endswith(".tmp"))
        for old in done[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        if self.hook is not None:
            self.hook.prune(self.root, {p.name for p in self.root.glob("step_*") if not p.name.endswith(".tmp")})

    def own_files(self, actor: PolicyActor) -> list[str]:
        """The files of a step folder this rank reads on resume."""
        return [self.shard_name(actor), f"rng_rank{self.rank:05d}.pt", "trainer_state.json"]

    def verify(self, path: Path, actor: PolicyActor) -> str | None:
        """Why the files this rank reads from ``path`` do not match its manifest (size or CRC-32), or None
        (also None for a checkpoint written before manifests existed)."""
        try:
            files = read_manifest(path)
        except ValueError as exc:
            return str(exc)
        if files is None:
            return None
        for name in self.own_files(actor):
            meta = files.get(name)
            if meta is None:
                return f"{path / name} is not listed in {path / MANIFEST}"
            try:
                size, crc = (path / name).stat().st_size, file_crc32(path / name)
            except OSError as exc:
                return f"{path / name}: {exc.strerror}"
            if size != meta["size"] or crc != meta["crc32"]:
                return (f"{path / name} does not match {MANIFEST} (size {size} vs {meta['size']}, CRC-32 "
                        f"{crc:08x} vs {int(meta['crc32']):08x})")
        return None

    def resume_point(self, cfg: Config, actor: PolicyActor, log: bool = False) -> Path | None:
        """The checkpoint to resume (:func:`find_resume_checkpoint`) whose files match their manifest on EVERY rank
        (each rank checks the CRC-32 of the files it reads, then all agree); a damaged one is named and skipped for the
        previous complete one. ``log``: print a line per checkpoint skipped (rank 0)."""
        from laconic_nemo.grpo.resume import choose_checkpoint

        notes: list[str] = []
        ckpt = find_resume_checkpoint(cfg, notes)
        excluded: tuple[Path, ...] = ()
        while ckpt is not None:
            why = self.verify(ckpt, actor)
            if allreduce_sum([0.0 if why is None else 1.0]).item() == 0:
                break
            if cfg.checkpoint.resume != "auto" or self.hook is not None:
                # an explicit folder; or an actor that restored its own files of this step already (NeMo)
                raise ValueError(f"checkpoint {ckpt} is damaged ({why or 'a file of another rank'}): move it aside "
                                 "to resume from the previous one")
            notes = [*notes, f"checkpoint {ckpt} is damaged and skipped: {why or 'a file of another rank'}"]
            excluded += (ckpt,)
            ckpt, more = choose_checkpoint(ckpt.parent, exclude=excluded)
            notes += [n for n in more if "is damaged" in n]
            notes.append(f"resuming from the previous complete checkpoint {ckpt}" if ckpt is not None else
                         "no intact checkpoint is left: the run starts from step 1")
        if log:
            for note in notes:
                print(note, flush=True)
        return ckpt

    def load(self, path: Path, actor: PolicyActor) -> None:
        """Restore this rank's model shard and RNG state from the step folder ``path``."""
        actor.load_checkpoint_state(torch.load(path / self.shard_name(actor), weights_only=False))
        rng = torch.load(path / f"rng_rank{self.rank:05d}.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
