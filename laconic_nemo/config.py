"""The recipe schema (one dataclass per section, each field documented where it is defined) and recipe loading.

A recipe is a YAML file. It may name parent recipes in a ``defaults:`` list (paths relative to the
recipe's folder, ``.yaml`` optional); parents are merged first, in order, then the recipe itself,
then command-line overrides (OmegaConf dotlist, e.g. ``laconic.budget=1000``). The dataclasses below are
the schema and the defaults (OmegaConf structured configs: values are typed); ``recipes/base.yaml`` is
generated from them (``python -m laconic_nemo.config > recipes/base.yaml``; a test checks it is current).
An unknown key is an error naming it, so a typo never silently falls back to a default.

Values are checked once, here: each section's ``__post_init__`` checks its ranges, :class:`Config`'s the
rules across sections; :func:`check_layout` adds the rules of a (DP, TP, PP) layout (batch divisibility).
Below this boundary the code trusts its typed inputs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, List, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from laconic_nemo.core.dual import DualSettingError, check_dual
from laconic_nemo.core.shapers import SHAPERS
from laconic_nemo.kernels import ATTENTION_CHOICES, REFERENCE_CHOICES, SAMPLER_CHOICES

PACKAGE_RECIPES = Path(__file__).resolve().parent / "recipes"
REPO_RECIPES = Path(__file__).resolve().parent.parent / "recipes"


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key and the allowed values."""


class LayoutError(ConfigError):
    """The recipe does not fit the requested cluster layout; the message names the key."""


def _require(cond: bool, key: str, allowed: str, value) -> None:
    if not cond:
        raise ConfigError(f"{key} = {value!r} is invalid: allowed {allowed}")


def _fits(cond: bool, key: str, value, allowed: str) -> None:
    if not cond:
        raise LayoutError(f"{key} = {value!r} does not fit the layout: {allowed}")


def _one_of(key: str, value, choices) -> None:
    _require(value in choices, key, f"one of {', '.join(choices)}", value)


def opt(default: Any, doc: str = "", above: str = "") -> Any:
    """A schema field: its default, the comment written beside it in base.yaml and the block written above it."""
    meta = {"doc": doc, "above": above}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, doc: str = "") -> Any:
    return field(default_factory=cls, metadata={"doc": doc, "above": ""})


# ------------------------------------------------------------------------------------------------------------------
# sections (the order of the fields is the order of base.yaml)
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class RunConfig:
    name: str = opt("laconic", "run name; output goes to ${run.output_dir}")
    output_dir: str = opt("results/${run.name}")
    seed: int = opt(1234, "base seed (model init, data order, sampling streams)")
    num_steps: int = opt(500, "number of GRPO steps (one rollout batch + policy update + dual step each)")
    log_every: int = opt(1, "print a progress line every N steps (metrics.jsonl gets every step)")

    def __post_init__(self):
        _require(self.num_steps >= 1, "run.num_steps", "an integer >= 1", self.num_steps)


