"""Run NeMo's Qwen2 HF -> .nemo converter on a folder that ships only ``tokenizer.json``.

    python -m laconic_nemo.tools.convert_qwen2 [--converter PATH] --input_name_or_path HF_DIR --output_path OUT.nemo
        [--precision bf16]

NeMo's ``scripts/checkpoint_converters/convert_qwen2_hf_to_nemo.py`` (NeMo 2.2.x, the ``nemo:25.02``
container) runs ``tokenizer = Qwen2Tokenizer.from_pretrained(args.input_name_or_path)`` in ``convert()`` and
never uses the result (the .nemo records the HF folder as a ``huggingface`` tokenizer with
``use_fast: True``). The slow ``Qwen2Tokenizer`` of transformers 4.x needs ``vocab.json`` and ``merges.txt``;
the DeepSeek-R1-Distill-Qwen and DeepScaleR repositories ship ``tokenizer.json`` only, so the load fails
(``TypeError: expected str, bytes or os.PathLike object, not NoneType``) and the prepare step dies.

This wrapper loads the converter script as a module (its ``__main__`` block does not run), points the
module's ``Qwen2Tokenizer`` name at ``transformers.Qwen2TokenizerFast`` (which reads ``tokenizer.json``),
and runs the script's own ``convert(get_args())`` with the remaining arguments. Nothing else changes.

One conversion per target, in a folder of its own (:func:`convert_to_target`). NeMo's
``NLPSaveRestoreConnector.save_to(model, path)`` writes the distributed checkpoint to
``dirname(path)/model_weights`` before it packs the ``.nemo`` (``nemo/collections/nlp/parts/nlp_overrides.py:1068-1085``
in nemo-toolkit 2.2.1), and megatron-core refuses a destination that is not empty
(``megatron/core/dist_checkpointing/serialization.py:353-356`` in 0.11). With every recipe's ``.nemo`` in
``/checkpoints``, two conversions at once, or any conversion after one that was killed during its save,
would meet in ``/checkpoints/model_weights``. So a conversion holds ``<target>.lock`` beside the target
(other jobs wait for it, then find the target written), writes into a private scratch folder
``.<target name>.scratch-<host>-<pid>-<random>/`` beside the target, and renames the finished ``.nemo``
onto the target (same folder, so the rename is atomic). A killed conversion leaves its lock and scratch
folder; the next one takes the lock over when its holder is gone (:func:`conversion_lock_stale`) and
removes the scratch folders of earlier conversions of that target before it starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Callable

QWEN2_CONVERTER = "/opt/NeMo/scripts/checkpoint_converters/convert_qwen2_hf_to_nemo.py"
LOCK_SUFFIX = ".lock"
SCRATCH_INFIX = ".scratch-"
HEARTBEAT_S = 30.0           # the holder refreshes its lock file's time this often
STALE_AFTER_S = 15 * 60.0    # a lock not refreshed for this long belongs to a conversion that is gone
WAIT_LIMIT_S = 3 * 3600.0    # how long a job waits for another job's conversion of the same target


def load_converter(path: str) -> ModuleType:
    """The converter script as a module, its ``Qwen2Tokenizer`` replaced by ``Qwen2TokenizerFast``."""
    import transformers

    spec = importlib.util.spec_from_file_location("convert_qwen2_hf_to_nemo", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"NeMo's Qwen2 converter not found at {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("convert", "get_args"):
        if not callable(getattr(mod, name, None)):
            raise RuntimeError(f"{path} has no {name}(): not the NeMo 2.2.x Qwen2 converter this wrapper expects")
    if hasattr(mod, "Qwen2Tokenizer"):
        mod.Qwen2Tokenizer = transformers.Qwen2TokenizerFast
    return mod


# ---------------------------------------------------------------------------------------------- one conversion per target
class ConversionBusy(RuntimeError):
    """Another job kept converting the same target for longer than the wait limit."""


def lock_path(target: str | Path) -> Path:
    """``<target>.lock``, beside the target."""
    target = Path(target)
    return target.with_name(target.name + LOCK_SUFFIX)


def scratch_folders(target: str | Path) -> list[Path]:
    """The scratch folders of conversions of ``target`` that exist now (live or left by a killed one)."""
    target = Path(target)
    return sorted(target.parent.glob(f".{target.name}{SCRATCH_INFIX}*"))


def _read_holder(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def conversion_lock_stale(holder: dict, age_s: float, me: dict | None = None) -> str | None:
    """Why a conversion lock held by ``holder`` (its recorded identity; ``age_s``: seconds since the holder last
    refreshed it) can be taken over by ``me``, or None while its conversion may still run.

    The rules of the run lock (:func:`laconic_nemo.runtime.run_lock.stale_reason`: same host and the process gone,
    or an earlier run of the same Slurm job), plus: not refreshed for ``STALE_AFTER_S`` (the holder refreshes it
    every ``HEARTBEAT_S`` while it converts), which decides for a holder on another host. An unreadable lock
    file (written by nothing of this module) counts as stale once it is that old too."""
    from laconic_nemo.runtime.run_lock import stale_reason

    if holder:
        reason = stale_reason(holder, me)
        if reason is not None:
            return reason
    if age_s > STALE_AFTER_S:
        return f"not refreshed for {age_s / 60:.0f} minutes (a live conversion refreshes it every {HEARTBEAT_S:.0f} s)"
    return None


class ConversionLock:
    """``<target>.lock``: held by one conversion of ``target`` at a time, across jobs and hosts.

    Created atomically (a private file ``os.link``-ed to the lock name, which fails when it exists, on local disks,
    NFS and Lustre alike), holding the holder's identity as JSON; a thread refreshes its modification time every
    ``HEARTBEAT_S`` while it is held. :meth:`acquire` waits while another live conversion holds it and takes over
    a stale one (moved aside under a private name first, so two waiters cannot both take it)."""

    def __init__(self, target: str | Path, log: Callable[[str], None] = print):
        self.target = Path(target)
        self.path = lock_path(target)
        self.log = log
        self.record: dict | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self, wait_limit_s: float = WAIT_LIMIT_S, poll_s: float = 5.0) -> "ConversionLock":
        from laconic_nemo.runtime.run_lock import identity

        me = identity()
        private = self.path.with_name(f".{self.path.name}.{me['host']}.{me['pid']}")
        private.write_text(json.dumps(me) + "\n")
        start, announced = time.monotonic(), None
        try:
            while True:
                try:
                    os.link(private, self.path)
                    self.record = me
                    break
                except FileExistsError:
                    pass
                try:
                    text, age = self.path.read_text(), time.time() - self.path.stat().st_mtime
                except FileNotFoundError:
                    continue  # released in between
                holder = _read_holder(self.path) or {}
                reason = conversion_lock_stale(holder, age, me)
                if reason is not None:
                    aside = self.path.with_name(f".{self.path.name}.stale.{me['host']}.{me['pid']}")
                    try:
                        os.rename(self.path, aside)
                    except FileNotFoundError:
                        continue
                    if aside.read_text() != text:  # another waiter took it over first: give it back
                        try:
                            os.link(aside, self.path)
                        except FileExistsError:
                            pass
                    else:
                        self.log(f"prepare: took over {self.path}: {reason}")
                    aside.unlink(missing_ok=True)
                    continue
                who = (f"pid {holder.get('pid')} on host {holder.get('host')}"
                       + (f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""))
                if announced != who:
                    self.log(f"prepare: waiting for {self.path}: {self.target.name} is being converted by {who}")
                    announced = who
                if time.monotonic() - start > wait_limit_s:
                    raise ConversionBusy(f"{self.target} is still being converted by {who} after "
                                         f"{wait_limit_s / 60:.0f} minutes of waiting ({self.path}); once that job "
                                         f"is gone, delete the lock file and submit again")
                time.sleep(poll_s)
        finally:
            private.unlink(missing_ok=True)
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="conversion-lock-heartbeat", daemon=True)
        self._beat.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Stop refreshing and remove the lock if it is still this process's."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        holder = _read_holder(self.path)
        if self.record is not None and holder is not None and holder.get("pid") == self.record["pid"] \
                and holder.get("host") == self.record["host"]:
            self.path.unlink(missing_ok=True)
        self.record = None



def convert_to_target(target: str | Path, convert: Callable[[Path], int], log: Callable[[str], None] = print,
                      wait_limit_s: float = WAIT_LIMIT_S, poll_s: float = 5.0) -> int:
    """Write ``target`` (a ``.nemo``) with ``convert(output_path) -> exit status`` unless it exists; one conversion
    of a target at a time (:class:`ConversionLock`), each in its own scratch folder beside the target, the result
    renamed onto the target when complete. Returns 0 when ``target`` exists afterwards (written here or by the
    job that held the lock), else the converter's status (1 when it reported success but wrote nothing)."""
    target = Path(target)
    if target.exists():
        log(f"prepare: {target} exists")
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = ConversionLock(target, log).acquire(wait_limit_s, poll_s)
    try:
        if target.exists():
            log(f"prepare: {target} was written by another job meanwhile")
            return 0
        for old in scratch_folders(target):  # left by killed conversions: this one holds the lock
            log(f"prepare: removing {old} (left by an interrupted conversion)")
            shutil.rmtree(old, ignore_errors=True)
        from laconic_nemo.runtime.run_lock import identity

        me = identity()
        scratch = target.with_name(f".{target.name}{SCRATCH_INFIX}{me['host']}-{me['pid']}-{uuid.uuid4().hex[:8]}")
        scratch.mkdir()
        try:
            out = scratch / target.name
            rc = convert(out)
            if rc != 0:
                log(f"prepare: conversion failed with exit code {rc}")
                return rc
            if not out.is_file():
                log(f"prepare: the converter exited 0 but wrote no {out}")
                return 1
            os.replace(out, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        lock.release()
    log(f"prepare: wrote {target}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m laconic_nemo.tools.convert_qwen2", description=__doc__.split("\n\n")[0])
    p.add_argument("--converter", default=QWEN2_CONVERTER, help=f"NeMo's converter script (default {QWEN2_CONVERTER})")
    args, rest = p.parse_known_args(argv)
    mod = load_converter(args.converter)
    saved = sys.argv
    sys.argv = [args.converter, *rest]  # the converter parses sys.argv itself
    try:
        mod.convert(mod.get_args())
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
