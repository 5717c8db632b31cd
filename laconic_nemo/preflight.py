"""Pre-flight checks of `laconic-nemo train`, run before any rank, model or warm-up exists.

``train`` calls :func:`preflight_train` in the launcher (or, under torchrun / srun, in every rank
before torch.distributed starts). It runs the same validation as ``laconic-nemo plan``
(:func:`laconic_nemo.launch_plan.plan_layout`: layout, heads / layers vs TP / PP, batch
divisibility, context window, model and data paths, every data row) for this machine's layout,
then what only a training run needs:

* the output folder (and the warm-up cache) is a writable folder, or can be created;
* ``checkpoint.resume = never`` in a folder that already holds a run is refused (it would mix two
  runs' metrics and checkpoints);
* ``checkpoint.resume = <path>`` names a complete checkpoint;
* when a checkpoint will be resumed: its ``trainer_state.json`` is readable, it was written with the
  same world size, this run's resolved config equals the checkpoint's except for the keys allowed
  (:mod:`laconic_nemo.grpo.resume`), and ``metrics.jsonl`` is intact (a torn last line is allowed;
  the trainer drops it).

Every failure raises :class:`~laconic_nemo.config.ConfigError` naming the key, file or line.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from laconic_nemo.config import ConfigError, base_config_path
from laconic_nemo.grpo.resume import (
    ResumeError,
    check_resume_config,
    read_metrics,
    read_trainer_state,
    resume_source,
)

PREFLIGHT_DONE_ENV = "LACONIC_PREFLIGHT_DONE"


def check_writable_dir(path: str | Path, key: str) -> None:
    """``path`` is a writable folder, or the nearest existing parent is one (the folder is created later)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{key} = {str(path)!r} is invalid: it is a file, not a folder")
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{key} = {str(path)!r} is invalid: {probe} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=".laconic_write_probe", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise ConfigError(f"{key} = {str(path)!r} is invalid: cannot write in {probe} ({exc.strerror})") from exc


def check_resume(cfg: DictConfig, world_size: int) -> Path | None:
    """Resume checks (see the module docstring). Returns the checkpoint to resume from, or None."""
    ckpt = resume_source(cfg)
    try:
        read_metrics(Path(str(cfg.run.output_dir)) / "metrics.jsonl")
        if ckpt is None:
            return None
        state = read_trainer_state(ckpt)
        if int(state.get("world_size", world_size)) != world_size:
            raise ConfigError(f"cannot resume from {ckpt}: it was written by {state['world_size']} ranks and this "
                              f"run has {world_size}; resume with --nprocs {state['world_size']} (the same layout)")
        check_resume_config(ckpt, state.get("config", {}), OmegaConf.to_container(cfg, resolve=True),
                            list(cfg.checkpoint.resume_allow_changes or []),
                            OmegaConf.to_container(OmegaConf.load(base_config_path()), resolve=False))
    except ResumeError as exc:
        raise ConfigError(str(exc)) from exc
    return ckpt


def preflight_train(cfg: DictConfig, world_size: int, local_world_size: int | None = None) -> Path | None:
    """Every check before ranks start (see the module docstring); returns the checkpoint to resume or None."""
    from laconic_nemo.launch_plan import plan_layout

    local = int(local_world_size or world_size)
    nodes = max(1, world_size // local)
    plan_layout(cfg, nodes, local, recipe="", check_paths=True, cluster=False)
    check_writable_dir(cfg.run.output_dir, "run.output_dir")
    if cfg.warmup.num_steps > 0 and cfg.warmup.cache_dir:
        check_writable_dir(cfg.warmup.cache_dir, "warmup.cache_dir")
    return check_resume(cfg, world_size)