@dataclass
class ModelConfig:
    source: str = opt("synthetic", above="""Where the initial policy comes from:
  synthetic: a tiny randomly initialised GPT (CPU demo, tests); shape below
  hf:        a Hugging Face checkpoint directory (model.path), loaded through laconic_nemo.bridge
  nemo:      a .nemo checkpoint (model.path), NeMo-Aligner actor only (cluster path)""")
    path: Optional[str] = opt(None)
    num_layers: int = opt(2, above="Shape of the synthetic GPT (ignored for hf/nemo, which read it from the checkpoint).")
    hidden_size: int = opt(64)
    num_attention_heads: int = opt(4)
    ffn_hidden_size: int = opt(256)
    vocab_size: int = opt(64, "padded to a multiple of the TP size by the actor")
    max_position_embeddings: int = opt(512)
    precision: str = opt("fp32", "fp32 on CPU; bf16 on GPU")
    attention: str = opt("auto", above="""Core attention of the megatron-core GPT (laconic_nemo/kernels.py): te (TransformerEngine, NGC
container) | sdpa (torch scaled_dot_product_attention: flash / memory-efficient kernels on GPU) |
local (megatron's unfused DotProductAttention, [b, heads, s, s] scores) | auto (te > sdpa on GPU,
local on CPU). No parameters: checkpoints do not depend on it.""")

    def __post_init__(self):
        _one_of("model.source", self.source, ("synthetic", "hf", "nemo"))
        if self.source in ("hf", "nemo"):
            _require(bool(self.path), "model.path", "a checkpoint path when model.source is hf or nemo", self.path)
        _one_of("model.precision", self.precision, ("fp32", "bf16", "fp16"))
        _one_of("model.attention", self.attention, ATTENTION_CHOICES)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "TP; must divide the GPUs per node for good performance")
    pipeline_model_parallel_size: int = opt(1, "PP; world size must be divisible by TP x PP; DP = world / (TP x PP)")
    backend: str = opt("auto", "auto (nccl with CUDA, gloo on CPU) | nccl | gloo")
    collective_timeout_s: float = opt(600.0, above="""Hang detection (docs/reliability.md). A collective that waits longer than collective_timeout_s fails
on every rank (torch.distributed and megatron's groups; torch's default would be 30 min). The local
launcher's watchdog stops the run when no rank has made progress (a phase of a step, a warm-up step)
for watchdog_s, naming the stalled rank; exit status 4. Both inferred: above the slowest phase.""")
    watchdog_s: float = opt(600.0)

    def __post_init__(self):
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            _require(getattr(self, key) >= 1, f"parallel.{key}", "an integer >= 1", getattr(self, key))
        _require(self.backend in ("auto", "nccl", "gloo"), "parallel.backend", "auto, nccl or gloo", self.backend)
        for key in ("collective_timeout_s", "watchdog_s"):
            v = getattr(self, key)
            _require(math.isfinite(v) and v > 0, f"parallel.{key}", "a number of seconds > 0", v)


@dataclass
class OptimConfig:
    lr: float = opt(1.0e-6, "Adam learning rate (constant after warmup)")
    weight_decay: float = opt(0.0)
    adam_beta1: float = opt(0.9)
    adam_beta2: float = opt(0.999)
    adam_eps: float = opt(1.0e-8)
    warmup_steps: int = opt(0, "linear warmup in optimiser steps")
    grad_clip: float = opt(1.0, "global gradient-norm clip (0 disables)")

    def __post_init__(self):
        _require(self.lr > 0, "optim.lr", "> 0", self.lr)
        _require(self.grad_clip >= 0, "optim.grad_clip", ">= 0 (0 disables)", self.grad_clip)


@dataclass
class SyntheticConfig:
    min_terms: int = opt(2, "smallest k")
    max_terms: int = opt(8, "largest k")
    p_abbreviated: float = opt(0.15, "share of warm-up answers in the abbreviated style (boxed answer only)")
    p_compact: float = opt(0.25, "share in the compact style (running sums only); the rest are worked")
    max_filler: int = opt(4, 'worked / compact answers carry 0..max_filler "hmm. " phrases')


@dataclass
class DataConfig:
    kind: str = opt("math", "math (json/jsonl/parquet problem files) | synthetic (tiny CPU task)")
    train_files: List[str] = opt([], "list of files with `problem` and `answer` fields")
    prompt_template: str = opt("deepseek_r1", """a template of laconic_nemo/data/datasets.py TEMPLATES: deepseek_r1,
qwen_chat, plain, or the authors' prompt (EasyR1 math.jinja) in a model's
chat template: deepseek_r1_easyr1_math, qwen3_easyr1_math, qwen_math_easyr1_math""")
    shuffle: bool = opt(True)
    num_prompts: int = opt(4096, "synthetic: size of the RL prompt set (problems drawn with run.seed)")
    target_length_range: Optional[List[int]] = opt(None, "e.g. [100, 4000] (L1 paper)", above="""Per-prompt target lengths n_gold for the L1 baselines (l1_exact / l1_max): drawn uniformly from
[min, max] for every prompt of every step (a function of run.seed, step and prompt), stated in the
prompt with target_instruction, handed to the shaper. null: no targets (other shapers).""")
    target_instruction: str = opt(" Think for {target} tokens.")
    synthetic: SyntheticConfig = section(SyntheticConfig, "synthetic task (laconic_nemo.data.synthetic): sum mod 10 "
                                                          "of k digits")

    def __post_init__(self):
        rng = self.target_length_range
        if rng is not None:
            _require(len(rng) == 2 and 1 <= rng[0] <= rng[1], "data.target_length_range",
                     "[min, max] with 1 <= min <= max, or null", list(rng))


