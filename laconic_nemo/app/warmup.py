"""Supervised warm-up: fit the initial policy on worked solutions before RL (tiny CPU demo).

The same actor, parallel layout and ``train_step`` as RL, with a masked next-token NLL on the
response tokens (EOS included) instead of the GRPO loss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from laconic_nemo.config import Config, ConfigError
from laconic_nemo.grpo.checkpoint import CheckpointManager, allreduce_sum, barrier
from laconic_nemo.grpo.interfaces import PolicyActor, TrainBatch, response_mask
from laconic_nemo.grpo.loss import make_sft_loss_fn
from laconic_nemo.grpo.metrics import ProgressClock
from laconic_nemo.runtime.faults import fault_point, heartbeat


@runtime_checkable
class WarmupActor(PolicyActor, Protocol):
    """What the warm-up needs of an actor beyond :class:`~laconic_nemo.grpo.interfaces.PolicyActor` (the
    megatron-core actor has it; the NeMo-Aligner actor starts from its ``.nemo`` and has no warm-up)."""

    def model_state(self) -> dict[str, Any]:
        """This rank's model weights only (a warmed-up policy to cache)."""
        ...

    def load_model_state(self, state: dict[str, Any]) -> None:
        ...

    def reset_optimizer(self, lr: float) -> None:
        """Fresh optimiser state and scheduler at learning rate ``lr`` (between warm-up and RL)."""
        ...

    def set_learning_rate(self, lr: float) -> None:
        ...

    def snapshot_reference(self) -> None:
        """Make the current weights the reference policy pi_ref of the KL term."""
        ...


def pack(examples: list[tuple[list[int], list[int]]], pad_id: int) -> TrainBatch:
    """(prompt ids, response ids incl. EOS) pairs -> right-padded TrainBatch with its response mask."""
    seqs = [p + r for p, r in examples]
    T = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    pl = torch.tensor([len(p) for p, _ in examples])
    rl = torch.tensor([len(r) for _, r in examples])
    return TrainBatch(tokens=tokens, prompt_lengths=pl, response_lengths=rl, response_mask=response_mask(pl, rl, T))


def supervised_warmup(
    actor: WarmupActor,
    make_example: Callable[[random.Random], tuple[list[int], list[int]]],
    num_steps: int,
    batch_size: int,
    micro_batch_size: int,
    seed: int,
    pad_id: int,
    log: Callable[[str], None] = print,
    log_every: int = 50,
    start_step: int = 0,
    should_stop: Callable[[], bool] | None = None,
) -> list[float]:
    """``num_steps`` optimiser steps on fresh examples; ``batch_size`` is global (split over DP).

    Every DP rank draws the same global batch from ``Random(seed + step)`` and keeps its slice, so
    the data do not depend on the layout. Returns the loss of each step."""
    if batch_size % actor.dp_size:
        raise ValueError(f"warmup.batch_size = {batch_size} must be divisible by DP = {actor.dp_size}")
    per = batch_size // actor.dp_size
    losses = []
    longest = None  # the longest warm-up step so far (the launcher's watchdog scales with it)
    clock = ProgressClock(start_step, num_steps)  # ETA from the mean time of the steps this process ran
    for step in range(start_step, num_steps):
        if should_stop is not None and should_stop():
            break
        heartbeat("warmup", step + 1, step_s=longest)
        fault_point("warmup_step", step + 1)
        t_step = time.perf_counter()
        rng = random.Random(seed * 7919 + step)
        examples = [make_example(rng) for _ in range(batch_size)]
        mine = pack(examples[actor.dp_rank * per : (actor.dp_rank + 1) * per], pad_id)
        n_tok = float(allreduce_sum([float(mine.response_mask.sum())], group=actor.dp_group)[0])
        out = actor.train_step(mine, make_sft_loss_fn(global_num_tokens=n_tok), micro_batch_size)
        losses.append(float(out.get("loss", float("nan"))))
        longest = max(longest or 0.0, time.perf_counter() - t_step)
        if (step + 1) % log_every == 0 or step + 1 == num_steps:
            log(f"warmup {step + 1:>5}/{num_steps} | nll/token {losses[-1]:.4f} | {clock.elapsed():.1f}s | "
                f"eta {clock.eta(step + 1)}")
    return losses


# The code a warmed-up policy is a function of, besides the recipe: the warm-up loop and its data, the model, its
# layout and initialisation, the training step and the loss. A change to any of it (the reduction order of a sum,
# a micro-batch split, an initialiser) changes the policy, so it is part of the cache key.
WARMUP_MODULES = (
    "laconic_nemo.app.warmup", "laconic_nemo.app.task", "laconic_nemo.data.synthetic", "laconic_nemo.grpo.loss",
    "laconic_nemo.grpo.interfaces", "laconic_nemo.actors.megatron_core", "laconic_nemo.actors.megatron_build",
    "laconic_nemo.actors.megatron_logprobs", "laconic_nemo.actors.megatron_step", "laconic_nemo.actors.megatron_shards",
    "laconic_nemo.actors.megatron_batches", "laconic_nemo.actors.megatron_schedule",
    "laconic_nemo.actors.megatron_reference",
    "laconic_nemo.runtime.megatron_env", "laconic_nemo.runtime.kernels",
)
WARMUP_FUNCTIONS = (("laconic_nemo.grpo.checkpoint", "allreduce_sum"),)
META = "meta.json"


