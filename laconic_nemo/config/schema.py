"""The recipe schema: one dataclass per section, each field documented where it is defined (its comment in
recipes/base.yaml) with its allowed values, each section's ``__post_init__`` its rules across fields,
:class:`Config`'s the rules across sections, :func:`check_layout` the rules of a (DP, TP, PP) layout."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, List, Optional

from laconic_nemo.config.fields import (
    SYNTHETIC_ALPHABET,
    SYNTHETIC_MAX_TERMS,
    ConfigError,
    fits,
    opt,
    require,
    section,
    states_a_target,
    synthetic_unencodable,
)
from laconic_nemo.core.constraints import CarryOver
from laconic_nemo.core.dual import CONTROLLERS, DualSettingError, DualSettings
from laconic_nemo.core.shapers import SHAPERS
from laconic_nemo.runtime.kernels import ATTENTION_CHOICES, REFERENCE_CHOICES, SAMPLER_CHOICES


# ------------------------------------------------------------------------------------------------------------------
# sections (the order of the fields is the order of base.yaml)
# ------------------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class RunConfig:
    name: str = opt("laconic", "run name; output goes to ${run.output_dir}")
    output_dir: str = opt("results/${run.name}")
    seed: int = opt(1234, "base seed (model init, data order, sampling streams); < 2^24: the seeds derived from it "
                          "fit 64 bits", ge=0, lt=2**24)
    num_steps: int = opt(500, "number of GRPO steps (one rollout batch + policy update + dual step each)", ge=1)
    log_every: int = opt(1, "print a progress line every N steps (metrics.jsonl gets every step)", ge=1)


@dataclass(slots=True)
class ModelConfig:
    source: str = opt("synthetic", choices=("synthetic", "hf", "nemo"), above="""Where the initial policy comes from:
  synthetic: a tiny randomly initialised GPT (CPU demo, tests); shape below
  hf:        a Hugging Face checkpoint directory (model.path), loaded through laconic_nemo.bridge
  nemo:      a .nemo checkpoint (model.path), NeMo-Aligner actor only (cluster path)""")
    path: Optional[str] = opt(None)
    shape_from: Optional[str] = opt(None, above="""synthetic only: a Hugging Face config.json (or its folder) whose architecture and vocabulary the