@dataclass
class WarmupConfig:
    num_steps: int = opt(0)
    batch_size: int = opt(64, "sequences per step (GLOBAL)")
    lr: float = opt(1.0e-3)
    cache_dir: Optional[str] = opt(None, """reuse a warmed-up policy across runs with the same model/warmup/layout
(null: ${run.output_dir}/warmup)""")


@dataclass
class GRPOConfig:
    num_prompts_per_step: int = opt(128, "prompts per step (GLOBAL, over all DP ranks)")
    group_size: int = opt(8, "G responses sampled per prompt")
    minibatch_size: int = opt(256, "responses per optimiser step (GLOBAL); rollout batch / minibatch = steps per "
                                   "rollout")
    micro_batch_size: int = opt(4, "responses per forward/backward on one DP rank")
    clip_eps: float = opt(0.2, "epsilon of the clipped ratio (lower side; and upper side unless clip_eps_high)")
    clip_eps_high: Optional[float] = opt(None, "optional larger upper clip (DAPO clip-higher); null = clip_eps")
    clip_dual: Optional[float] = opt(None, """dual-clip PPO constant C > 1: for A < 0 the token loss is capped at C |A|
(EasyR1 clip_ratio_dual 3.0); null = off""")
    kl_beta: float = opt(0.0, "beta of KL(pi || pi_ref) (k3 estimator); 0 disables the reference policy")
    loss_aggregation: str = opt("seq_mean_token_mean", "seq_mean_token_mean (paper: mean over tokens, then "
                                                       "sequences) | token_mean")
    advantage_eps: float = opt(1.0e-6, "eps in (l - mean) / (std + eps)")
    advantage_std: str = opt("unbiased", """std of the group: unbiased (divide by G - 1: torch.std, EasyR1 / the authors)
| population (divide by G); unbiased makes advantages sqrt((G-1)/G) smaller""")
    leave_one_out: bool = opt(False, "leave-one-out group mean")
    sort_by_length: bool = opt(True, """megatron-core actor, PP = 1: micro-batches of rows of similar length, each cut
to its longest row (less padding; the same gradient up to float rounding)""")
    logprob_chunk_size: int = opt(1024, """megatron-core actor: log-probs in chunks of this many positions (bounds the
float32 copy of the [b, s, V/tp] logits; recomputed in backward)""")
    reference_on: str = opt("auto", """megatron-core actor, kl_beta > 0: where pi_ref's weights live: device (beside
the weights, swapped by pointer, no copy; on CPU too) | pinned (GPU only: pinned
host memory, async copies; for models whose second copy does not fit) |
cpu (pageable host memory, copies) | auto (device)""")

    def __post_init__(self):
        _require(self.num_prompts_per_step >= 1, "grpo.num_prompts_per_step", "an integer >= 1",
                 self.num_prompts_per_step)
        _require(self.group_size >= 2, "grpo.group_size", "an integer >= 2 (group advantages need G >= 2)",
                 self.group_size)
        rollout_size = self.num_prompts_per_step * self.group_size
        _require(self.minibatch_size >= 1 and rollout_size % self.minibatch_size == 0, "grpo.minibatch_size",
                 f"a divisor of num_prompts_per_step * group_size = {rollout_size}", self.minibatch_size)
        _require(self.micro_batch_size >= 1, "grpo.micro_batch_size", "an integer >= 1", self.micro_batch_size)
        _require(0 < self.clip_eps < 1, "grpo.clip_eps", "in (0, 1)", self.clip_eps)
        if self.clip_eps_high is not None:
            _require(self.clip_eps_high >= self.clip_eps, "grpo.clip_eps_high", ">= grpo.clip_eps or null",
                     self.clip_eps_high)
        if self.clip_dual is not None:
            _require(self.clip_dual > 1, "grpo.clip_dual", "> 1 or null", self.clip_dual)
        _require(self.advantage_std in ("unbiased", "population"), "grpo.advantage_std", "unbiased or population",
                 self.advantage_std)
        _require(math.isfinite(self.advantage_eps) and self.advantage_eps >= 0, "grpo.advantage_eps",
                 "a finite number >= 0", self.advantage_eps)
        _require(self.kl_beta >= 0, "grpo.kl_beta", ">= 0", self.kl_beta)
        _require(self.loss_aggregation in ("seq_mean_token_mean", "token_mean"), "grpo.loss_aggregation",
                 "seq_mean_token_mean or token_mean", self.loss_aggregation)
        _one_of("grpo.reference_on", self.reference_on, REFERENCE_CHOICES)
        _require(self.logprob_chunk_size >= 1, "grpo.logprob_chunk_size", ">= 1", self.logprob_chunk_size)


