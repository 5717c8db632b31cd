"""Checkpoint files of a run: ``<output_dir>/checkpoints/step_XXXXXX`` folders and the ``latest`` pointer.

A step folder holds the model + optimiser shard of each (TP, PP) coordinate (written by DP rank 0), every
rank's RNG state, and ``trainer_state.json`` (step, shaper / lambda-controller state, layout, config). It is
written into ``step_XXXXXX.tmp`` and renamed once complete, and ``latest`` is replaced atomically, so a crash
never leaves a half-written checkpoint that resume would pick. Only the ``checkpoint.keep_last`` newest
folders are kept.

An actor whose state lives in files of its own (the NeMo-Aligner actor's distributed checkpoint) passes a
:class:`CheckpointHook`: it writes them before the step folder that refers to them and prunes them with it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from laconic_nemo.faults import fault_point, heartbeat
from laconic_nemo.grpo.interfaces import PolicyActor


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


def find_resume_checkpoint(cfg: DictConfig) -> Path | None:
    """The complete checkpoint to resume (``checkpoint.resume`` auto / never / a folder, see
    :func:`laconic_nemo.grpo.resume.resume_source`); never a ``.tmp`` folder. FileNotFoundError when impossible."""
    from laconic_nemo.config import ConfigError
    from laconic_nemo.grpo.resume import resume_source

    try:
        return resume_source(cfg)
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

    def save(self, step: int, actor: PolicyActor, trainer_state: Callable[[], dict[str, Any]]) -> Path:
        """Write the checkpoint of a completed ``step`` (1-based count of finished steps); collective.

        trainer_state: builds ``trainer_state.json``'s content (called once, on the ranks that need it: rank 0,
        and every rank when a hook writes it beside the actor's files)."""
        state = trainer_state() if self.is_logger or self.hook is not None else None
        if self.hook is not None:
            self.hook.save(self.root, step, state)
        heartbeat("checkpoint", step)
        fault_point("checkpoint", step)
        final = self.step_dir(step)
        tmp = final.with_name(final.name + ".tmp")
        if self.is_logger:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        barrier()
        if actor.dp_rank == 0:
            torch.save(actor.state_dict_for_checkpoint(), tmp / self.shard_name(actor))
        torch.save(
            {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            },
            tmp / f"rng_rank{self.rank:05d}.pt",
        )
        if self.is_logger:
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        fault_point("checkpoint_written", step)
        barrier()
        if self.is_logger:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            latest_tmp = self.root / "latest.tmp"
            latest_tmp.write_text(final.name)
            os.replace(latest_tmp, self.root / "latest")
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

    def load(self, path: Path, actor: PolicyActor) -> None:
        """Restore this rank's model shard and RNG state from the step folder ``path``."""
        actor.load_checkpoint_state(torch.load(path / self.shard_name(actor), weights_only=False))
        rng = torch.load(path / f"rng_rank{self.rank:05d}.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