def normalized_source(source: str) -> str:
    """The syntax tree of Python ``source`` without docstrings, comments, blank lines or line numbers: a
    fingerprint that edits of the text alone do not change."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def warmup_code_digest() -> str:
    """sha256 (12 hex digits) of the normalised source of :data:`WARMUP_MODULES` and :data:`WARMUP_FUNCTIONS`."""
    import importlib
    import inspect

    h = hashlib.sha256()
    for name in WARMUP_MODULES:
        h.update(name.encode() + b"\0" + normalized_source(inspect.getsource(importlib.import_module(name))).encode())
    for module, fn in WARMUP_FUNCTIONS:
        obj = getattr(importlib.import_module(module), fn)
        h.update(f"{module}.{fn}".encode() + b"\0" + normalized_source(inspect.getsource(obj)).encode())
    return h.hexdigest()[:12]


def library_versions() -> dict[str, str]:
    """Python, torch and megatron-core versions (their kernels and reductions make the policy's floats)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        megatron = version("megatron-core")
    except PackageNotFoundError:
        megatron = "absent"
    return {"python": ".".join(platform.python_version_tuple()[:2]), "torch": torch.__version__,
            "megatron-core": megatron}


def warmup_cache_key(cfg: Config, world_size: int | None = None, threads: int | None = None,
                     isa: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the warmed-up policy is a function of: the recipe's model, warm-up, layout, synthetic task, seed
    and micro-batch order, the world size, the CPU threads per process, the CPU kernels' instruction set, the code
    (:func:`warmup_code_digest`) and the library versions. world_size: the run's number of processes (default:
    this launch's ``WORLD_SIZE``); threads: torch's intra-op threads of the warm-up (default: the entry points'
    setting, :func:`laconic_nemo.runtime.megatron_env.cpu_threads`); isa: the instruction set of its CPU kernels
    (default: this process's, :func:`laconic_nemo.runtime.cpu_isa.cpu_isa`, pinned by the entry points)."""
    from laconic_nemo.runtime.cpu_isa import cpu_isa
    from laconic_nemo.runtime.megatron_env import cpu_threads

    key = {k: dataclasses.asdict(getattr(cfg, k)) for k in ("model", "warmup", "parallel")}
    key["synthetic"] = dataclasses.asdict(cfg.data.synthetic)
    if key["synthetic"].get("reasoning_marker") is None:  # no marker: the key of the task without the option
        key["synthetic"].pop("reasoning_marker", None)
    key["synthetic"].pop("budgets_by_terms", None)  # the RL prompts' budgets: the warm-up never reads them
    if not key["synthetic"].get("stated_share"):  # no stated budget: the key of the task without the option
        for k in ("stated_share", "stated_range", "budget_follow"):
            key["synthetic"].pop(k, None)
    else:  # the warm-up states its budgets in the RL prompts' words
        key["synthetic"]["instruction"] = cfg.data.target_instruction
    key["seed"] = cfg.run.seed
    key["world_size"] = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else int(world_size)
    # the warm-up's micro-batches follow grpo.sort_by_length (another float summation order, another policy)
    key["sort_by_length"] = cfg.grpo.sort_by_length
    if cfg.grpo.micro_batch_tokens:  # packed micro-batches (another summation order); unpacked keys are unchanged
        key["micro_batch_tokens"] = cfg.grpo.micro_batch_tokens
    key["warmup"].pop("cache_dir", None)
    for k in ("watchdog_step_factor", "watchdog_min_s"):  # the launcher's, not the policy's (and newer than the
        key["parallel"].pop(k, None)                       # caches: keeping them out keeps the caches' names)
    # a CPU matmul splits its sums over threads: another thread count, other roundings
    key["threads"] = cpu_threads() if threads is None else int(threads)
    # the kernels' instruction set: 8- or 16-wide vector sums, MKL's code path per processor: other roundings
    key["cpu_isa"] = cpu_isa() if isa is None else dict(isa)
    key["code"] = warmup_code_digest()
    key["versions"] = library_versions()
    return key


def warmup_cache_dir(cfg: Config, world_size: int | None = None, threads: int | None = None,
                     isa: dict[str, Any] | None = None) -> Path:
    """Where the warmed-up policy of this recipe is cached: ``<warmup.cache_dir>/policy_<digest>``, the digest of
    :func:`warmup_cache_key` (a policy made by other code, library versions, thread counts or instruction sets is
    never reused)."""
    key = warmup_cache_key(cfg, world_size, threads, isa)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cfg.warmup.cache_dir) if cfg.warmup.cache_dir else Path(cfg.run.output_dir) / "warmup"
    return root / f"policy_{digest}"


def check_cache_meta(cache: Path, key: dict[str, Any]) -> None:
    """A cached policy is used only with the key it was written for (its ``meta.json``): a folder copied or renamed
    by hand, or written before the key named code and versions, is refused naming what differs."""
    meta_file = cache / META
    if not meta_file.is_file():
        raise ConfigError(f"warm-up cache {cache} has no {META} (written by an older version, or copied by hand): "
                          f"delete it, or set warmup.cache_dir to another folder")
    written = json.loads(meta_file.read_text()).get("key", {})
    differ = sorted(k for k in set(key) | set(written) if key.get(k) != written.get(k))
    if differ:
        raise ConfigError(f"warm-up cache {cache} was written for other settings ({', '.join(differ)} differ): "
                          f"delete it, or set warmup.cache_dir to another folder")


def warm_up(cfg, actor: WarmupActor, warmup_example, pad_id: int, rank: int, log, should_stop=None) -> bool:
    """Warm up the policy (or load the cached result). Returns False when stopped by a signal: the steps
    done so far (model, optimiser, step) are saved next to the cache and a rerun continues from them."""
    import torch.distributed as dist

    if warmup_example is None:
        raise ConfigError("warmup.num_steps > 0 needs a task with warm-up examples (data.kind = synthetic)")
    from laconic_nemo.runtime.cpu_isa import cpu_isa, describe

    threads, isa = torch.get_num_threads(), cpu_isa()  # what this warm-up runs with
    key = warmup_cache_key(cfg, threads=threads, isa=isa)
    cache = warmup_cache_dir(cfg, threads=threads, isa=isa)
    shard = cache / CheckpointManager.shard_name(actor)
    partial = cache.with_name(cache.name + ".partial")
    total = cfg.warmup.num_steps
    made_by = (f"code {key['code']}, torch {key['versions']['torch']}, megatron-core "
               f"{key['versions']['megatron-core']}, {key['threads']} thread(s) per rank, {describe(isa)}")

    if (cache / "done").is_file():
        check_cache_meta(cache, key)
        actor.load_model_state(torch.load(shard, weights_only=False))
        log(f"warm-up: loaded cached policy {cache} ({made_by})")
    else:
        actor.set_learning_rate(cfg.warmup.lr)
        start = 0
        if (partial / "progress.json").is_file():
            start = int(json.loads((partial / "progress.json").read_text())["step"])
            actor.load_checkpoint_state(torch.load(partial / shard.name, weights_only=False))
            log(f"warm-up: continuing the interrupted warm-up at step {start + 1}/{total}")
        else:
            log(f"warm-up: {total} supervised steps, batch {cfg.warmup.batch_size} ({made_by})")
        losses = supervised_warmup(actor, warmup_example, total, cfg.warmup.batch_size,
                                   cfg.grpo.micro_batch_size, cfg.run.seed, pad_id, log=log,
                                   start_step=start, should_stop=should_stop)
        heartbeat("warmup_save", start + len(losses))  # saving is not a step: the watchdog's unscaled bound
        done_steps = start + len(losses)
        if done_steps < total:  # stopped by a signal: save what is done
            if rank == 0:
                if partial.exists():
                    shutil.rmtree(partial)
                partial.mkdir(parents=True)
            barrier()
            if actor.dp_rank == 0:
                torch.save(actor.state_dict_for_checkpoint(), partial / shard.name)
            barrier()
            if rank == 0:
                tmp = partial / "progress.json.tmp"
                tmp.write_text(json.dumps({"step": done_steps, "of": total}))
                os.replace(tmp, partial / "progress.json")
            barrier()
            log(f"warm-up: saved {done_steps}/{total} steps in {partial}")
            return False
        # rank 0 names the temporary folder (unique per process) and tells the other ranks
        tmp_list = [str(cache.with_name(f"{cache.name}.tmp{os.getpid()}"))]
        if dist.is_initialized():
            dist.broadcast_object_list(tmp_list, src=0)
        tmp = Path(tmp_list[0])
        if rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        barrier()
        if actor.dp_rank == 0:
            torch.save(actor.model_state(), tmp / shard.name)
        barrier()
        if rank == 0:
            (tmp / META).write_text(json.dumps({"key": key, "continued_from_step": start or None}, indent=1,
                                               sort_keys=True))
            (tmp / "done").write_text("ok")
            if cache.exists():  # another run with the same settings finished first: keep its copy
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                os.replace(tmp, cache)
            shutil.rmtree(partial, ignore_errors=True)
        barrier()
        log(f"warm-up: cached policy in {cache}")
    # RL starts from the warmed-up weights with a fresh optimiser at the RL learning rate; this
    # policy is also the reference for the KL term.
    actor.reset_optimizer(lr=cfg.optim.lr)
    actor.snapshot_reference()
    return True
