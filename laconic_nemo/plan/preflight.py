"""The pre-flight: every check that can run before a rank, model or warm-up exists, in one place.

``laconic-nemo plan`` and ``laconic-nemo train`` run the same checks of a recipe, :func:`check_recipe`
(``plan`` for the cluster layout it is given, ``train`` for this machine's): the typed config (keys,
types, every field's range and the rules across keys, :mod:`laconic_nemo.config`), the layout
(:func:`laconic_nemo.plan.layout.plan_layout`: heads / layers vs TP / PP, batch divisibility, the
context window, which data goes with which model), model and data paths, every row of every data file,
the checkpoint folder's tokenizer, every prompt's length in its tokens (room for rollout.max_new_tokens
in the context), and what the trainer builds before step 1 without a GPU
(:func:`laconic_nemo.plan.step_one.build_step_one`). So ``plan`` refuses what ``train`` would refuse.

``train`` calls :func:`preflight_train` in the launcher (or, under torchrun / srun, in every rank
before torch.distributed starts), which adds what only a training run on this machine needs:

* no live run holds the output folder (its ``run.lock``, :mod:`laconic_nemo.runtime.run_lock`; the launcher then
  takes it before it starts a rank, and holds it until the run ends);
* this host can run the layout (``parallel.backend = nccl`` needs CUDA devices, one per local rank;
  ``train`` runs the megatron-core actor, so ``model.source`` is synthetic or hf);
* the output folder (and the warm-up cache) is a writable folder, or can be created, and no name the
  run writes there is taken by something else (a file named ``checkpoints``, a folder named
  ``metrics.jsonl``);
* ``checkpoint.resume = never`` in a folder that already holds a run is refused (it would mix two
  runs' metrics and checkpoints);
* ``checkpoint.resume = <path>`` names a complete, intact checkpoint;
* the dashboard folders (``logging.tensorboard_dir`` or ``<output_dir>/tensorboard`` when TensorBoard is on,
  ``<output_dir>/wandb`` with W&B) are folders this process can write in, or can be created;
* when a checkpoint will be resumed: damaged checkpoints, and those whose ``trainer_state.json`` holds a bad
  value, are skipped for the previous intact one (a line says so, naming the file and the key), it was
  written with the same world size and
  layout (TP, PP and DP cannot change: the model shards are split for them), this run's resolved config
  equals the checkpoint's except for the keys allowed (:mod:`laconic_nemo.grpo.resume`), its budget classes
  and tail constraint are this run's, key for key, or ``checkpoint.resume_allow_changes`` says how to carry
  them over (:mod:`laconic_nemo.grpo.constraints`),
  ``metrics.jsonl`` is intact (a torn last line is allowed; the trainer drops it) and holds the rows of
  the checkpoint's steps, or the checkpoint holds a copy to restore them from.

Every failure raises :class:`~laconic_nemo.config.ConfigError` with one line naming the key, file or line
and what is allowed; the commands print it and exit with status 2.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from laconic_nemo.config import Config, ConfigError
from laconic_nemo.grpo.constraints import restore_resume_state
from laconic_nemo.grpo.resume import (
    METRICS_COPY,
    ResumeError,
    missing_steps,
    read_metrics,
    read_trainer_state,
    resume_source,
)

PREFLIGHT_DONE_ENV = "LACONIC_PREFLIGHT_DONE"


def check_recipe(cfg: Config, nodes: int, gpus_per_node: int, recipe: str = "", hf_model: str | None = None,
                 nemo_overrides: list[str] = (), check_paths: bool = True, cluster: bool = True,
                 gpu_memory_gib: float = 80.0, image: str = "auto") -> tuple[Any, Any]:
    """The checks ``plan`` and ``train`` share (module docstring); returns (Plan, StepOneBuild).

    cluster: a GPU cluster launch (``plan``); False for ``train`` on this machine. gpu_memory_gib: one GPU's
    memory (the decode engine's KV cache must fit; ``plan --gpu-memory-gib``); image: ``plan --image``
    (:func:`laconic_nemo.plan.layout.plan_layout`). Raises ConfigError."""
    from laconic_nemo.plan.layout import plan_layout
    from laconic_nemo.plan.model_folder import check_model_folder
    from laconic_nemo.plan.step_one import build_step_one

    try:
        plan = plan_layout(cfg, nodes, gpus_per_node, recipe=recipe, hf_model=hf_model, check_paths=check_paths,
                           cluster=cluster, gpu_memory_gib=gpu_memory_gib, image=image)
        tok = None
        if check_paths:
            found = check_model_folder(cfg, hf_model, list(nemo_overrides))
            plan.tokenizer, plan.end_strings, tok = found["tokenizer"], found["end_strings"], found["loaded"]
            if tok is not None and cfg.data.kind == "math":
                _check_prompts(cfg, tok, found["tokenizer"])
        # what the trainer builds before step 1 without a GPU: shaper + lambda controller, advantages, loss,
        # reward, and (paths permitting) tokenizer and one rendered prompt
        built = build_step_one(cfg, hf_model=hf_model, tokenizer=tok)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:  # the builders' ValueError / FileNotFoundError name the key or file
        raise ConfigError(str(exc)) from None
    plan.warnings += built.warnings
    return plan, built


def _check_prompts(cfg: Config, tok: Any, folder: str) -> None:
    """Every data row's prompt, tokenised as the trainer does, leaves room for rollout.max_new_tokens."""
    from laconic_nemo.bridge.hf_folder import hf_config
    from laconic_nemo.data.datasets import check_prompt_lengths, load_math_prompts

    items = load_math_prompts([str(f) for f in cfg.data.train_files], cfg.data.prompt_template)
    context = int((hf_config(folder) or {}).get("max_position_embeddings", cfg.model.max_position_embeddings))
    check_prompt_lengths(items, lambda t: len(tok.encode(t, add_special_tokens=False)), context,
                         cfg.rollout.max_new_tokens)


def check_host(cfg: Config, local_ranks: int) -> None:
    """This machine can run ``local_ranks`` ranks of ``cfg`` with the megatron-core actor."""
    if cfg.model.source == "nemo":
        raise ConfigError("model.source = 'nemo' is invalid for laconic-nemo train (the megatron-core actor): allowed "
                          "synthetic or hf; a .nemo checkpoint trains through launch/submit.sh "
                          "(python -m laconic_nemo.nemo_entry)")
    backend = cfg.parallel.backend
    if backend == "gloo" and cfg.rollout.engine != "vllm":
        return
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and devices == 0:
        raise ConfigError("parallel.backend = 'nccl' is invalid on this host: it has no CUDA device "
                          "(torch.cuda.is_available() is False); allowed gloo or auto here")
    if backend == "nccl" and devices < local_ranks:
        raise ConfigError(f"--nprocs = {local_ranks} is invalid with parallel.backend = 'nccl' on this host: allowed "
                          f"at most {devices} (one CUDA device per rank)")
    if cfg.rollout.engine == "vllm":
        import importlib.util

        if devices == 0 or importlib.util.find_spec("vllm") is None:
            raise ConfigError("rollout.engine = 'vllm' is invalid on this host: it needs CUDA devices and the vllm "
                              "package; allowed megatron here")


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


def check_dashboard_dirs(cfg: Config) -> None:
    """Each dashboard folder the run writes (TensorBoard's event folder, the W&B folder) is a folder this process
    can write in, or can be created; the message names the key (or the default it stands for) and the folder."""
    from laconic_nemo.grpo.metrics import tensorboard_dir, tensorboard_enabled, wandb_dir

    if tensorboard_enabled(cfg.logging):
        key = "logging.tensorboard_dir" if cfg.logging.tensorboard_dir else \
            "logging.tensorboard (its folder, ${run.output_dir}/tensorboard; set logging.tensorboard_dir or false)"
        check_writable_dir(tensorboard_dir(cfg), key)
    if cfg.logging.wandb:
        check_writable_dir(wandb_dir(cfg.run.output_dir),
                           "logging.wandb (its folder, ${run.output_dir}/wandb; or logging.wandb=false)")


def output_names(cfg: Config) -> dict[str, str]:
    """What the run writes under ``run.output_dir``: name -> "file" or "folder"."""
    names = {"metrics.jsonl": "file", "config.yaml": "file", "run.lock": "file", "checkpoints": "folder",
             "checkpoints/latest": "file"}
    if cfg.logging.plot:
        names["training_curves.png"] = "file"
    if cfg.logging.rank_trace:
        names["rank_trace"] = "folder"
    if cfg.checkpoint.export_hf:
        names["hf"] = "folder"
    if cfg.warmup.num_steps > 0 and not cfg.warmup.cache_dir:
        names["warmup"] = "folder"
    return names


def check_output_names(cfg: Config) -> None:
    """No name the run writes in ``run.output_dir`` is taken by something of the other kind."""
    out = Path(cfg.run.output_dir)
    for name, kind in output_names(cfg).items():
        p = out / name
        if not p.exists() and not p.is_symlink():
            continue
        if (kind == "file" and not p.is_file()) or (kind == "folder" and not p.is_dir()):
            what = "a folder" if p.is_dir() else "a file" if p.is_file() else "neither a file nor a folder"
            raise ConfigError(f"run.output_dir = {str(out)!r} is invalid: {p} is {what}, and the run writes a {kind} "
                              f"there; move it aside or choose another run.output_dir")


def check_resume(cfg: Config, world_size: int, notes: list[str] | None = None) -> Path | None:
    """Resume checks (see the module docstring). Returns the checkpoint to resume from, or None.
    ``notes`` receives a line per damaged checkpoint skipped."""
    metrics = Path(cfg.run.output_dir) / "metrics.jsonl"
    try:
        ckpt = resume_source(cfg, notes)
        rows, _ = read_metrics(metrics)
        if ckpt is None:
            return None
        state = read_trainer_state(ckpt)
        if int(state.get("world_size", world_size)) != world_size:
            raise ConfigError(f"cannot resume from {ckpt}: it was written by {state['world_size']} ranks and this "
                              f"run has {world_size}; resume with --nprocs {state['world_size']} (the same layout)")
        saved = state.get("config", {}).get("parallel", {})
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if key in saved and int(saved[key]) != getattr(cfg.parallel, key):
                raise ConfigError(f"parallel.{key} = {getattr(cfg.parallel, key)} is invalid for resuming {ckpt}: allowed "
                                  f"{saved[key]}, the checkpoint's (its model shards are split for that layout; "
                                  "checkpoint.resume_allow_changes cannot change it)")
        tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
        if "dp_size" in state and int(state["dp_size"]) != world_size // (tp * pp):
            raise ConfigError(f"cannot resume from {ckpt}: it was written with DP {state['dp_size']} and this run has "
                              f"DP {world_size // (tp * pp)}; resume with the checkpoint's layout")
        # the config differences, then lambda, each class by its key and the tail by its settings, as a rank does
        restore_resume_state(ckpt, state, cfg)
        lost = missing_steps(rows, int(state.get("step", 0)))
        if lost and not (ckpt / METRICS_COPY).is_file():
            raise ConfigError(f"{metrics} lacks the rows of {len(lost)} of the {state['step']} steps of {ckpt} "
                              f"(first missing: step {lost[0]}) and that checkpoint holds no copy of them: restore "
                              "the file, or start over in another run.output_dir")
    except ResumeError as exc:
        raise ConfigError(str(exc)) from exc
    return ckpt


def preflight_train(cfg: Config, world_size: int, local_world_size: int | None = None) -> Path | None:
    """Every check before ranks start (see the module docstring); returns the checkpoint to resume or None.
    Prints a line for each damaged checkpoint skipped."""
    from laconic_nemo.grpo.metrics import check_sinks
    from laconic_nemo.runtime.run_lock import OutputDirLocked, check_free

    try:  # a live run in this output dir: nothing else to check
        check_free(cfg.run.output_dir)
    except OutputDirLocked as exc:
        raise ConfigError(str(exc)) from None
    local = int(local_world_size or world_size)
    nodes = max(1, world_size // local)
    check_recipe(cfg, nodes, local, check_paths=True, cluster=False)
    check_host(cfg, local)
    check_writable_dir(cfg.run.output_dir, "run.output_dir")
    check_output_names(cfg)
    if cfg.warmup.num_steps > 0 and cfg.warmup.cache_dir:
        check_writable_dir(cfg.warmup.cache_dir, "warmup.cache_dir")
    check_sinks(cfg)  # a dashboard the recipe asks for, without its package
    check_dashboard_dirs(cfg)
    notes: list[str] = []
    try:
        return check_resume(cfg, world_size, notes)
    finally:  # also when the checkpoint chosen is then refused: which one it is, and why the newer ones are not
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun / srun every rank runs this; one says it
            for note in notes:
                print(f"laconic-nemo train: {note}", file=sys.stderr, flush=True)