@dataclass
class LaconicConfig:
    shaper: str = opt("laconic", " | ".join(SHAPERS) + " (laconic_nemo/core/shapers.py)")
    budget: float = opt(1500, "B, token budget on the mean response length")
    eta: float = opt(0.002, "dual step size")
    ceiling: Optional[float] = opt(None, "Lambda; null = B / (L_max - B)")
    lambda_init: float = opt(0.0, """initial lambda, in [0, Lambda] (and the constant lambda of the `fixed` shaper);
below `floor` it is used as is for step 1 and clipped by the first dual step""")
    floor: float = opt(0.0, "lower clip of lambda (authors' DeepScaleR script: 1e-5)")
    controller: str = opt("integral", above="""lambda controller on the error e = mean_L / B - 1: integral (the paper: lambda += eta * e, clipped) |
pid (PID Lagrangian, Stooke et al. 2020: lambda = I + kp * e + kd * (e - e_prev), I += eta * e, clipped
into [floor, Lambda] and held while lambda is saturated; laconic_nemo/core/dual.py). kp = kd = 0 with pid
is the integral controller. Choose gains with `laconic-nemo simulate` (beyond the paper).""")
    kp: float = opt(0.0, "proportional gain >= 0 (pid only)")
    kd: float = opt(0.0, "derivative gain >= 0 (pid only)")
    penalty_cap: Optional[float] = opt(None, "cap on the per-response penalty lambda * c (authors' code: 0.4)")
    hit_cap: float = opt(0.0, "extra penalty for responses truncated at L_max (authors' code: 0.1)")
    count_eos: bool = opt(False, """L counts the EOS token (EasyR1's response mask) and a response with L = L_max
gets hit_cap even when it ended on EOS (authors' runs); false: paper form""")
    alpha: Optional[float] = opt(None, "coefficient of l1_exact / l1_max / efficient (null = method default)")
    overlong_buffer: int = opt(512, "DAPO overlong shaping: buffer length")
    overlong_penalty: float = opt(1.0, "DAPO overlong shaping: maximal penalty")

    def __post_init__(self):
        _one_of("laconic.shaper", self.shaper, tuple(SHAPERS))
        _require(math.isfinite(self.budget) and self.budget > 0, "laconic.budget", "a number > 0 (tokens)",
                 self.budget)
        _require(self.lambda_init >= 0, "laconic.lambda_init",
                 ">= 0 (below laconic.floor is allowed: the first dual step clips it)", self.lambda_init)
        for key in ("penalty_cap", "alpha"):
            v = getattr(self, key)
            if v is not None:
                _require(math.isfinite(v) and v > 0, f"laconic.{key}", "null or a finite number > 0", v)
        for key in ("hit_cap", "overlong_penalty"):
            v = getattr(self, key)
            _require(math.isfinite(v) and v >= 0, f"laconic.{key}", "a finite number >= 0", v)


@dataclass
class RewardConfig:
    kind: str = opt("math", "math (boxed answer + math-verify) | synthetic (the tiny CPU task's checker)")
    num_workers: int = opt(2, "grading worker processes")
    timeout_s: float = opt(5.0, "hard per-item timeout; a timed-out item scores 0")
    format_weight: float = opt(0.0, "authors' code: 0.1 -> reward = 0.9 * accuracy + 0.1 * format")
    format: str = opt("boxed", """format term: boxed (a final \\boxed{} answer) | think_boxed (the authors':
<think>...</think> then \\boxed{}, laconic_nemo/rewards/format.py)""")

    def __post_init__(self):
        _require(self.kind in ("math", "synthetic"), "reward.kind", "math or synthetic", self.kind)
        _require(self.timeout_s > 0, "reward.timeout_s", "> 0 seconds", self.timeout_s)
        _require(0 <= self.format_weight < 1, "reward.format_weight", "in [0, 1)", self.format_weight)
        _require(self.format in ("boxed", "think_boxed"), "reward.format", "boxed or think_boxed", self.format)


