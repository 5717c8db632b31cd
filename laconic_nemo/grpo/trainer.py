"""The GRPO + LACONIC training loop, written against :class:`~laconic_nemo.grpo.interfaces.PolicyActor`.

One step (every rank runs the same code, SPMD):

1. the step's prompts (a function of seed and step alone), this DP rank's contiguous share,
   each repeated G times (groups whole on the rank);
2. rollout ``actor.generate`` -> tokens, lengths L (generated tokens, EOS excluded), truncation;
3. task reward r on the decoded responses (graded once per model-parallel group, broadcast);
4. the shaper: cost, Lagrangian reward ``l = r - lambda * c`` (or a baseline's shaping);
5. group-normalised advantages ``A = (l - mean_G) / (std_G + eps)``;
6. pi_old (and pi_ref) log-probs, then the clipped-surrogate policy update over minibatches, the
   loss normalised by GLOBAL token / sequence counts so DP and micro-batching leave it unchanged;
7. dual step ``lambda <- clip(lambda + eta * (mean_L / B - 1), floor, Lambda)`` where mean_L is
   the exact global mean (int64 all-reduce of the sum of L and the count over DP): every rank
   computes the same Python float from the same integers, so lambda agrees bit for bit;
8. metrics (one progress line, one JSON object per step in ``metrics.jsonl``), then the checkpoint.

Checkpoint files are :mod:`laconic_nemo.grpo.checkpoint`'s, metric files :mod:`laconic_nemo.grpo.metrics`'s.
SIGUSR1 / SIGTERM / SIGINT (Ctrl-C) make the loop checkpoint at the end of the current step and stop (the
launch scripts requeue the job, which resumes); a signal during the last step changes nothing: the run
finishes (its last checkpoint is the end of the run, status 0, never a requeue).
"""

from __future__ import annotations

import functools
import math
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from laconic_nemo.config import Config, check_layout, state_target, to_dict, to_yaml
from laconic_nemo.core import (
    CORRECT,
    BudgetClasses,
    DualController,
    TailConstraint,
    class_report,
    cost_lengths,
    group_advantages,
    report_counts,
    shape,
    shaper_state,
)
from laconic_nemo.data.sampler import PromptSampler, shard_prompts
from laconic_nemo.grpo.checkpoint import (
    CheckpointHook,
    CheckpointManager,
    allreduce_sum,
    barrier,
    dist_ready,
    find_resume_checkpoint,
)
from laconic_nemo.grpo.constraints import restore_resume_state, trainer_constraints
from laconic_nemo.grpo.interfaces import (
    GenerationOutput,
    PolicyActor,
    SamplingParams,
    TrainBatch,
    response_mask,
)
from laconic_nemo.grpo.loss import make_grpo_loss_fn
from laconic_nemo.grpo.metrics import CLASS_LAMBDA, MU_TAIL, MetricSink, MetricsWriter, build_sinks, multipliers_text
from laconic_nemo.runtime.cpu_isa import cpu_isa, kernels_note, runs_on_cpu
from laconic_nemo.runtime.faults import fault_point, heartbeat
from laconic_nemo.runtime.stop_signals import STOP_SIGNALS, handle_stop_signals  # noqa: F401 - STOP_SIGNALS: the trainer's, also read from here

# (responses, reference answers) -> (scores in [0, 1], metrics)
RewardFn = Callable[[list[str], list[Any]], "tuple[list[float], dict[str, float]]"]

PHASES = ("generate", "reward", "shape_advantage", "logprobs", "policy_update", "dual_step", "checkpoint")
# Parts of a phase, logged beside the phases as time/<phase>/<part> (the phases alone add up to the step):
# time/logprobs/old, time/logprobs/reference (grpo.kl_beta > 0), time/policy_update/<k> (optimiser step k, from 1).