synthetic GPT takes, weights random (the bridge's layer: RMSNorm, SwiGLU, GQA, its RoPE base). The
synthetic task's character ids are its first ids; a response rarely draws EOS from so large a
vocabulary, so it runs to rollout.max_new_tokens. A published model's step without its weights
(recipes/gpu_check_1.5b.yaml, benchmarks/paper_step.py); null: the shape keys below""")
    num_layers: int = opt(2, ge=1,
                          above="Shape of the synthetic GPT (ignored for hf/nemo, which read it from the checkpoint).")
    hidden_size: int = opt(64, "a multiple of num_attention_heads", ge=1)
    num_attention_heads: int = opt(4, ge=1)
    num_query_groups: Optional[int] = opt(None, """key-value heads (grouped-query attention); null: num_attention_heads.
hf / nemo read it from the checkpoint; plan sizes the KV cache with it
when the checkpoint is not readable there""", ge=1)
    ffn_hidden_size: int = opt(256, ge=1)
    vocab_size: int = opt(64, "padded to a multiple of the TP size by the actor", ge=1)
    max_position_embeddings: int = opt(512, ge=2)
    precision: str = opt("fp32", "fp32 on CPU; bf16 on GPU", choices=("fp32", "bf16", "fp16"))
    attention: str = opt("auto", choices=ATTENTION_CHOICES, above="""Core attention of the megatron-core GPT (laconic_nemo/runtime/kernels.py): te (TransformerEngine, NGC
container) | sdpa (torch scaled_dot_product_attention: flash / memory-efficient kernels on GPU) |
local (megatron's unfused DotProductAttention, [b, heads, s, s] scores) | auto (te > sdpa on GPU,
local on CPU). No parameters: checkpoints do not depend on it.""")

    def __post_init__(self):
        if self.source in ("hf", "nemo"):
            require(bool(self.path), "model.path", "a checkpoint path when model.source is hf or nemo", self.path)
        else:  # megatron splits the hidden size into equal heads (hf / nemo checkpoints state their own shape)
            require(self.hidden_size % self.num_attention_heads == 0, "model.hidden_size",
                     f"a multiple of model.num_attention_heads = {self.num_attention_heads}", self.hidden_size)
        require(self.shape_from is None or self.source == "synthetic", "model.shape_from",
                 f"null with model.source = {self.source} (the checkpoint states its own shape)", self.shape_from)
        q = self.num_query_groups
        require(q is None or (q >= 1 and self.num_attention_heads % q == 0), "model.num_query_groups",
                 f"null or a divisor of model.num_attention_heads = {self.num_attention_heads}", q)


@dataclass(slots=True)
class ParallelConfig:
    tensor_model_parallel_size: int = opt(1, "TP; must divide the GPUs per node for good performance", ge=1)
    pipeline_model_parallel_size: int = opt(1, "PP; world size must be divisible by TP x PP; DP = world / (TP x PP)",
                                            ge=1)
    backend: str = opt("auto", "auto (nccl with CUDA, gloo on CPU) | nccl | gloo", choices=("auto", "nccl", "gloo"))
    collective_timeout_s: float = opt(600.0, above="""Hang detection (docs/reliability.md). A collective that waits longer than collective_timeout_s fails
on every rank (torch.distributed and megatron's groups; torch's default would be 30 min). The local
launcher's watchdog stops the run when no rank has made progress (a phase of a step, a warm-up step),
naming the stalled rank; exit status 4. Inside a GRPO or warm-up step, once this process has finished one,
the bound is max(watchdog_min_s, watchdog_step_factor x the longest step so far) (a 4 s step: 60 s);
elsewhere (start-up, the first step, checkpoints, export) it is watchdog_s. All inferred: above the
slowest phase (a step varies far less than 10x between steps).""", gt=0)
    watchdog_s: float = opt(600.0, gt=0)
    watchdog_step_factor: float = opt(10.0, "0: watchdog_s everywhere", ge=0)
    watchdog_min_s: float = opt(60.0, gt=0)


@dataclass(slots=True)
class OptimConfig:
    lr: float = opt(1.0e-6, "Adam learning rate (constant after warmup)", gt=0)
    weight_decay: float = opt(0.0, ge=0)
    adam_beta1: float = opt(0.9, ge=0, lt=1)
    adam_beta2: float = opt(0.999, ge=0, lt=1)
    adam_eps: float = opt(1.0e-8, gt=0)
    warmup_steps: int = opt(0, "linear warmup in optimiser steps", ge=0)
    grad_clip: float = opt(1.0, "global gradient-norm clip (0 disables)", ge=0)


@dataclass(slots=True)
class SyntheticConfig:
    min_terms: int = opt(2, "smallest k", ge=2, le=SYNTHETIC_MAX_TERMS)
    max_terms: int = opt(8, "largest k (>= min_terms)", ge=2, le=SYNTHETIC_MAX_TERMS)
    p_abbreviated: float = opt(0.15, "share of warm-up answers in the abbreviated style (boxed answer only)", ge=0, le=1)
    p_compact: float = opt(0.25, "share in the compact style (running sums only); the rest are worked", ge=0, le=1)
    max_filler: int = opt(4, 'worked / compact answers carry 0..max_filler "hmm. " phrases', ge=0)
    reasoning_marker: Optional[str] = opt(None, 'e.g. "ok." (3 tokens); null: no marker', above="""End-of-reasoning marker of the tiny task: every warm-up answer closes its reasoning with it right before
the final boxed answer (a3:3,b5:8,ok.\\boxed{8}), as R1-style models close theirs with </think>;
in the synthetic tokenizer's characters (0-9 : , Q \\ b o x e d { } h m . space a-l).
Pair it with laconic.reasoning_marker (the same string) for a reasoning-only budget.""")
    stated_share: float = opt(0.0, "share of warm-up prompts that state a budget (0: none, the warm-up draws nothing "
                                   "for it)", ge=0, le=1, above="""Stated budgets in the warm-up (laconic_nemo/data/synthetic.py): a share of the warm-up prompts
state a budget B drawn from stated_range, with data.target_instruction as the RL prompts state theirs;
a share budget_follow of those is answered with the length nearest B, the rest as without a budget.
budget_follow is how strongly the warm-up's length follows B: the mean length of a stated example rises
by about budget_follow tokens per token of B (0.47 at 0.5 over B = 16..56, max_filler 6).""")
    stated_range: List[int] = opt([16, 56], """[lo, hi] of the warm-up's stated budgets (uniform integers); 16..56: from a
compact 3-term answer to a worked 8-term one with a filler (inferred)""")
    budget_follow: float = opt(1.0, """share of the stated-budget warm-up examples answered with the length nearest their
budget (the rest ignore it). 1.0: the tiny 800-step warm-up lands about half of
its samples within 10% of the stated budget, imperfectly as a reasoning model
follows "think for N tokens" before length training (L1's starting point,
arXiv 2503.04697); at 0.5 it barely reads the budget (README, measured)""", ge=0, le=1)
    budgets_by_terms: Optional[List[int]] = opt(None, """per-prompt budgets from the data: B_i of a problem with k terms
at entry k - min_terms (one integer >= 1 per k), written into each row's field
data.budget_key; null: the rows carry no budget""")

    def __post_init__(self):
        marker = self.reasoning_marker
        if marker is not None:
            missing = synthetic_unencodable(marker)
            require(bool(marker) and not missing, "data.synthetic.reasoning_marker",
                     "a non-empty string of the synthetic tokenizer's characters "
                     f"{SYNTHETIC_ALPHABET!r}" + (f" (not encodable: {missing})" if missing else ""), marker)
        require(self.min_terms <= self.max_terms, "data.synthetic.min_terms",
                 f"an integer <= data.synthetic.max_terms = {self.max_terms}", self.min_terms)
        require(self.p_abbreviated + self.p_compact <= 1, "data.synthetic.p_compact",
                 f"a number in [0, 1 - data.synthetic.p_abbreviated] = [0, {1 - self.p_abbreviated:g}] (the shares "
                 "of the styles sum to at most 1)", self.p_compact)
        lo_hi = list(self.stated_range)
        require(len(lo_hi) == 2 and 1 <= lo_hi[0] <= lo_hi[1], "data.synthetic.stated_range",
                 "[lo, hi] with 1 <= lo <= hi", lo_hi)
        if self.budgets_by_terms is not None:
            n = self.max_terms - self.min_terms + 1
            b = list(self.budgets_by_terms)
            require(len(b) == n and all(int(x) >= 1 for x in b), "data.synthetic.budgets_by_terms",
                     f"{n} integers >= 1 (one per k = {self.min_terms}..{self.max_terms}), or null", b)


@dataclass(slots=True)
class DataConfig:
    kind: str = opt("math", "math (json/jsonl/parquet problem files) | synthetic (tiny CPU task)",
                    choices=("math", "synthetic"))
    train_files: List[str] = opt([], "list of files with `problem` and `answer` fields")
    prompt_template: str = opt("deepseek_r1", """a template of laconic_nemo/data/datasets.py TEMPLATES: deepseek_r1,
qwen_chat, plain, or the authors' prompt (EasyR1 math.jinja) in a model's
chat template: deepseek_r1_easyr1_math, qwen3_easyr1_math, qwen_math_easyr1_math""")
    shuffle: bool = opt(True)
    num_prompts: int = opt(4096, "synthetic: size of the RL prompt set (problems drawn with run.seed)", ge=1)
    target_length_range: Optional[List[int]] = opt(None, "e.g. [100, 4000] (L1 paper)", above="""Per-prompt target lengths n_gold for the L1 baselines (l1_exact / l1_max): drawn uniformly from
[min, max] for every prompt of every step (a function of run.seed, step and prompt), stated in the
prompt with target_instruction, handed to the shaper. null: no targets (other shapers).""")
    target_lengths: Optional[List[int]] = opt(None, """a SET of stated targets, e.g. [500, 1000, 2000, 3000]: each prompt of each
step draws one of them (the same function of run.seed, step and prompt as
target_length_range; exclusive with it); null: none""")
    target_instruction: str = opt(" Think for {target} tokens.", """the prompt's target stated with {target} (or {budget})
replaced by it: at the end of the user turn, before the assistant turn of the
chat template (data.kind = math); appended to the prompt (synthetic)""")
    budget_key: Optional[str] = opt(None, """the data rows' field holding each prompt's budget B_i (laconic.per_prompt_budget):
a JSONL / parquet field (data.kind = math), or the field the synthetic rows carry
data.synthetic.budgets_by_terms in (data.kind = synthetic); null: none""")
    budget_missing: str = opt("recipe", """a row without budget_key: recipe (B_i = laconic.budget) | refuse (the
data check names the file and row)""", choices=("recipe", "refuse"))
    synthetic: SyntheticConfig = section(SyntheticConfig, "synthetic task (laconic_nemo.data.synthetic): sum mod 10 "
                                                          "of k digits")

    def __post_init__(self):
        rng = self.target_length_range
        if rng is not None:
            require(len(rng) == 2 and 1 <= rng[0] <= rng[1], "data.target_length_range",
                     "[min, max] with 1 <= min <= max, or null", list(rng))
        tl = self.target_lengths
        if tl is not None:
            require(len(tl) > 0 and all(int(t) >= 1 for t in tl), "data.target_lengths",
                     "a non-empty list of integers >= 1, or null", list(tl))
            require(rng is None, "data.target_lengths", "null when data.target_length_range is set (one source of "
                     "stated targets)", list(tl))
        if rng is not None or tl is not None:
            require(states_a_target(self.target_instruction),
                     "data.target_instruction", "a template with {target} or {budget} (where the prompt states its "
                     "target)", self.target_instruction)
        if self.budget_key is not None:
            require(bool(self.budget_key), "data.budget_key", "a non-empty field name or null", self.budget_key)
            require(self.kind == "math" or self.synthetic.budgets_by_terms is not None, "data.budget_key",
                     "null with data.kind = synthetic unless data.synthetic.budgets_by_terms is set (the synthetic "
                     "rows' budgets)", self.budget_key)
            require(rng is None and tl is None, "data.budget_key", "null when data.target_length_range or "
                     "data.target_lengths is set (one source of per-prompt budgets)", self.budget_key)
        if self.kind == "synthetic" and self.synthetic.budgets_by_terms is not None:
            require(self.budget_key is not None, "data.synthetic.budgets_by_terms", "null unless data.budget_key names "
                     "the rows' budget field", list(self.synthetic.budgets_by_terms))

    def stated_budgets(self) -> list[int] | None:
        """Every target a prompt can state (target_lengths, or every integer of target_length_range), or None."""
        if self.target_lengths is not None:
            return sorted({int(t) for t in self.target_lengths})
        if self.target_length_range is not None:
            lo, hi = self.target_length_range
            return list(range(int(lo), int(hi) + 1))
        return None


@dataclass(slots=True)
class WarmupConfig:
    num_steps: int = opt(0, ge=0)
    batch_size: int = opt(64, "sequences per step (GLOBAL)", ge=1)
    lr: float = opt(1.0e-3, gt=0)
    cache_dir: Optional[str] = opt(None, """reuse a warmed-up policy across runs with the same model/warmup/layout
(null: ${run.output_dir}/warmup)""")


@dataclass(slots=True)
class GRPOConfig:
    num_prompts_per_step: int = opt(128, "prompts per step (GLOBAL, over all DP ranks)", ge=1)
    group_size: int = opt(8, "G responses sampled per prompt (group advantages need G >= 2)", ge=2)
    minibatch_size: int = opt(256, "responses per optimiser step (GLOBAL); rollout batch / minibatch = steps per "
                                   "rollout", ge=1)
    micro_batch_size: int = opt(4, """responses per forward/backward on one DP rank (rows padded to a common width; the
megatron-core actor uses it only with micro_batch_tokens = 0)""", ge=1)
    micro_batch_tokens: int = opt(16384, """megatron-core actor: token budget of a packed micro-batch: rows (prompt +
response) concatenated without padding, first-fit decreasing, each attending to
itself only (document-causal), positions restarting per row; a longer row forms
a micro-batch of its own; PP > 1 pads each pack's tail to the longest pack.
0 = no packing (micro-batches of micro_batch_size padded rows). 16384: the
16k-token packs measured on one H100 at the 1.5B shape, as verl's default
ppo_max_token_len_per_gpu (verl/trainer/config/actor/actor.yaml) (inferred).
The NeMo-Aligner actor ignores it (NeMo's own micro-batches)""", ge=0)
    recompute_layers: Optional[int] = opt(None, """layers per pipeline stage whose activations are recomputed in backward
(megatron's full recompute of the first N layers; N >= the stage's layers: all;
both actors). null = chosen by memory: on GPU, at every step, the fewest that let
the largest micro-batch fit the device by laconic_nemo/actors/memory.py (none
where all fit); none on CPU""", ge=0)
    clip_eps: float = opt(0.2, "epsilon of the clipped ratio (lower side; and upper side unless clip_eps_high)", gt=0,
                          lt=1)
    clip_eps_high: Optional[float] = opt(None, "optional larger upper clip (DAPO clip-higher); null = clip_eps", gt=0)
    clip_dual: Optional[float] = opt(None, """dual-clip PPO constant C > 1: for A < 0 the token loss is capped at C |A|
(EasyR1 clip_ratio_dual 3.0); null = off""", gt=1)
    kl_beta: float = opt(0.0, "beta of KL(pi || pi_ref) (k3 estimator); 0 disables the reference policy", ge=0)
    loss_aggregation: str = opt("seq_mean_token_mean", "seq_mean_token_mean (paper: mean over tokens, then "
                                                       "sequences) | token_mean",
                                choices=("seq_mean_token_mean", "token_mean"))
    advantage_eps: float = opt(1.0e-6, "eps in (l - mean) / (std + eps)", ge=0)
    advantage_std: str = opt("unbiased", """std of the group: unbiased (divide by G - 1: torch.std, EasyR1 / the authors)
| population (divide by G); unbiased makes advantages sqrt((G-1)/G) smaller""", choices=("unbiased", "population"))
    leave_one_out: bool = opt(False, "leave-one-out group mean")
    sort_by_length: bool = opt(True, """megatron-core actor, PP = 1: micro-batches of rows of similar length, each cut
to its longest row (less padding; the same gradient up to float rounding)""")
    logprob_chunk_size: int = opt(1024, """log-probs in chunks of this many positions (bounds the float32 copy of the
[b, s, V/tp] logits; recomputed in backward); the NeMo-Aligner actor: this many
tokens (positions x rows of its padded micro-batches)""", ge=1)
    reference_on: str = opt("auto", """megatron-core actor, kl_beta > 0: where pi_ref's weights live: device (beside
the weights, swapped by pointer, no copy; on CPU too) | pinned (GPU only: pinned
host memory, async copies; for models whose second copy does not fit) |
cpu (pageable host memory, copies) | auto (device)""", choices=REFERENCE_CHOICES)

    @property
    def rollout_batch(self) -> int:
        """Responses per step over every data-parallel rank: num_prompts_per_step x group_size."""
        return self.num_prompts_per_step * self.group_size

    def rollout_per_rank(self, dp: int) -> int:
        """Responses per step of one of ``dp`` data-parallel ranks (whole groups: :func:`check_layout`)."""
        return self.rollout_batch // dp

    def minibatch_per_rank(self, dp: int) -> int:
        """Responses of one optimiser minibatch on one of ``dp`` data-parallel ranks."""
        return self.minibatch_size // dp

    def __post_init__(self):
        rollout_size = self.rollout_batch
        require(rollout_size % self.minibatch_size == 0, "grpo.minibatch_size",
                 f"a divisor of num_prompts_per_step * group_size = {rollout_size}", self.minibatch_size)
        if self.clip_eps_high is not None:
            require(self.clip_eps_high >= self.clip_eps, "grpo.clip_eps_high", ">= grpo.clip_eps or null",
                     self.clip_eps_high)


@dataclass(slots=True)
class LaconicConfig:
    shaper: str = opt("laconic", " | ".join(SHAPERS) + " (laconic_nemo/core/shapers.py)", choices=tuple(SHAPERS))
    budget: float = opt(1500, "B, token budget on the mean response length", gt=0)
    eta: float = opt(0.002, "dual step size", ge=0)
    ceiling: Optional[float] = opt(None, "Lambda; null = B / (L_max - B)", ge=0)
    lambda_init: float = opt(0.0, """initial lambda, in [0, Lambda] (and the constant lambda of the `fixed` shaper);
below `floor` it is used as is for step 1 and clipped by the first dual step""", ge=0)
    floor: float = opt(0.0, "lower clip of lambda (authors' DeepScaleR script: 1e-5)", ge=0)
    controller: str = opt("integral", above="""lambda controller on the error e = mean_L / B - 1: integral (the paper: lambda += eta * e, clipped) |
pid (PID Lagrangian, Stooke et al. 2020: lambda = I + kp * e + kd * (e - e_prev), I += eta * e, clipped
into [floor, Lambda] and held while lambda is saturated; laconic_nemo/core/dual.py). kp = kd = 0 with pid
is the integral controller. Choose gains with `laconic-nemo simulate` (beyond the paper).""", choices=CONTROLLERS)
    kp: float = opt(0.0, "proportional gain >= 0 (pid only)", ge=0)
    kd: float = opt(0.0, "derivative gain >= 0 (pid only)", ge=0)
    penalty_cap: Optional[float] = opt(None, "cap on the per-response penalty lambda * c (authors' code: 0.4)", gt=0)
    hit_cap: float = opt(0.0, "extra penalty for responses truncated at L_max (authors' code: 0.1)", ge=0)
    count_eos: bool = opt(False, """L counts the EOS token (EasyR1's response mask) and a response with L = L_max
gets hit_cap even when it ended on EOS (authors' runs); false: paper form""")
    alpha: Optional[float] = opt(None, "coefficient of l1_exact / l1_max / efficient (null = method default)", gt=0)
    overlong_buffer: int = opt(512, "DAPO overlong shaping: buffer length", ge=1)
    overlong_penalty: float = opt(1.0, "DAPO overlong shaping: maximal penalty", ge=0)
    reasoning_marker: Optional[str] = opt(None, """reasoning-only budget: L = the response's tokens before the first
occurrence of this marker's token sequence (e.g. "</think>"); a response
without the marker is charged in full. Every shaper and the dual step use
this L. null: L counts the whole response""",
                                          above="""Constraints beyond the mean (docs/algorithm.md, "Constraints beyond the mean"; laconic_nemo/core/constraints.py).""")
    per_prompt_budget: bool = opt(False, """laconic / linear: price response i against its prompt's budget B_i
(data.budget_key, or the stated target of data.target_lengths /
target_length_range), c_i = max((L_i - B_i) / B_i, 0), with one multiplier
per budget class, each moved by its class's global mean of L_i / B_i (eta,
floor, lambda_init, controller of lambda; ceiling: laconic.ceiling, null =
b / (L_max - b) for the class's smallest budget b). laconic.budget is then
only the budget of rows without one (data.budget_missing = recipe)""")
    budget_classes: Optional[List[float]] = opt(None, """bin edges e_0 < ... < e_K of the budget classes ([e_k, e_k+1), the last
closed); every budget in a bin, every bin with a budget. null: one class per
distinct budget (needs a finite set: not with data.target_length_range)""")
    band: Optional[float] = opt(None, """rho of the band constraint (beyond the paper): per budget class a lower
bound B_lo = rho B beside the upper bound B, with its own multiplier
lambda_lo <- clip(lambda_lo + band_eta (1 - mean_L / B_lo), 0, band_ceiling)
from the class's global mean of L_i / B_i (the same ratio as the class's
lambda), reward term -lambda_lo max((B_lo - L) / B_lo, 0): the policy is
asked to USE its budget, L in [rho B, B]. Per class with per_prompt_budget,
else on the mean length against laconic.budget (laconic / linear only;
docs/algorithm.md, "The band"). null: no lower bound (the paper's form)""", gt=0, lt=1)
    band_eta: Optional[float] = opt(None, "dual step size of lambda_lo; null = laconic.eta", ge=0)
    band_ceiling: Optional[float] = opt(None, """ceiling of lambda_lo; null = the class's Lambda (laconic.ceiling, or
b / (L_max - b)); <= 1 keeps a correct response worth at least an incorrect
one inside the band under 0/1 rewards (the lower cost is at most 1)""", ge=0)
    tail_budget: Optional[float] = opt(None, """B_tail of the tail constraint: the share of responses with L > B_tail
at most tail_share (q), reward term -mu 1[L > B_tail], dual step
mu <- clip(mu + tail_eta (share / q - 1), 0, tail_ceiling) on the global
share. Beside the mean (or per-class) constraint. null: no tail constraint""", gt=0)
    tail_share: float = opt(0.1, "q, the largest share of responses longer than B_tail (inferred)", gt=0, lt=1)
    tail_eta: float = opt(0.05, "dual step size of mu (inferred)", ge=0)
    tail_ceiling: float = opt(1.0, """ceiling of mu: 1 keeps a correct tail response (1 - mu) >= an incorrect one
(0) under 0/1 rewards, as the paper's Lambda does for lambda (inferred)""", ge=0)
    tail_init: float = opt(0.0, "initial mu, in [0, tail_ceiling]", ge=0)

    def dual(self, max_length: float | None) -> DualSettings:
        """The settings of lambda's controller (and of each budget class's) with L_max = ``max_length``."""
        return DualSettings.of(self, max_length)


@dataclass(slots=True)
class RewardConfig:
    kind: str = opt("math", "math (boxed answer + math-verify) | synthetic (the tiny CPU task's checker)",
                    choices=("math", "synthetic"))
    num_workers: int = opt(2, "grading worker processes (0: grade in the trainer's process)", ge=0)
    timeout_s: float = opt(5.0, "hard per-item timeout; a timed-out item scores 0", gt=0)
    format_weight: float = opt(0.0, "authors' code: 0.1 -> reward = 0.9 * accuracy + 0.1 * format", ge=0, lt=1)
    format: str = opt("boxed", """format term: boxed (a final \\boxed{} answer) | think_boxed (the authors':
<think>...</think> then \\boxed{}, laconic_nemo/rewards/format.py)""", choices=("boxed", "think_boxed"))


@dataclass(slots=True)
class VllmConfig:
    gpu_memory_utilization: float = opt(0.5, "share of GPU memory for vLLM's weights + KV cache", gt=0, le=1)
    colocate: bool = opt(True, """on the training GPUs; vLLM sleeps (frees its memory) while the policy trains.
Only true is accepted: separate vLLM GPUs need a weight channel across GPUs and a placement (not implemented)""")
    refit: str = opt("auto", """how the policy reaches vLLM (laconic_nemo/rollout/vllm.py): ipc (vLLM's own weight
transfer, CUDA IPC to vLLM's engine on the group's GPUs; vLLM 0.33) | rpc (the hand-written load_weights through
collective_rpc, vLLM in-process; vLLM 0.10.1.1) | auto (ipc where the installed vLLM has the transfer, else rpc)""",
                     choices=("auto", "rpc", "ipc"))
    max_model_len: Optional[int] = opt(None, "null: vLLM's default from the checkpoint", ge=1)
    dtype: str = opt("bfloat16", "vLLM's --dtype", choices=("auto", "half", "float16", "bfloat16", "float", "float32"))

    def __post_init__(self):
        # Separate-GPU vLLM has no weight channel: every rank's engine would land on cuda:0 (vLLM's UniProcExecutor)
        # and the in-process refit cannot cross to vLLM's TP worker processes.
        require(bool(self.colocate), "rollout.vllm.colocate", "true (vLLM on separate GPUs is not implemented)",
                 self.colocate)


@dataclass(slots=True)
class RolloutConfig:
    engine: str = opt("megatron", """megatron (the project's decode engine, laconic_nemo/rollout/engine.py, for both
actors) | vllm (GPU, megatron-core actor with model.source = hf, PP = 1) | nemo
(NeMo-Aligner's native generation, NeMo-Aligner actor only)""", choices=("megatron", "vllm", "nemo"))
    max_new_tokens: int = opt(4096, "L_max during training", ge=1)
    temperature: float = opt(1.0, "sampling temperature; old, new and reference log-probs use it too (verl dp_actor)",
                             gt=0)
    top_p: float = opt(1.0, gt=0, le=1)
    sampler: str = opt("auto", """exact (host float64 draws, per-sample torch generators) | device (all on the
GPU, counter-based per-sample uniforms) | auto (device on GPU, exact on CPU)""",
                       above="""megatron engine only (laconic_nemo/rollout/engine.py; docs/architecture.md, "Rollout engine").
A sample's tokens depend on (run.seed, step, DP rank, sample index) only, never on the batch.""",
                       choices=SAMPLER_CHOICES)
    sync_every: int = opt(8, "decode steps between host synchronisations (finished rows are checked there)", ge=1)
    compact: bool = opt(True, """at each synchronisation, move the live rows into the smallest
batch bucket they fit""")
    batch_buckets: List[int] = opt([8, *range(16, 513, 16)], above="""Batch sizes a decode step runs at (one CUDA graph each, per KV length); the cache's rows are the
largest. 8, then every multiple of 16 up to 512: a batch of 48 rows runs as 48, at most 15 rows of a bucket
are padding. Inferred: vLLM captures every multiple of 8 up to 256, of 16 above; coarser here because
each bucket is captured once per KV length (laconic-nemo plan prints the bound)""")
    kv_block: int = opt(256, """attention reads the cache up to the longest live row, rounded up to a multiple of
this many positions (one graph per length); inferred""", ge=1)
    cuda_graphs: bool = opt(True, "capture each decode step as a CUDA graph (GPU); false: run it eagerly")
    prefill_tokens: int = opt(16384, """tokens per prefill forward (distinct prompts x the longest of them); bounds its
activation memory; inferred""", ge=1)
    max_prompt_length: int = opt(1024, """KV cache positions = max_prompt_length + max_new_tokens (within the model's
context); a longer prompt grows the cache (checked again). Inferred: the flagship
prompts (DeepScaleR problems in the chat template) are a few hundred tokens""", ge=1)
    kv_cache_rows: Optional[int] = opt(None, """rows of the KV cache; null: this DP rank's responses per step
(num_prompts_per_step x group_size / DP). A larger generate call runs in passes
of this many rows (same tokens)""", ge=1)
    kv_cache_memory_fraction: float = opt(0.3, """the cache's largest share of the device's memory
(GPU: its total memory; CPU: physical RAM), checked before it is
allocated; plan checks it against --gpu-memory-gib and against what the
training step leaves beside it (laconic_nemo/actors/memory.py). Inferred""", gt=0, le=1)
    engine_memory: str = opt("resident", """resident: the decode engine's KV cache, row buffers and CUDA graphs stay
allocated between rollouts and count in the training step's memory (plan and
the recompute chosen by memory budget them); release: freed after every
rollout, allocated and the graphs captured again at the next (the training
step gets the memory; costs the captures every step). Inferred: resident,
the flagship recipes fit with it (docs/architecture.md, "Rollout engine")""",
                             choices=("resident", "release"))
    vllm: VllmConfig = section(VllmConfig, "rollout.engine = vllm (GPU, model.source = hf): laconic_nemo/rollout/vllm.py")

    def __post_init__(self):
        b = list(self.batch_buckets)
        require(len(b) > 0 and all(x >= 1 for x in b) and all(x < y for x, y in zip(b, b[1:])),
                 "rollout.batch_buckets", "a non-empty, strictly increasing list of integers >= 1", b)


@dataclass(slots=True)
class CheckpointConfig:
    every_n_steps: int = opt(50, "write a checkpoint every N steps (0: only at the end; and on SIGUSR1/SIGTERM)",
                             ge=0)
    keep_last: int = opt(2, "how many checkpoints to keep", ge=1)
    resume: str = opt("auto", """auto (latest in ${run.output_dir}/checkpoints if any) | never | <path>
(never refuses an output_dir that already holds a run)""")
    resume_allow_changes: List[str] = opt([], above="""Keys allowed to differ from the resumed checkpoint's config (e.g. [run.seed, laconic.eta]); any other
difference refuses the resume, listing every key. Run length, logging, checkpoint and warm-up keys,
timeouts and reward.num_workers may always change (laconic_nemo/grpo/resume.py).
The multipliers of the constraints are restored by what they belong to: each budget class by its key
(its budget, 500, or its bin, 500-1000, as in the laconic/lambda/class_* metrics), the tail constraint
by its B_tail and q. A class or tail constraint that differs from the checkpoint's is refused, naming
the keys, unless one of these entries says how to carry the state over:
  class:new      a class the checkpoint lacks starts at laconic.lambda_init
  class:dropped  the multiplier of a checkpoint class this run lacks is dropped
  class:budgets  a bin whose budgets differ from the checkpoint's keeps its multiplier
  class:OLD=NEW  this run's class NEW takes the multiplier of the checkpoint's class OLD (e.g.
                 class:500-1000=500-1200 for a moved bin edge, class:22=24 for a changed budget)
  tail:carry     a tail constraint with another B_tail or q keeps the checkpoint's mu (clipped into
                 [0, laconic.tail_ceiling])
  tail:reset     it starts at laconic.tail_init instead (also when the checkpoint has no tail constraint)
The config keys behind the change (e.g. data.target_lengths) must be listed too (docs/reliability.md).""")
    export_hf: bool = opt(False, above="""true: when training finishes, write the final policy as a Hugging Face folder ${run.output_dir}/hf
(what `laconic-nemo export RUN --to hf OUT` writes). Needs model.source = hf: the synthetic GPT has no
Hugging Face architecture. Runs on rank 0 after the final checkpoint while the other ranks wait, so it
must fit in parallel.collective_timeout_s / watchdog_s. Framework default: false.""")


@dataclass(slots=True)
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
uploaded later with `wandb sync`)""", choices=("online", "offline"))

    def __post_init__(self):
        require(bool(self.wandb_project), "logging.wandb_project", "a non-empty W&B project name",
                 self.wandb_project)


@dataclass(slots=True)
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
            require(lmax > lc.budget, "laconic.budget", f"< rollout.max_new_tokens = {lmax} (L_max must exceed B)",
                     lc.budget)
        # the lambda controller's settings, by its own check (core.dual.check_dual); the other shapers build no
        # controller, but its keys still hold valid values (their lambda_init is not bounded by a ceiling)
        adaptive = lc.shaper in ("laconic", "linear")
        try:
            dual = lc.dual(lmax if adaptive else None)
            (dual if adaptive else dataclasses.replace(dual, lambda_init=0.0)).check()
        except DualSettingError as exc:
            raise ConfigError(f"{_DUAL_KEYS.get(exc.key, 'laconic.' + exc.key)} = {exc.value!r} is invalid: allowed "
                              f"{exc.allowed}") from None
        require(not SHAPERS[lc.shaper].needs_targets or self.data.stated_budgets() is not None,
                 "data.target_length_range", f"[min, max] (or a set, data.target_lengths) with laconic.shaper = "
                 f"{lc.shaper} (the shaper needs per-prompt target lengths)", None)
        if self.data.kind == "synthetic" and (self.data.stated_budgets() is not None
                                              or self.data.synthetic.stated_share > 0):
            # the stated target reaches the prompt through the synthetic task's character tokenizer
            text = self.data.target_instruction
            missing = synthetic_unencodable(text, template=True)
            require(states_a_target(text) and not missing, "data.target_instruction",
                     "a text holding {target} (or {budget}), in the synthetic tokenizer's characters "
                     f"{SYNTHETIC_ALPHABET!r} with data.kind = synthetic"
                     + (f" (not encodable: {missing})" if missing else ""), text)
        _check_constraints(self)
        if lc.shaper == "overlong":
            require(0 < lc.overlong_buffer <= lmax, "laconic.overlong_buffer",
                     f"a number of tokens in (0, rollout.max_new_tokens = {lmax}]", lc.overlong_buffer)
        # vLLM with PP > 1: every pipeline stage would own a whole vLLM engine and sample its own responses (the
        # engine's tokens are not broadcast across stages as the megatron sampler's are), so the stages could train
        # on different rollouts
        require(self.rollout.engine != "vllm" or self.parallel.pipeline_model_parallel_size == 1, "rollout.engine",
                 f"megatron with parallel.pipeline_model_parallel_size = {self.parallel.pipeline_model_parallel_size}"
                 " (the vLLM engine samples on every pipeline stage independently; it needs PP = 1)",
                 self.rollout.engine)
        require(not self.checkpoint.export_hf or self.model.source == "hf", "checkpoint.export_hf",
                 f"false with model.source = {self.model.source} (only hf runs have a Hugging Face architecture)",
                 self.checkpoint.export_hf)
        for key in self.checkpoint.resume_allow_changes:
            if CarryOver.is_entry(key):  # how to carry the constraints' state over (core.constraints.CarryOver)
                try:
                    CarryOver.parse([key])
                except ValueError as exc:
                    raise ConfigError(f"checkpoint.resume_allow_changes = {str(key)!r} is invalid: allowed a "
                                      f"config key or a carry-over entry ({exc})") from None
                continue
            node: Any = self
            for part in str(key).split("."):
                node = getattr(node, part, _MISSING) if dataclasses.is_dataclass(node) else _MISSING
            require(node is not _MISSING, "checkpoint.resume_allow_changes",
                     "a list of config keys (e.g. [run.seed]) and carry-over entries (class:new, class:dropped, "
                     "class:budgets, class:OLD=NEW, tail:carry, tail:reset)", str(key))
        try:
            CarryOver.parse(list(self.checkpoint.resume_allow_changes))
        except ValueError as exc:  # two entries that contradict each other
            raise ConfigError(f"checkpoint.resume_allow_changes is invalid: {exc}") from None


def _check_constraints(cfg: "Config") -> None:
    """The rules of the constraints beyond the mean (laconic.reasoning_marker, per_prompt_budget, budget_classes,
    tail_*), each naming its key."""
    lc, d, lmax = cfg.laconic, cfg.data, cfg.rollout.max_new_tokens
    if lc.reasoning_marker is not None:
        require(bool(lc.reasoning_marker), "laconic.reasoning_marker", "a non-empty string or null",
                 lc.reasoning_marker)
    if lc.tail_budget is not None:
        require(lc.tail_budget < lmax, "laconic.tail_budget", f"< rollout.max_new_tokens = {lmax}", lc.tail_budget)
        require(lc.tail_init <= lc.tail_ceiling, "laconic.tail_init",
                 f"a number in [0, laconic.tail_ceiling = {lc.tail_ceiling:g}]", lc.tail_init)
    if lc.band is not None:
        require(SHAPERS[lc.shaper].lam == "dual", "laconic.band", f"null with laconic.shaper = {lc.shaper} (the "
                "band's lower bound moves with the dual step: laconic, linear)", lc.band)
    edges = lc.budget_classes
    if edges is not None:
        e = [float(x) for x in edges]
        require(lc.per_prompt_budget, "laconic.budget_classes", "null unless laconic.per_prompt_budget = true",
                 list(edges))
        require(len(e) >= 2 and all(x > 0 and math.isfinite(x) for x in e) and all(a < b for a, b in zip(e, e[1:])),
                 "laconic.budget_classes", "at least two strictly increasing bin edges > 0, or null", list(edges))
    if not lc.per_prompt_budget:
        require(d.budget_key is None, "data.budget_key", "null unless laconic.per_prompt_budget = true", d.budget_key)
        return
    require(lc.shaper in ("laconic", "linear"), "laconic.per_prompt_budget",
             f"false with laconic.shaper = {lc.shaper} (per-class multipliers need an adaptive shaper: laconic, "
             "linear)", True)
    stated = d.stated_budgets()
    require(stated is not None or d.budget_key is not None, "laconic.per_prompt_budget",
             "false without a source of budgets (data.budget_key, data.target_lengths or data.target_length_range)",
             True)
    if d.target_length_range is not None:
        require(edges is not None, "laconic.budget_classes", "bin edges with data.target_length_range (one class "
                 "per integer target is too many multipliers)", None)
    if stated is not None:
        require(max(stated) < lmax, "data.target_lengths" if d.target_lengths is not None
                 else "data.target_length_range", f"targets < rollout.max_new_tokens = {lmax} (L_max must exceed "
                 "every budget)", max(stated))
        if edges is not None:
            e = [float(x) for x in edges]
            require(e[0] <= min(stated) and max(stated) <= e[-1], "laconic.budget_classes",
                     f"bins covering every target [{min(stated)}, {max(stated)}]", list(edges))
            for k in range(len(e) - 1):
                last = k == len(e) - 2
                held = any(e[k] <= b < e[k + 1] or (last and b == e[-1]) for b in stated)
                require(held, "laconic.budget_classes", "bins that each hold a budget of the run (bin "
                         f"[{e[k]:g}, {e[k + 1]:g}) holds none)", list(edges))
    if d.budget_key is not None and d.budget_missing == "recipe":
        require(lc.budget < lmax, "laconic.budget", f"< rollout.max_new_tokens = {lmax}", lc.budget)


_MISSING = object()
# core.dual.check_dual's argument names -> recipe keys (DualSettings.check)
_DUAL_KEYS = {"init": "laconic.lambda_init", "max_length": "rollout.max_new_tokens"}


def check_layout(cfg: Config, dp: int) -> None:
    """The batch rules of a layout with ``dp`` data-parallel ranks (``plan``, the trainer and the warm-up).

    Every DP rank holds whole groups of G responses, the global rollout batch splits into optimiser minibatches,
    each minibatch into DP x micro-batches, and the warm-up batch over DP. Raises LayoutError naming the key."""
    g = cfg.grpo
    prompts, G, mini, mbs, rollout = g.num_prompts_per_step, g.group_size, g.minibatch_size, g.micro_batch_size, \
        g.rollout_batch
    fits(prompts % dp == 0, "grpo.num_prompts_per_step", prompts,
          f"divisible by DP = {dp} so that every data-parallel rank holds whole groups of G = {G}")
    fits(rollout % mini == 0, "grpo.minibatch_size", mini,
          f"a divisor of the rollout batch num_prompts_per_step x G = {rollout}")
    fits(mini % dp == 0, "grpo.minibatch_size", mini, f"divisible by DP = {dp}")
    fits(mini % (dp * mbs) == 0, "grpo.micro_batch_size", mbs,
          f"DP x micro_batch_size = {dp} x {mbs} must divide grpo.minibatch_size = {mini}")
    if cfg.warmup.num_steps > 0:
        fits(cfg.warmup.batch_size % dp == 0, "warmup.batch_size", cfg.warmup.batch_size,
              f"divisible by DP = {dp}")