@dataclass
class VllmConfig:
    gpu_memory_utilization: float = opt(0.5, "share of GPU memory for vLLM's weights + KV cache")
    colocate: bool = opt(True, """on the training GPUs; vLLM sleeps (frees its memory) while the policy trains.
Only true is accepted: separate vLLM GPUs need a weight channel (not implemented)""")
    max_model_len: Optional[int] = opt(None, "null: vLLM's default from the checkpoint")
    dtype: str = opt("bfloat16")

    def __post_init__(self):
        # Separate-GPU vLLM has no weight channel: every rank's engine would land on cuda:0 (vLLM's UniProcExecutor)
        # and the in-process refit cannot cross to vLLM's TP worker processes.
        _require(bool(self.colocate), "rollout.vllm.colocate", "true (vLLM on separate GPUs is not implemented)",
                 self.colocate)


@dataclass
class RolloutConfig:
    engine: str = opt("megatron", "megatron (in-process sampler) | vllm (GPU) | nemo (NeMo-Aligner generation)")
    max_new_tokens: int = opt(4096, "L_max during training")
    temperature: float = opt(1.0, "sampling temperature; old, new and reference log-probs use it too (verl dp_actor)")
    top_p: float = opt(1.0)
    sampler: str = opt("auto", """exact (host float64 loop, per-sample torch generators) | device (all on the
GPU, counter-based per-sample uniforms) | auto (device on GPU, exact on CPU)""",
                       above="megatron engine only (laconic_nemo/rollout/megatron_sampler.py):")
    sync_every: int = opt(8, "device sampler: decode steps between host synchronisations")
    compact: bool = opt(True, "device sampler: drop finished rows from the batch and KV cache at each sync")
    vllm: VllmConfig = section(VllmConfig, "rollout.engine = vllm (GPU, model.source = hf): laconic_nemo/rollout/vllm.py")

    def __post_init__(self):
        _require(self.max_new_tokens >= 1, "rollout.max_new_tokens", "an integer >= 1", self.max_new_tokens)
        _require(self.temperature > 0, "rollout.temperature", "> 0", self.temperature)
        _require(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        _require(self.engine in ("megatron", "vllm", "nemo"), "rollout.engine", "megatron, vllm or nemo", self.engine)
        _one_of("rollout.sampler", self.sampler, SAMPLER_CHOICES)
        _require(self.sync_every >= 1, "rollout.sync_every", ">= 1", self.sync_every)


@dataclass
class CheckpointConfig:
    every_n_steps: int = opt(50, "write a checkpoint every N steps (and at the end, and on SIGUSR1/SIGTERM)")
    keep_last: int = opt(2, "how many checkpoints to keep")
    resume: str = opt("auto", """auto (latest in ${run.output_dir}/checkpoints if any) | never | <path>
(never refuses an output_dir that already holds a run)""")
    resume_allow_changes: List[str] = opt([], above="""Keys allowed to differ from the resumed checkpoint's config (e.g. [run.seed, laconic.eta]); any other
difference refuses the resume, listing every key. Run length, logging, checkpoint and warm-up keys,
timeouts and reward.num_workers may always change (laconic_nemo/grpo/resume.py).""")
    export_hf: bool = opt(False, above="""true: when training finishes, write the final policy as a Hugging Face folder ${run.output_dir}/hf
(what `laconic-nemo export RUN --to hf OUT` writes). Needs model.source = hf: the synthetic GPT has no
Hugging Face architecture. Runs on rank 0 after the final checkpoint while the other ranks wait, so it
must fit in parallel.collective_timeout_s / watchdog_s. Framework default: false.""")

    def __post_init__(self):
        _require(self.every_n_steps >= 0, "checkpoint.every_n_steps", ">= 0 (0: only at the end)",
                 self.every_n_steps)
        _require(self.keep_last >= 1, "checkpoint.keep_last", "an integer >= 1", self.keep_last)


@dataclass
class LoggingConfig:
    plot: bool = opt(True, "write ${run.output_dir}/training_curves.png at the end")
    rank_trace: bool = opt(False, """every rank appends lambda (exact hex float), global mean length and its
DP rank to ${run.output_dir}/rank_trace/rank<r>.jsonl (consistency checks)""")
    tensorboard: Optional[bool] = opt(None, """null: on when the tensorboard package is installed |
true: required (refused at start without it) | false: off""", above="""Live dashboards (laconic_nemo/grpo/metrics.py), rank 0: every number of a metrics.jsonl row (lambda,
lengths, budget shares, rewards, pass rates, timings) at the row's step; a resumed run continues the same
curves without duplicate steps. `tensorboard --logdir <output_dir>/tensorboard` opens the dashboard.
Defaults as NeMo's exp_manager (framework default): TensorBoard on, W&B off.""")
    tensorboard_dir: Optional[str] = opt(None, """event files; null: ${run.output_dir}/tensorboard
(NeMo-Aligner actor: ${run.output_dir}/nemo_logs/tensorboard, in NeMo's exp_manager log dir)""")
    wandb: bool = opt(False, "a Weights & Biases run (needs the wandb package)")
    wandb_project: str = opt("laconic-nemo")
    wandb_name: Optional[str] = opt(None, "run name; null: run.name")
    wandb_entity: Optional[str] = opt(None, "team or user; null: the account's default")
    wandb_mode: str = opt("online", """online | offline (no account or network: files under ${run.output_dir}/wandb,
uploaded later with `wandb sync`)""")

    def __post_init__(self):
        _one_of("logging.wandb_mode", self.wandb_mode, ("online", "offline"))
        _require(bool(self.wandb_project), "logging.wandb_project", "a non-empty W&B project name",
                 self.wandb_project)


BASE_HEADER = """Base configuration shared by every recipe. A recipe names this file in `defaults:` and overrides
what differs. Every key is documented here, where it is defined; `laconic-nemo plan` rejects keys
that are not defined here. GENERATED from the dataclasses of laconic_nemo/config.py: edit those and run
`python -m laconic_nemo.config > recipes/base.yaml`.

Notation as in the paper: B = laconic.budget, L_max = rollout.max_new_tokens, G = grpo.group_size,
eta = laconic.eta, Lambda = laconic.ceiling."""


@dataclass
class Config:
    """A whole recipe: one field per section of recipes/base.yaml."""

    run: RunConfig = section(RunConfig)
    model: ModelConfig = section(ModelConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    optim: OptimConfig = section(OptimConfig)
    data: DataConfig = section(DataConfig)
    warmup: WarmupConfig = section(WarmupConfig, "supervised warm-up of the initial policy before RL (0 steps: none)")
    grpo: GRPOConfig = section(GRPOConfig)
    laconic: LaconicConfig = section(LaconicConfig)
    reward: RewardConfig = section(RewardConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)

    def __post_init__(self):
        """The rules across sections."""
        lc, lmax = self.laconic, self.rollout.max_new_tokens
        if lc.shaper in ("laconic", "linear", "fixed"):
            _require(lmax > lc.budget, "laconic.budget", f"< rollout.max_new_tokens = {lmax} (L_max must exceed B)",
                     lc.budget)
        # the lambda controller's settings, by its own check (core.dual.check_dual); the other shapers build no
        # controller, but its keys still hold valid values (their lambda_init is not bounded by a ceiling)
        adaptive = lc.shaper in ("laconic", "linear")
        try:
            check_dual(lc.budget, lc.eta, lc.ceiling, lc.floor, lc.lambda_init if adaptive else 0.0, lc.controller,
                       lc.kp, lc.kd, lmax if adaptive else None)
        except DualSettingError as exc:
            raise ConfigError(f"{_DUAL_KEYS.get(exc.key, 'laconic.' + exc.key)} = {exc.value!r} is invalid: allowed "
                              f"{exc.allowed}") from None
        if lc.shaper == "overlong":
            _require(0 < lc.overlong_buffer <= lmax, "laconic.overlong_buffer",
                     f"a number of tokens in (0, rollout.max_new_tokens = {lmax}]", lc.overlong_buffer)
        _require(not self.checkpoint.export_hf or self.model.source == "hf", "checkpoint.export_hf",
                 f"false with model.source = {self.model.source} (only hf runs have a Hugging Face architecture)",
                 self.checkpoint.export_hf)
        for key in self.checkpoint.resume_allow_changes:
            node: Any = self
            for part in str(key).split("."):
                node = getattr(node, part, _MISSING) if dataclasses.is_dataclass(node) else _MISSING
            _require(node is not _MISSING, "checkpoint.resume_allow_changes", "a list of config keys (e.g. [run.seed])",
                     str(key))


_MISSING = object()
# core.dual.check_dual's argument names -> recipe keys
_DUAL_KEYS = {"init": "laconic.lambda_init", "max_length": "rollout.max_new_tokens"}


def check_layout(cfg: Any, dp: int) -> None:
    """The batch rules of a layout with ``dp`` data-parallel ranks (``plan``, the trainer and the warm-up).

    Every DP rank holds whole groups of G responses, the global rollout batch splits into optimiser minibatches,
    each minibatch into DP x micro-batches, and the warm-up batch over DP. Raises LayoutError naming the key."""
    g = cfg.grpo
    prompts, G, mini, mbs = int(g.num_prompts_per_step), int(g.group_size), int(g.minibatch_size), int(g.micro_batch_size)
    rollout = prompts * G
    _fits(prompts % dp == 0, "grpo.num_prompts_per_step", prompts,
          f"divisible by DP = {dp} so that every data-parallel rank holds whole groups of G = {G}")
    _fits(rollout % mini == 0, "grpo.minibatch_size", mini,
          f"a divisor of the rollout batch num_prompts_per_step x G = {rollout}")
    _fits(mini % dp == 0, "grpo.minibatch_size", mini, f"divisible by DP = {dp}")
    _fits(mini % (dp * mbs) == 0, "grpo.micro_batch_size", mbs,
          f"DP x micro_batch_size = {dp} x {mbs} must divide grpo.minibatch_size = {mini}")
    if int(cfg.warmup.num_steps) > 0:
        _fits(int(cfg.warmup.batch_size) % dp == 0, "warmup.batch_size", int(cfg.warmup.batch_size),
              f"divisible by DP = {dp}")


# ------------------------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------------------------
def base_config_path() -> Path:
    for folder in (REPO_RECIPES, PACKAGE_RECIPES):
        if (folder / "base.yaml").is_file():
            return folder / "base.yaml"
    raise ConfigError("recipes/base.yaml not found next to the package")


def resolve_recipe_path(name: str | Path) -> Path:
    """A recipe path, or a bare recipe name looked up in the recipes folder."""
    p = Path(name)
    # Recipe names contain dots (deepscaler_1.5b_b2000), so ".yaml" is appended, never substituted.
    candidates = [p] if p.name.endswith(".yaml") else [p, p.with_name(p.name + ".yaml")]
    for folder in (REPO_RECIPES, PACKAGE_RECIPES):
        candidates += [folder / p.name, folder / f"{p.name}.yaml"]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise ConfigError(f"recipe {str(name)!r} not found (looked for {', '.join(str(c) for c in candidates[:4])})")


def _load_with_defaults(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    if path in seen:
        raise ConfigError(f"recipe defaults form a cycle: {' -> '.join(str(s) for s in (*seen, path))}")
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: YAML syntax error: {getattr(exc, 'problem', None) or exc}") from exc
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: a recipe must be a mapping")
    parents = raw.pop("defaults", None) or []
    if isinstance(parents, (str,)):
        parents = [parents]
    if not isinstance(parents, (list, ListConfig)):
        raise ConfigError(f"{path}: `defaults` must be a list of recipe names")
    merged = OmegaConf.create({})
    for parent in parents:
        parent_path = path.parent / str(parent)
        if not parent_path.name.endswith(".yaml"):
            parent_path = parent_path.with_name(parent_path.name + ".yaml")
        if not parent_path.is_file():
            raise ConfigError(f"{path}: defaults entry {parent!r} not found at {parent_path}")
        merged = OmegaConf.merge(merged, _load_with_defaults(parent_path.resolve(), (*seen, path)))
    return OmegaConf.merge(merged, raw)


def _check_known_keys(cfg: DictConfig, schema: type, prefix: str = "") -> None:
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"unknown config key {dotted!r} (known keys here: {', '.join(sorted(fields))})")
        sub_schema = hints[key]
        if dataclasses.is_dataclass(sub_schema):
            sub = cfg[key]
            if not isinstance(sub, DictConfig):
                raise ConfigError(f"{dotted} = {sub!r} is invalid: allowed a mapping of the keys "
                                  f"{', '.join(sorted(f.name for f in dataclasses.fields(sub_schema)))}")
            _check_known_keys(sub, sub_schema, prefix=f"{dotted}.")


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}


def _kind(annotation: Any) -> tuple[type, bool]:
    """(int | float | bool | str | list, nullable) of a field annotation."""
    nullable = False
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation, nullable = args[0], True
    if typing.get_origin(annotation) in (list, List):
        return list, nullable
    return annotation, nullable


def _type_ok(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, (list, ListConfig))
    return isinstance(value, kind)


def check_types(cfg: DictConfig, schema: type = None, prefix: str = "") -> None:
    """Every value has its field's type (an integer key refuses 2.7 and "abc", a list key refuses a string, a
    number key takes integers); ``Optional`` fields also take null."""
    schema = Config if schema is None else schema
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in cfg:
            continue
        dotted, value, annotation = f"{prefix}{f.name}", cfg[f.name], hints[f.name]
        if dataclasses.is_dataclass(annotation):
            check_types(value, annotation, f"{dotted}.")
            continue
        kind, nullable = _kind(annotation)
        if value is None and nullable:
            continue
        if not _type_ok(value, kind):
            hint = f" (write a list: {dotted}=[{value}])" if kind is list and isinstance(value, str) else ""
            allowed = _TYPE_WORDS[kind] + (" or null" if nullable else "")
            raise ConfigError(f"{dotted} = {value!r} is invalid: allowed {allowed}{hint}")


def load_config(path: str | Path, overrides: Iterable[str] = (), validate: bool = True) -> DictConfig:
    """Load ``path`` with its defaults chain and ``overrides``; reject unknown keys and mistyped values.

    Returns a resolved, typed DictConfig of :class:`Config` (interpolations such as ``${run.name}`` expanded),
    checked by the sections' ``__post_init__`` unless ``validate`` is False."""
    recipe = resolve_recipe_path(path)
    cfg = _load_with_defaults(recipe)
    _check_known_keys(cfg, Config)
    overrides = list(overrides)
    if overrides:
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like key=value")
        try:
            ov = OmegaConf.from_dotlist(overrides)
        except Exception as exc:  # omegaconf raises several grammar errors
            raise ConfigError(f"cannot parse overrides {overrides}: {exc}") from exc
        _check_known_keys(ov, Config)
        cfg = OmegaConf.merge(cfg, ov)
    return build_config(cfg, validate=validate)


def build_config(values: Any, validate: bool = True) -> DictConfig:
    """The typed config from a mapping of recipe values (missing keys take their defaults): unknown keys and
    mistyped values raise ConfigError naming the key; then the ranges are checked unless ``validate`` is False."""
    cfg = values if isinstance(values, DictConfig) else OmegaConf.create(values)
    _check_known_keys(cfg, Config)
    # untyped first (the type check names the key in this module's words), typed once the values passed it
    plain = OmegaConf.merge(OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(Config))), cfg)
    OmegaConf.resolve(plain)
    check_types(plain)
    typed = OmegaConf.merge(OmegaConf.structured(Config), plain)
    if validate:
        validate_config(typed)
    return typed