class StopSignals:
    """The stop request of a run: SIGUSR1 / SIGTERM / SIGINT (:data:`STOP_SIGNALS`) caught by :meth:`install`,
    agreed on by every rank through :meth:`requested` (an all-reduce: one rank's signal stops them all at the
    same point, so they leave together)."""

    def __init__(self) -> None:
        self.signal: int | None = None  # the first stop signal this process received, or None

    def install(self, early: int | None = None) -> None:
        """Catch the stop signals from now on (each one records itself in :attr:`signal`). ``early``: a stop
        signal this process received before (while starting up), recorded unless one is already."""
        def handler(signum, _frame):
            self.signal = signum

        handle_stop_signals(handler)
        if early is not None and self.signal is None:
            self.signal = early

    def requested(self) -> bool:
        """Whether any rank received a stop signal (collective: every rank calls it at the same point)."""
        flag = allreduce_sum([1.0 if self.signal is not None else 0.0])
        return bool(flag.item() > 0)

    @staticmethod
    def ignore() -> None:
        """Ignore the stop signals from now on (a finished run has nothing to stop: one that arrives while the
        interpreter exits, when Python restores the default action that kills, still leaves its status)."""
        handle_stop_signals(signal.SIG_IGN)


def shaped_advantages(cfg: Config, rewards: torch.Tensor, lengths: torch.Tensor, lam: float,
                      truncated: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                      budgets: torch.Tensor | None = None, lams: torch.Tensor | None = None,
                      tail_penalty: torch.Tensor | None = None, band_penalty: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Steps 4 and 5 on one rank's groups: the shaper of ``cfg.laconic`` at lambda ``lam`` (L_max =
    ``rollout.max_new_tokens``), then the group advantages of the ``grpo:`` settings.

    rewards, lengths: [P, G] task rewards r and lengths L; truncated: [P, G] bool or None (``L >= L_max``);
    targets: [P, G] n_gold of the L1 baselines; budgets, lams: [P, G] per-prompt budgets B_i and their class
    multipliers (laconic.per_prompt_budget); tail_penalty: [P, G] ``mu 1[L > B_tail]``; band_penalty: [P, G]
    ``lambda_lo max((B_lo - L) / B_lo, 0)`` (laconic.band). Returns (shaped rewards
    [P, G], advantages [P, G], the shaper's metrics)."""
    g = cfg.grpo
    shaped, metrics = shape(cfg.laconic, rewards, lengths, lam, max_length=cfg.rollout.max_new_tokens,
                            truncated=truncated, targets=targets, budgets=budgets, lams=lams,
                            tail_penalty=tail_penalty, band_penalty=band_penalty)
    return shaped, group_advantages(shaped, eps=g.advantage_eps, leave_one_out=g.leave_one_out,
                                    std=g.advantage_std), metrics


@dataclass
class Rollout:
    """One step's rollout on this DP rank (N = prompts of the rank x G).

    gen: the generated batch (tokens [N, T], lengths L [N], truncation [N]).
    texts: the N decoded responses.
    task_reward: FloatTensor [N] the task reward r in [0, 1].
    reward_metrics: the reward function's metrics (means over the N responses).
    targets: DoubleTensor [N] the stated target lengths n_gold, or None.
    budgets: DoubleTensor [N] each response's budget B_i (laconic.per_prompt_budget), or None.
    """

    gen: GenerationOutput
    texts: list[str]
    task_reward: torch.Tensor
    reward_metrics: dict[str, Any]
    targets: torch.Tensor | None
    budgets: torch.Tensor | None = None


@dataclass
class Timer:
    seconds: dict[str, float]
    step: int = 0  # 1-based step being timed (heartbeats and fault points name it)
    step_s: float | None = None  # the longest step of this process so far (the launcher's watchdog scales with it)
    parts: dict[str, float] = field(default_factory=dict)  # "<phase>/<part>" -> seconds, inside the phases

    @contextmanager
    def part(self, name: str):
        """Seconds of a part of the running phase, kept under ``name`` in :attr:`parts` (no heartbeat)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0

    @contextmanager
    def __call__(self, phase: str):
        heartbeat(phase, self.step, step_s=self.step_s)
        try:
            fault_point(phase, self.step)
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
        except torch.OutOfMemoryError as exc:  # the phase it happened in, for the closing line
            if not hasattr(exc, "laconic_phase"):
                exc.laconic_phase = phase
            raise


# Exit status of a run that ran out of device memory in a step: fatal (launch/submit.sh requeues status 3 only): a
# resumed run would run out again. Its last line starts with OOM_MARKER.
OOM_EXIT = 5
OOM_MARKER = "laconic-nemo: out of memory"
# what to change, by the phase that ran out of memory
OOM_KEYS = {
    "generate": "rollout.kv_cache_rows, rollout.prefill_tokens, rollout.max_prompt_length + rollout.max_new_tokens, "
                "rollout.kv_cache_memory_fraction",
    "logprobs": "grpo.micro_batch_size (log-prob micro-batches of padded rows) or grpo.micro_batch_tokens (packs), "
                "grpo.logprob_chunk_size",
    "policy_update": "grpo.micro_batch_size (NeMo-Aligner actor; megatron-core actor without packing) or "
                     "grpo.micro_batch_tokens (packs), grpo.recompute_layers (null: by memory; the stage's layers: "
                     "all), grpo.logprob_chunk_size, rollout.engine_memory = release",
}


class TrainingOutOfMemory(RuntimeError):
    """``torch.OutOfMemoryError`` in a step; the message names the phase, the memory model's prediction and the keys
    to change (:func:`laconic_nemo.app.run.run` prints it as the last line and exits with :data:`OOM_EXIT`)."""


class GRPOTrainer:
    """Runs ``cfg.run.num_steps`` GRPO + LACONIC steps of ``actor`` on ``prompts``.

    cfg: the resolved recipe (recipes/base.yaml schema).
    actor: any PolicyActor (megatron-core or NeMo-Aligner).
    encode / decode: tokenizer functions (text -> ids, ids -> text).
    prompts: the dataset, a list of (prompt text, reference answer).
    reward_fn: task reward, see :data:`RewardFn`.
    eos_id: the token that ends a response.
    stop_ids: further ids that end a response (the chat template's end-of-turn token, ``Task.stop_ids``), handed to
        the actor's rollout in :class:`~laconic_nemo.grpo.interfaces.SamplingParams`.
    checkpoint_hook: the actor's own checkpoint files (:class:`~laconic_nemo.grpo.checkpoint.CheckpointHook`).
    metric_sinks: ``f(resume_step) -> dashboards`` opened on rank 0 when training starts (default: the ones
        ``cfg.logging`` asks for, :func:`~laconic_nemo.grpo.metrics.build_sinks`; the NeMo-Aligner entry hands
        in NeMo's own loggers).
    """

    def __init__(
        self,
        cfg: Config,
        actor: PolicyActor,
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        prompts: Sequence[tuple[str, Any]],
        reward_fn: RewardFn,
        eos_id: int,
        checkpoint_hook: CheckpointHook | None = None,
        metric_sinks: Callable[[int], list[MetricSink]] | None = None,
        budgets: Sequence[float] | None = None,
        stop_ids: Sequence[int] = (),
    ):
        self.cfg, self.actor = cfg, actor
        self.encode, self.decode = encode, decode
        self.prompts, self.reward_fn, self.eos_id = list(prompts), reward_fn, eos_id
        self.stop_ids = tuple(int(i) for i in stop_ids)  # ids that end a response besides EOS (SamplingParams)
        self.num_steps = cfg.run.num_steps
        dp = actor.dp_size
        check_layout(cfg, dp)
        self.local_minibatch = cfg.grpo.minibatch_per_rank(dp)
        # the multipliers (the only state of the shaping): lambda's controller or the shaper's constant lambda,
        # the budget classes, the tail constraint; `laconic-nemo plan` builds the same (laconic_nemo.plan.step_one)
        built = trainer_constraints(cfg, encode, len(self.prompts), budgets)
        self.constraints, self.prompt_budgets, self.report_classes = (built.constraints, built.prompt_budgets,
                                                                      built.report_classes)
        self.sampler = PromptSampler(len(self.prompts), cfg.grpo.num_prompts_per_step, cfg.run.seed, cfg.data.shuffle)
        self.out = Path(cfg.run.output_dir)
        self.rank = dist.get_rank() if dist_ready() else 0
        self.world = dist.get_world_size() if dist_ready() else 1
        self.is_logger = self.rank == 0
        self.checkpoints = CheckpointManager(self.out / "checkpoints", cfg.checkpoint.keep_last, self.rank,
                                             checkpoint_hook)
        self.metrics = MetricsWriter(self.out, self.rank, actor.dp_rank, self.num_steps, cfg.run.log_every)
        self._metric_sinks = metric_sinks if metric_sinks is not None else functools.partial(build_sinks, cfg)
        self.step = 0
        self.stop = StopSignals()
        self.history: list[dict] = []
        self.longest_step_s: float | None = None  # wall time of the longest step of this process
        # what this process's CPU kernels run with (a CPU run's checkpoints record it; a resume compares it)
        self.kernels = cpu_isa() if runs_on_cpu(cfg.parallel.backend) else None
        self.resume_notes: list[str] = []  # said once on the console and in the resumed row's notes (rank 0)

    @property
    def dual(self) -> DualController | None:
        """lambda's controller (None: a shaper without one, or per-prompt budgets)."""
        return self.constraints.dual

    @property
    def classes(self) -> BudgetClasses | None:
        return self.constraints.classes

    @property
    def tail(self) -> TailConstraint | None:
        return self.constraints.tail

    @property
    def lam(self) -> float:
        """lambda of the next step: the controller's, or the shaper's constant."""
        return self.constraints.lam

    # ------------------------------------------------------------------ one step
    def _rollout(self, step: int, timer: Timer) -> Rollout:
        """Generate this rank's G responses per prompt of ``step`` and grade them."""
        indices = shard_prompts(self.sampler.batch(step), self.actor.dp_rank, self.actor.dp_size)
        prompt_texts, targets = self._prompt_texts(step, indices)
        G = self.cfg.grpo.group_size
        items = [(t, self.prompts[i][1]) for t, i in zip(prompt_texts, indices) for _ in range(G)]
        prompt_ids = [self.encode(p) for p, _ in items]
        sampling = SamplingParams(
            temperature=self.cfg.rollout.temperature,
            top_p=self.cfg.rollout.top_p,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
            eos_id=self.eos_id,
            seed=(self.cfg.run.seed * 1_000_003 + step) * 1_009 + self.actor.dp_rank,
            stop_ids=self.stop_ids,
        )
        with timer("generate"):
            gen = self.actor.generate(prompt_ids, sampling)
        texts = [
            self.decode(gen.tokens[i, p : p + r].tolist())
            for i, (p, r) in enumerate(zip(gen.prompt_lengths.tolist(), gen.response_lengths.tolist()))
        ]
        with timer("reward"):
            scores, reward_metrics = self._grade(texts, [a for _, a in items])
        if targets is not None:
            targets = torch.tensor(targets, dtype=torch.float64).repeat_interleave(G)
        budgets = None
        if self.classes is not None:  # B_i: the stated target, or the prompt's budget from the data
            budgets = targets if self.prompt_budgets is None else torch.tensor(
                [self.prompt_budgets[i] for i in indices], dtype=torch.float64).repeat_interleave(G)
        return Rollout(gen, texts, torch.tensor(scores, dtype=torch.float32), reward_metrics, targets, budgets)

    def _prompt_texts(self, step: int, indices: list[int]):
        """This rank's prompt texts and, for the L1 baselines, their target lengths n_gold (a function of
        seed, step and prompt index only, so they do not depend on the layout)."""
        texts = [self.prompts[i][0] for i in indices]
        d = self.cfg.data
        if d.target_length_range is None and d.target_lengths is None:
            return texts, None
        targets = []
        for i in indices:
            g = torch.Generator().manual_seed((self.cfg.run.seed * 1_000_003 + step) * 1_000_033 + i)
            if d.target_lengths is not None:  # a set: one of its entries, uniformly
                targets.append(int(d.target_lengths[int(torch.randint(0, len(d.target_lengths), (1,), generator=g))]))
            else:
                lo, hi = d.target_length_range
                targets.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
        instruction = d.target_instruction
        if d.kind == "math":  # the user's words, inside the user turn of the chat template
            from laconic_nemo.data.datasets import state_in_user_turn

            template = d.prompt_template
            return [state_in_user_turn(template, t, state_target(instruction, n)) for t, n in zip(texts, targets)], targets
        return [t + state_target(instruction, n) for t, n in zip(texts, targets)], targets

    def _grade(self, texts, answers):
        """Grade on the first rank of the model-parallel group and broadcast (identical inputs there)."""
        group = getattr(self.actor, "model_parallel_group", None)
        if group is None or not dist_ready() or dist.get_world_size(group) == 1:
            return self.reward_fn(texts, answers)
        leader = dist.get_global_rank(group, 0)
        payload = [self.reward_fn(texts, answers) if self.rank == leader else None]
        dist.broadcast_object_list(payload, src=leader, group=group)
        return payload[0]

    def train_step(self, step: int) -> dict[str, Any]:
        timer = Timer({}, step=step + 1, step_s=self.longest_step_s)
        t_start = time.perf_counter()
        rollout = self._rollout(step, timer)
        gen, task_reward, targets = rollout.gen, rollout.task_reward, rollout.targets

        lc, g = self.cfg.laconic, self.cfg.grpo
        with timer("shape_advantage"):
            # L as the cost and the dual step see it (laconic.count_eos: EOS counted, hit = L >= L_max)
            lengths, truncated = cost_lengths(gen.lengths, gen.truncated, lc.count_eos)
            # reasoning-only L: the tokens before the marker (unclosed: in full)
            lengths, closed = self.constraints.lengths(lengths, gen.tokens, gen.prompt_lengths, gen.lengths)
            # the rank's responses [N] as its groups [P, G]: each prompt's G samples are contiguous (_rollout)
            G = g.group_size
            budgets = rollout.budgets
            lams, tail_penalty = self.constraints.penalties(lengths, budgets, G)
            band_penalty = self.constraints.band_penalty(lengths, budgets, G)
            _, advantages, shaper_metrics = shaped_advantages(
                self.cfg, task_reward.view(-1, G), lengths.view(-1, G), self.lam,
                truncated=None if truncated is None else truncated.view(-1, G),
                targets=None if targets is None else targets.view(-1, G),
                budgets=None if budgets is None else budgets.view(-1, G), lams=lams, tail_penalty=tail_penalty,
                band_penalty=band_penalty)

        batch = TrainBatch(
            tokens=gen.tokens,
            prompt_lengths=gen.prompt_lengths,
            response_lengths=gen.response_lengths,
            response_mask=response_mask(gen.prompt_lengths, gen.response_lengths, gen.tokens.shape[1]),
            advantages=advantages.view(-1).float(),
        )
        with timer("logprobs"):
            # at the sampling temperature, like the policy log-probs of the loss (grpo/loss.py)
            temp = self.cfg.rollout.temperature
            with timer.part("logprobs/old"):
                batch.old_logprobs = self.actor.logprobs(batch, temperature=temp) * batch.response_mask
            if g.kl_beta > 0:
                with timer.part("logprobs/reference"):
                    batch.ref_logprobs = (self.actor.logprobs(batch, reference=True, temperature=temp)
                                          * batch.response_mask)

        with timer("policy_update"):
            update_metrics = self._policy_update(batch, timer)

        with timer("dual_step"):
            # Exact global mean length: integer sums over DP, then one float division (same on every rank).
            # the constraints' integer counts ride on the same all-reduce
            local = [int(lengths.sum()), lengths.numel()] + self.constraints.counts(lengths, budgets, closed)
            sums = allreduce_sum(local, group=self.actor.dp_group, dtype=torch.int64)
            global_mean_length = float(sums[0].item()) / float(sums[1].item())
            lam_used, lam_next, constraint_metrics = self.constraints.step(global_mean_length, sums[2:].tolist())
            if self.report_classes is not None:  # B_i of each response: its prompt's budget, or its stated target
                constraint_metrics.update(self._class_report(lengths, task_reward, targets if budgets is None
                                                             else budgets))

        metrics = self._global_metrics(shaper_metrics, rollout.reward_metrics, update_metrics, gen, task_reward)
        metrics.update(
            step=step + 1,
            mean_response_length=global_mean_length,
            budget=lc.budget,
            **{"lambda": lam_used, "lambda_next": lam_next},
        )
        metrics.update(constraint_metrics)
        metrics["step_seconds"] = time.perf_counter() - t_start
        for phase in PHASES:
            metrics[f"time/{phase}"] = timer.seconds.get(phase, 0.0)
        for part, seconds in timer.parts.items():
            metrics[f"time/{part}"] = seconds
        if self.is_logger:
            metrics["sample_response"] = rollout.texts[0][:200]
        return metrics

    def _class_report(self, lengths: torch.Tensor, task_reward: torch.Tensor, budgets: torch.Tensor
                      ) -> dict[str, float]:
        """Per budget class, over the global batch (integer counts all-reduced over DP): the mean of L_i / B_i, the
        shares within 10% of B_i and over it, and pass@1 (task reward > CORRECT), as ``budget_class/<name>/...``."""
        c = self.report_classes
        local = report_counts(lengths, task_reward > CORRECT, c.budget_index(budgets), c.budgets,
                              None if c.band is None else c.band.rho)
        counts = allreduce_sum(local, group=self.actor.dp_group, dtype=torch.int64).tolist()
        return {f"budget_class/{name}/{k}": v for name, row in class_report(c, counts).items() for k, v in row.items()}

    def _policy_update(self, batch: TrainBatch, timer: Timer | None = None) -> dict[str, float]:
        """One optimiser step per minibatch of ``grpo.minibatch_size`` (global) responses, each with the GRPO loss of
        the recipe's ``grpo:`` settings at the rollout temperature and the minibatch's global token / sequence
        counts (each timed as ``policy_update/<k>`` on ``timer``). Returns the mean metrics."""
        g = self.cfg.grpo
        n_local = len(batch)
        sums: dict[str, float] = {}
        n_updates = 0
        for start in range(0, n_local, self.local_minibatch):
            mb = batch.select(slice(start, start + self.local_minibatch))
            counts = allreduce_sum([float(mb.response_mask.sum()), float(len(mb))], group=self.actor.dp_group)
            loss_fn = make_grpo_loss_fn(g.clip_eps, g.clip_eps_high, g.kl_beta, g.loss_aggregation,
                                        global_num_tokens=max(float(counts[0]), 1.0), global_num_seqs=float(counts[1]),
                                        clip_dual=g.clip_dual, temperature=self.cfg.rollout.temperature)
            with (timer.part(f"policy_update/{n_updates + 1}") if timer is not None else nullcontext()):
                out = self.actor.train_step(mb, loss_fn, g.micro_batch_size)
            for k, v in out.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            n_updates += 1
        return {f"train/{k}": v / n_updates for k, v in sums.items()}

    def _global_metrics(self, shaper_metrics, reward_metrics, update_metrics, gen: GenerationOutput, task_reward):
        """Means over the whole global batch (every DP shard has the same size, so the mean of the
        shard means is the global mean); the policy-update metrics are already global."""
        local = {f"shaper/{k}": float(v) for k, v in shaper_metrics.items()}
        local.update({f"reward/{k}": float(v) for k, v in reward_metrics.items() if isinstance(v, (int, float))})
        local["task_reward"] = float(task_reward.mean())
        local["truncated_fraction"] = float(gen.truncated.float().mean())
        local["frac_over_budget"] = float((gen.lengths.float() > self.cfg.laconic.budget).float().mean())
        keys = sorted(local)
        reduced = allreduce_sum([local[k] for k in keys], group=self.actor.dp_group) / self.actor.dp_size
        out = {k: float(v) for k, v in zip(keys, reduced.tolist())}
        out.update(update_metrics)
        return out

    # ------------------------------------------------------------------ checkpoint / resume
    def _trainer_state(self, step: int) -> dict[str, Any]:
        state = {
            "step": step,
            "shaper": shaper_state(self.cfg.laconic.shaper, self.dual),
            "world_size": self.world,
            "dp_size": self.actor.dp_size,
            "config": to_dict(self.cfg),
        }
        constraints = self.constraints.state_dict()
        if constraints is not None:
            state["constraints"] = constraints
        if self.kernels is not None:
            state["cpu_isa"] = self.kernels
        return state

    def _multipliers(self) -> dict[str, float]:
        """The multipliers of the next step, named as in a metrics row (lambda, each class's, the tail's mu)."""
        out = {"lambda": self.lam}
        if self.classes is not None:
            out.update({CLASS_LAMBDA + name: v for name, v in zip(self.classes.names, self.classes.values())})
        if self.tail is not None:
            out[MU_TAIL] = self.tail.value
        return out

    def save_checkpoint(self, step: int) -> Path:
        """Write the checkpoint of a completed ``step`` (1-based count of finished steps)."""
        return self.checkpoints.save(step, self.actor, lambda: self._trainer_state(step),
                                     metrics_file=self.out / "metrics.jsonl")

    def find_resume_checkpoint(self, notes: list[str] | None = None) -> Path | None:
        """The complete, intact checkpoint to resume (:mod:`laconic_nemo.grpo.resume`); never a ``.tmp`` folder.
        ``notes`` receives a line per damaged checkpoint skipped."""
        return find_resume_checkpoint(self.cfg, notes)

    def load_checkpoint(self, path: Path) -> int:
        """Restore the checkpoint ``path`` (its values already checked, :func:`~laconic_nemo.grpo.resume.choose_checkpoint`)
        into this rank: the multipliers first (lambda; each budget class by its key and the tail constraint by its
        settings, :func:`~laconic_nemo.grpo.constraints.restore_resume_state`), then the model shard and RNG state.
        Returns the checkpoint's step. ResumeError (one line naming the checkpoint) where it cannot be resumed."""
        from laconic_nemo.grpo.resume import ResumeError, read_trainer_state

        state = read_trainer_state(path)
        if state["dp_size"] != self.actor.dp_size or state["world_size"] != self.world:
            raise ResumeError(
                f"checkpoint {path} was written with world size {state['world_size']} (DP {state['dp_size']}); "
                f"this run has world size {self.world} (DP {self.actor.dp_size}): resume with the same layout"
            )
        # the config, then the multipliers (a LACONIC key allowed to change: the controllers keep this run's settings,
        # the multipliers clipped into them)
        restore_resume_state(path, state, self.cfg, self.constraints)
        self.checkpoints.load(path, self.actor)
        note = None if self.kernels is None else kernels_note(state.get("cpu_isa"), self.kernels, str(path))
        self.resume_notes = [note] if note else []
        return int(state["step"])

    # ------------------------------------------------------------------ main loop
    def fit(self) -> str:
        """Train until ``run.num_steps``; returns "finished" or "preempted"."""
        if self.is_logger:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(to_yaml(self.cfg))
        barrier()
        resume = self.checkpoints.resume_point(self.cfg, self.actor, log=self.is_logger)
        if resume is not None:
            self.step = self.load_checkpoint(resume)
            if self.is_logger:
                lam, budgets = multipliers_text(self._multipliers(), digits=6)
                print(f"resumed from {resume} at step {self.step} ({lam}{f'; B {budgets}' if budgets else ''})",
                      flush=True)
                for note in self.resume_notes:
                    print(f"laconic-nemo train: {note}", file=sys.stderr, flush=True)
                self.metrics.notes += self.resume_notes
        self.metrics.start(self.step, self._metric_sinks(self.step) if self.is_logger else None, resume)
        try:
            return self._train_loop()
        finally:
            self.metrics.close()

    def _train_loop(self) -> str:
        self.stop.install()
        every = self.cfg.checkpoint.every_n_steps
        last_checkpoint_seconds = 0.0
        while self.step < self.num_steps:
            try:
                m = self.train_step(self.step)
            except torch.OutOfMemoryError as exc:
                raise TrainingOutOfMemory(self._out_of_memory(exc)) from exc
            self.step += 1
            self.longest_step_s = max(self.longest_step_s or 0.0, float(m["step_seconds"]))
            # a signal during the last step changes nothing: the run is over once its checkpoint is written
            stop = self.stop.requested() and self.step < self.num_steps
            # The row goes to metrics.jsonl BEFORE the step's checkpoint: a crash in between then costs a
            # recomputed step (resume truncates the rows past the checkpoint), never a lost row. Hence
            # time/checkpoint is the checkpoint written after the previous step.
            m["time/checkpoint"] = last_checkpoint_seconds
            self.history.append(m)
            self.metrics.write(m)
            if self.cfg.logging.rank_trace:
                self.metrics.rank_trace(m)
            t0 = time.perf_counter()
            if stop or self.step == self.num_steps or (every and self.step % every == 0):
                self.save_checkpoint(self.step)
                fault_point("after_checkpoint", self.step)
                last_checkpoint_seconds = time.perf_counter() - t0
            else:
                last_checkpoint_seconds = 0.0
            if stop:
                if self.is_logger:
                    print(f"stopping on signal {self.stop.signal} after step {self.step}; checkpoint written",
                          file=sys.stderr, flush=True)
                return "preempted"
        if self.stop.signal is not None and self.is_logger:
            print(f"signal {self.stop.signal} arrived during the last step: the run is finished, nothing to resume",
                  file=sys.stderr, flush=True)
        return "finished"


    def _out_of_memory(self, exc: BaseException) -> str:
        """The closing line of a step that ran out of device memory (see :class:`TrainingOutOfMemory`)."""
        phase = getattr(exc, "laconic_phase", "step")
        prediction = None
        predict = getattr(self.actor, "memory_prediction", None)
        if predict is not None and phase == "policy_update":
            try:  # arithmetic on the last micro-batches' shape; never hide the OOM behind a second error
                prediction = predict()
            except Exception as err:  # noqa: BLE001
                prediction = f"(no prediction: {type(err).__name__}: {err})"
        what = str(exc).strip().split("\n")[0].split(". ")[0][:160]
        said = (f"the memory model predicted {prediction}" if prediction else
                "no prediction of the memory model for this phase (laconic-nemo plan shows the training step's)")
        keys = OOM_KEYS.get(phase, OOM_KEYS["policy_update"])
        return (f"{OOM_MARKER} in the {phase.replace('_', ' ')} of step {self.step + 1} on rank {self.rank} "
                f"({what}): {said}; change {keys}. Not requeued (status {OOM_EXIT}): a resumed run would run out "
                "of memory again")


def summarize(history: list[dict]) -> dict[str, float]:
    """Start/end means over the first and last tenth of the steps (for the closing report)."""
    n = max(1, math.ceil(len(history) / 10))
    first, last = history[:n], history[-n:]

    def mean(rows, k):
        return float(np.mean([r[k] for r in rows]))

    return {
        "start_length": mean(first, "mean_response_length"),
        "end_length": mean(last, "mean_response_length"),
        "start_reward": mean(first, "task_reward"),
        "end_reward": mean(last, "task_reward"),
        "end_lambda": float(history[-1]["lambda_next"]),
    }
