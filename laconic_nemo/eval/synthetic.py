"""The tiny synthetic task (``laconic_nemo/data/synthetic.py``) as an evaluation benchmark of its own.

* Problems: ``num_problems`` held-out problems of the run's task settings (``data.synthetic``), none of
  which is among the RL training prompts (``SyntheticTask.problems(data.num_prompts, run.seed)``, the
  list the trainer samples from). They are drawn per number of terms k from a generator of their own and
  interleaved k by k, so any prefix (``--limit``) has the task's mix of k; k has ``max_terms - min_terms + 1``
  values, each gets an equal quota, and a k whose unseen problems are fewer than its quota (k = 2: 100
  problems in all, nearly all of them among 2048 training prompts) contributes all of its unseen ones.
  Disjointness holds for the RL prompts only: the supervised warm-up draws its examples from the whole
  problem space (``SyntheticTask.warmup_example``), so the base policy has seen many short problems.
* Prompt: the training prompt itself (``Q:a3b5\\n``), no instruction; grading: the training reward's rule,
  the last ``\\boxed{}`` content equal to the answer digit (:class:`ExactAnswerGrader`).
* Policy: a run directory or checkpoint (the latest complete checkpoint, as ``resume: auto`` picks it), or
  the run's cached warm-up policy (the RL starting point, :func:`warmup_policy_dir`). The per-rank shards
  are merged offline (:func:`laconic_nemo.actors.megatron_shards.merge_rank_states`, the actor's own rules)
  and loaded into a one-process megatron-core actor at TP = PP = 1 (:class:`MegatronBackend`); samples come
  from the actor's own sampler (``MegatronCoreActor.generate``), the one training used.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import torch

from laconic_nemo.config import Config

BENCHMARK = "synthetic"
DISPLAY = "Synthetic"
WARMUP_DONE = "done"  # the marker the trainer writes into a complete warm-up cache folder


def _task(cfg):
    from laconic_nemo.data.synthetic import SyntheticTask

    return SyntheticTask(**dataclasses.asdict(cfg.data.synthetic))


def training_problems(cfg) -> list:
    """The RL prompts of run config ``cfg``: ``SyntheticTask.problems(data.num_prompts, seed=run.seed)``."""
    return _task(cfg).problems(cfg.data.num_prompts, seed=cfg.run.seed)


def heldout_problems(cfg, num_problems: int, seed: int = 0) -> list:
    """``num_problems`` (or fewer, see the module docstring) distinct synthetic problems of ``cfg``'s task,
    none of them a training prompt of ``cfg``; a function of (``cfg``'s task, ``num_problems``, ``seed``)."""
    from laconic_nemo.data.synthetic import Problem

    if num_problems < 1:
        raise ValueError(f"num_problems must be >= 1, got {num_problems}")
    task = _task(cfg)
    seen = {p.terms for p in training_problems(cfg)}
    ks = list(range(task.min_terms, task.max_terms + 1))
    quota = {k: num_problems // len(ks) + (i < num_problems % len(ks)) for i, k in enumerate(ks)}
    rng = random.Random(f"laconic-nemo/synthetic-heldout/{seed}")
    per_k: dict[int, list[tuple[int, ...]]] = {}
    for k in ks:
        unseen = 10**k - sum(len(t) == k for t in seen)
        want = min(quota[k], unseen)
        if 10**k <= 10_000:  # small spaces: draw from the enumerated unseen problems
            pool = [t for t in (tuple(int(c) for c in f"{i:0{k}d}") for i in range(10**k)) if t not in seen]
            per_k[k] = rng.sample(pool, want)
        else:
            picked: dict[tuple[int, ...], None] = {}
            while len(picked) < want:
                t = tuple(rng.randint(0, 9) for _ in range(k))
                if t not in seen:
                    picked[t] = None
            per_k[k] = list(picked)
    out = []
    for i in range(max(len(v) for v in per_k.values())):
        order = [k for k in ks if i < len(per_k[k])]
        rng.shuffle(order)
        out += [Problem(per_k[k][i]) for k in order]
    return out


def benchmark_problems(cfg, num_problems: int, limit: int | None = None, seed: int = 0) -> list:
    """The held-out problems as :class:`laconic_nemo.eval.benchmarks.Problem` rows (problem = the prompt text,
    answer = the digit), the first ``limit`` of them when given."""
    from laconic_nemo.eval.benchmarks import Problem

    probs = heldout_problems(cfg, num_problems, seed)[:limit]
    return [Problem(BENCHMARK, i, p.prompt, p.answer) for i, p in enumerate(probs)]


class ExactAnswerGrader:
    """The synthetic task's reward as a grader: 1.0 when the last ``\\boxed{}`` content, stripped, equals the
    reference string; statuses correct / wrong / no_answer (the training reward's rule, ``build_task``)."""

    def score(self, responses: list[str], answers: list[Any]):
        from laconic_nemo.rewards import RewardResult, exact_answer_status

        statuses = [exact_answer_status(text, ans) for text, ans in zip(responses, answers)]
        scores = [1.0 if s == "correct" else 0.0 for s in statuses]
        n = max(len(scores), 1)
        return RewardResult(scores, {"accuracy": sum(scores) / n}, statuses)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------------------------ policies
def run_config(path: str | Path):
    """The config of a run directory / checkpoint (its checkpoint's ``trainer_state.json``, else the run's
    ``config.yaml``) as a checked :class:`~laconic_nemo.config.Config`, with ``world_size`` (the training's process
    count, None when unknown) as a second value."""
    from laconic_nemo.config import load_config
    from laconic_nemo.grpo.resume import saved_config
    from laconic_nemo.tools.export import STATE, ExportError, resolve_checkpoint

    p = Path(path)
    try:
        ckpt = resolve_checkpoint(p)
        state = json.loads((ckpt / STATE).read_text())
        return saved_config(state, ckpt), state.get("world_size")
    except ExportError:
        if (p / "config.yaml").is_file():
            return load_config(p / "config.yaml"), None
        raise


def warmup_policy_dir(cfg, world_size: int, cache_root: str | Path | None = None) -> Path:
    """The warm-up cache folder the trainer wrote for run config ``cfg`` trained by ``world_size`` processes on this
    machine: ``<cache_root or warmup.cache_dir>/policy_<key digest>`` (the trainer's own key function, with the CPU
    kernels its ranks ran: :func:`laconic_nemo.runtime.cpu_isa.planned_cpu_isa`)."""
    from laconic_nemo.app.warmup import warmup_cache_dir  # lazily: the trainer's entry point, not needed elsewhere
    from laconic_nemo.runtime.cpu_isa import planned_cpu_isa

    name = warmup_cache_dir(cfg, world_size, isa=planned_cpu_isa()).name  # the CPU kernels the trainer's ranks ran
    root = Path(cache_root) if cache_root is not None else Path(str(cfg.warmup.cache_dir or ""))
    return root / name


def policy_state(path: str | Path, cfg: Config | dict | None = None, split_dims: dict[str, int] | None = None
                 ) -> tuple[dict[str, torch.Tensor], Config]:
    """(unsharded weights, run config) of a run directory / checkpoint folder, or of a warm-up cache folder
    (``policy_*``, holding ``done`` and ``model_tpXX_ppYY.pt``; its run config ``cfg`` must be given). Names as
    in ``MegatronCoreActor.full_state_dict``; the vocabulary padding is dropped ([V, H] rows).
    split_dims: local name -> TP concatenation dim, for shards that do not record theirs (warm-up caches): the
    ``tp_split_dims()`` of an actor of the same model."""
    from laconic_nemo.actors.megatron_shards import merge_rank_states
    from laconic_nemo.config import build_config
    from laconic_nemo.tools.export import SHARD, ExportError, read_checkpoint, resolve_checkpoint

    p = Path(path)
    shard_files = {f for f in p.iterdir() if SHARD.match(f.name)} if p.is_dir() else set()
    if shard_files and not (p / "trainer_state.json").is_file():  # a warm-up cache folder
        if not (p / WARMUP_DONE).is_file():
            raise ExportError(f"{p}: an incomplete warm-up cache (no '{WARMUP_DONE}' marker)")
        if cfg is None:
            raise ExportError(f"{p}: a warm-up cache folder has no config; give the run's config")
        cfg = build_config(cfg) if isinstance(cfg, dict) else cfg
        files = {tuple(int(x) for x in SHARD.match(f.name).groups()): f for f in shard_files}
        tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
        if set(files) != {(t, q) for t in range(tp) for q in range(pp)}:
            raise ExportError(f"{p}: shards {sorted(files)} do not match the run's TP {tp} x PP {pp}")
        states = {r: torch.load(f, map_location="cpu", weights_only=False) for r, f in files.items()}
        split = split_dims
    else:
        cfg, shards = read_checkpoint(resolve_checkpoint(p))
        states = {r: st["model"] for r, st in shards.items()}
        split = dict(shards[(0, 0)].get("parallel", {}).get("tp_split_dims") or {}) or split_dims
        tp, pp = max(t for t, _ in states) + 1, max(q for _, q in states) + 1
    if cfg.model.source != "synthetic":
        raise ExportError(f"{p}: model.source is {cfg.model.source!r}; the synthetic benchmark evaluates "
                          "synthetic-task runs (export Hugging Face runs with `laconic-nemo export`)")
    if tp > 1 and not split:
        raise ExportError(f"{p}: TP {tp} shards without their split dims; pass split_dims")
    full = merge_rank_states(states, tp, pp, cfg.model.num_layers, split or {}, vocab_size=cfg.model.vocab_size)
    return full, cfg


class MegatronBackend:
    """Evaluation backend over a one-process megatron-core actor (TP = PP = 1) of a synthetic-task run.

    ``load(path, cfg=None)`` puts a policy into it (see :func:`policy_state`); ``generate`` follows
    :mod:`laconic_nemo.eval.backends`: the n samples of each prompt are rows of one sampler call per
    ``batch_size`` rows (whole prompts per call), seeded by the first prompt's seed of that call, so a
    given chunk of problems always gets the same samples (also after a resume, which restarts at a chunk).
    """

    def __init__(self, cfg, batch_size: int = 256):
        from laconic_nemo.actors.megatron_core import MegatronCoreActor
        from laconic_nemo.config import build_config, to_dict
        from laconic_nemo.data.synthetic import CharTokenizer
        from laconic_nemo.runtime.megatron_env import init_distributed

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tokenizer = CharTokenizer()
        base = build_config(cfg if isinstance(cfg, dict) else to_dict(cfg))  # a copy: changed below
        base.parallel.tensor_model_parallel_size = 1
        base.parallel.pipeline_model_parallel_size = 1
        base.parallel.backend = "gloo"
        base.model.vocab_size = self.tokenizer.vocab_size
        base.grpo.kl_beta = 0.0
        self.cfg = base
        # this command is its own entry point: it sets up the one-process layout the actor reads
        init_distributed(1, 1, backend="gloo", seed=int(base.run.seed))
        self.actor = MegatronCoreActor.from_config(base)
        self.batch_size = batch_size
        self.eos_id = self.tokenizer.eos_id

    def load(self, path: str | Path, cfg: Config | dict | None = None) -> Config:
        """Load the policy at ``path``; returns its run config. Its architecture must equal this backend's."""
        full, run_cfg = policy_state(path, cfg, self.actor.tp_split_dims())
        for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings"):
            if getattr(run_cfg.model, key) != getattr(self.cfg.model, key):
                raise ValueError(f"{path}: model.{key} = {getattr(run_cfg.model, key)}, the backend was built with "
                                 f"{getattr(self.cfg.model, key)}")
        self.actor.load_full_state_dict(full)
        return run_cfg

    def generate(self, prompts: list[str], n: int, settings, seeds: list[int]):
        from laconic_nemo.eval.backends import Completion
        from laconic_nemo.grpo.interfaces import SamplingParams

        per_call = max(1, self.batch_size // n)
        out = []
        for a in range(0, len(prompts), per_call):
            group = prompts[a: a + per_call]
            rows = [self.tokenizer.encode(p) for p in group for _ in range(n)]
            sampling = SamplingParams(temperature=settings.temperature, top_p=settings.top_p,
                                      max_new_tokens=settings.max_tokens, eos_id=self.eos_id, seed=int(seeds[a]))
            gen = self.actor.generate(rows, sampling)
            for i in range(len(group)):
                comps = []
                for j in range(i * n, (i + 1) * n):
                    p0, length = int(gen.prompt_lengths[j]), int(gen.lengths[j])
                    body = gen.tokens[j, p0: p0 + length].tolist()
                    comps.append(Completion(self.tokenizer.decode(body), length,
                                            "length" if bool(gen.truncated[j]) else "stop"))
                out.append(comps)
        return out