def validate_config(cfg: DictConfig) -> None:
    """The sections' range checks and the rules across sections (:class:`Config`). Raises ConfigError."""
    OmegaConf.to_object(cfg)


# ------------------------------------------------------------------------------------------------------------------
# recipes/base.yaml, generated from the dataclasses
# ------------------------------------------------------------------------------------------------------------------
def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        if "e" in text:
            mantissa, exp = text.split("e")
            text = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{int(exp)}"
        return text
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, str):
        plain = value == value.strip() and "#" not in value and ": " not in value and yaml.safe_load(value) == value
        return value if plain and value else json.dumps(value)
    return str(value)


def _comment_block(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}".rstrip() for line in text.splitlines()]


def _render(schema: type, indent: str) -> list[str]:
    lines: list[str] = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.metadata.get("above"):
            lines += _comment_block(f.metadata["above"], indent)
        doc = f.metadata.get("doc", "").splitlines()
        if dataclasses.is_dataclass(hints[f.name]):
            head = f"{indent}{f.name}:"
            body = _render(hints[f.name], indent + "  ")
        else:
            head = f"{indent}{f.name}: {_scalar(f.default_factory() if f.default is dataclasses.MISSING else f.default)}"
            body = []
        if doc:
            col = max(len(head) + 2, 31)
            lines.append(f"{head.ljust(col)}# {doc[0]}")
            lines += [f"{' ' * col}# {line}" for line in doc[1:]]
        else:
            lines.append(head)
        lines += body
        if not indent:
            lines.append("")
    return lines


def render_base_yaml() -> str:
    """The text of recipes/base.yaml: every key, its default and its documentation."""
    return "\n".join([*_comment_block(BASE_HEADER, ""), "", *_render(Config, "")]).rstrip() + "\n"


if __name__ == "__main__":
    print(render_base_yaml(), end="")
