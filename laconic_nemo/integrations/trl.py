"""LACONIC for Hugging Face TRL's ``GRPOTrainer`` (tested with TRL 1.16.0, transformers 5; extra ``[trl]``).

A user adds three lines to a GRPO script (docs/integrations.md)::

    laconic = Laconic(budget=256, eta=0.01, max_length=512)
    trainer = GRPOTrainer(..., reward_funcs=[laconic.reward(accuracy)], callbacks=[laconic.callback])

- ``laconic.reward(task_reward)`` is a reward function in TRL's ``reward_funcs`` form: TRL calls it on every
  process with that process's slice of the generation batch, ``f(prompts=, completions=, completion_ids=,
  trainer_state=, log_metric=, **dataset columns)`` (trl/trainer/grpo_trainer.py:1623-1628), and it returns the
  Lagrangian reward ``r - lambda * c(L)`` of the wrapped task reward, one float (or None) per completion. L is the
  number of completion tokens as TRL counts them (``len(completion_ids[i])``, EOS included, the same count as
  TRL's ``completions/mean_length``, grpo_trainer.py:2279-2296). It also sums the lengths over ALL processes
  with ``accelerate.utils.gather`` (the collective TRL uses for the rewards right after, grpo_trainer.py:38,1681;
  every process calls the reward functions for every generation batch, so the collective matches) and logs
  ``laconic/*`` metrics through TRL's ``log_metric`` (grpo_trainer.py:1565-1577, flushed into ``_metrics`` and
  averaged over processes at grpo_trainer.py:2847-2855).
- ``laconic.callback`` is a ``TrainerCallback`` that does the dual step in ``on_step_end``, which the Trainer calls
  once per optimiser step, after ``optimizer.step()`` and ``global_step += 1`` (transformers/trainer.py:1941-1957),
  with the exact global mean length (int64 sum / count) of the completions that step trained on, the same float on
  every process. It is an ``ExportableState``: the Trainer writes its ``state()`` into ``trainer_state.json`` of
  every checkpoint (transformers/trainer.py:3405-3417), and a run started with ``resume_from_checkpoint`` loads
  that file into ``TrainerState.stateful_callbacks`` (transformers/trainer.py:1686-1693) before
  ``on_train_begin``, where the callback restores lambda from it.

Which completions a step trains on: TRL generates once every ``steps_per_generation * num_iterations``
micro-steps and trains on ``steps_per_generation`` slices of that batch (grpo_trainer.py:1537-1546), while the
optimiser steps every ``gradient_accumulation_steps`` micro-steps. When ``steps_per_generation`` equals
``gradient_accumulation_steps`` (TRL's default) each optimiser step trains on the one batch generated in it, or, with
``num_iterations > 1``, on the last one generated; when ``steps_per_generation * num_iterations`` divides
``gradient_accumulation_steps`` each step trains on whole batches generated within it. Other settings split a
generation batch over optimiser steps in a shuffled order a reward function cannot see, and are refused at
``on_train_begin``.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch
from accelerate import PartialState
from accelerate.utils import gather
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from laconic_nemo.integrations.common import BAND_METRICS, LaconicSettings, LaconicState

__all__ = ["Laconic", "LaconicCallback"]

logger = logging.getLogger(__name__)

# laconic/<name> metrics logged for every generation batch (train and eval), through TRL's log_metric
_METRICS = ("lambda", "mean_length", "frac_over_budget", "mean_cost", "mean_penalty", "task_reward")


class Laconic:
    """The LACONIC plug-in of one ``GRPOTrainer``: the multipliers, the reward wrapper and the callback.

    Args: the :class:`~laconic_nemo.integrations.common.LaconicSettings` (budget B, eta, ceiling Lambda,
    max_length L_max, lambda_init, floor, shaper, penalty_cap, hit_cap, controller, kp, kd, band, band_eta,
    band_ceiling), and
    ``strict_resume``: refuse a checkpoint whose controller settings differ from these (False: keep these and
    clip the restored lambda into [floor, ceiling]).

    Attributes:
        state: the multipliers (:class:`LaconicState`); ``state.lam`` is the current lambda.
        callback: the :class:`LaconicCallback` to put in the trainer's ``callbacks``.
        history: one dict per optimiser step of this process: ``step`` (global step after it), ``lambda`` (the
            lambda its rewards used), ``mean_length`` (the global mean L it trained on), ``next_lambda``.
    """

    def __init__(self, budget: float, eta: float, strict_resume: bool = True, **settings: Any):
        self.state = LaconicState(LaconicSettings(budget=budget, eta=eta, **settings))
        self.strict_resume = strict_resume
        self.callback = LaconicCallback(self)
        self.history: list[dict[str, float]] = []
        self._attached = False
        self._in_step = False          # between on_step_begin and on_step_end: the completions scored are trained on
        self._pending = [0, 0]         # global (sum of L, count) scored inside the current optimiser step
        self._last_mean: float | None = None

    def reward(self, task_reward: Callable[..., list], name: str | None = None) -> Callable[..., list]:
        """Wrap a TRL reward function: the wrapper returns ``r - lambda * c(L)`` per completion (None where the
        task reward is None, which TRL reads as "not applicable"). Its ``__name__`` (TRL's name in the logs) is
        ``name`` or ``laconic_<task_reward.__name__>``."""
        def lagrangian_reward(prompts, completions, completion_ids, **kwargs):
            return self._score(task_reward, prompts, completions, completion_ids, kwargs)

        lagrangian_reward.__name__ = name or f"laconic_{getattr(task_reward, '__name__', 'reward')}"
        return lagrangian_reward

    def _score(self, task_reward, prompts, completions, completion_ids, kwargs) -> list:
        if not self._attached:
            raise RuntimeError("laconic: the reward was called by a trainer without laconic.callback; pass "
                               "callbacks=[laconic.callback] to GRPOTrainer (the callback does the dual step)")
        rewards = task_reward(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        rewards = list(rewards)
        if len(rewards) != len(completion_ids):
            raise ValueError(f"laconic: the task reward returned {len(rewards)} rewards for {len(completion_ids)} "
                             "completions")
        present = [r is not None and not (isinstance(r, float) and math.isnan(r)) for r in rewards]
        lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.long)
        r = [float(x) if ok else 0.0 for x, ok in zip(rewards, present)]
        lam = self.state.lam
        shaped, metrics = self.state.lagrangian_reward(r, lengths)

        # exact global sum and count of L over every process (int64), then float64 statistics
        local = torch.tensor([int(lengths.sum()), lengths.numel()], dtype=torch.long, device=PartialState().device)
        total, count = (int(v) for v in gather(local).view(-1, 2).sum(dim=0).tolist())
        global_mean = total / count if count else math.nan
        if self._in_step:
            self._pending[0] += total
            self._pending[1] += count

        log_metric = kwargs.get("log_metric")
        if log_metric is not None:
            values = {"lambda": lam, "mean_length": global_mean, "frac_over_budget": metrics["frac_over_budget"],
                      "mean_cost": metrics["mean_cost"], "mean_penalty": metrics["mean_penalty"],
                      "task_reward": metrics["task_reward_mean"]}
            values.update({k: metrics[k] for k in BAND_METRICS if k in metrics})  # the band's, where it is on
            for key in (*_METRICS, *(k for k in BAND_METRICS if k in values)):
                log_metric(f"laconic/{key}", float(values[key]))
        return [float(s) if ok else None for s, ok in zip(shaped.tolist(), present)]

    # --- called by LaconicCallback -------------------------------------------------------------------------
    def _check_args(self, args) -> None:
        if getattr(args, "restore_callback_states_from_checkpoint", False):
            raise ValueError("laconic: restore_callback_states_from_checkpoint=True makes the Trainer replace "
                             "laconic.callback by a new, unconnected instance on resume; leave it False (the "
                             "callback restores lambda from trainer_state.json itself)")
        spg = getattr(args, "steps_per_generation", None)
        if spg is None:  # not a GRPOConfig: one generation per micro-step cannot be checked, nothing to refuse
            return
        ga, mu = int(args.gradient_accumulation_steps), int(getattr(args, "num_iterations", 1))
        if not (spg == ga or ga % (spg * mu) == 0):
            raise ValueError(f"laconic: steps_per_generation ({spg}) must equal gradient_accumulation_steps ({ga}), "
                             f"or steps_per_generation * num_iterations ({spg} * {mu}) must divide it, so that each "
                             "optimiser step trains on whole generation batches whose lengths the dual step sees")

    def _attach(self, args) -> None:
        self._check_args(args)
        self._attached = True

    def _begin_train(self, args, state) -> None:
        self._attach(args)
        saved = (state.stateful_callbacks or {}).get(LaconicCallback.__name__)
        if isinstance(saved, list):
            raise ValueError("laconic: the checkpoint holds several LaconicCallback states; one Laconic per trainer")
        attributes = (saved or {}).get("attributes", {})
        if "laconic" in attributes:
            self.state.load_state_dict(attributes["laconic"], strict=self.strict_resume)
        elif state.global_step > 0:
            logger.warning("laconic: the checkpoint at step %d holds no LACONIC state; lambda starts at %r",
                           state.global_step, self.state.lam)
        self._in_step, self._pending, self._last_mean = False, [0, 0], None

    def _step_begin(self) -> None:
        self._in_step = True

    def _step_end(self, global_step: int) -> None:
        self._in_step = False
        total, count = self._pending
        self._pending = [0, 0]
        if count:
            self._last_mean = total / count
        elif self._last_mean is None:
            raise RuntimeError("laconic: an optimiser step ended without any completion scored by laconic.reward; "
                               "is it in the trainer's reward_funcs?")
        lam = self.state.lam
        new = self.state.dual_step(self._last_mean)
        self.history.append({"step": global_step, "lambda": lam, "mean_length": self._last_mean, "next_lambda": new})


class LaconicCallback(TrainerCallback, ExportableState):
    """The dual step once per optimiser step, lambda in the checkpoint (``trainer_state.json``) and its restore.

    Made by :class:`Laconic` (``laconic.callback``); an instance built without one (as the Trainer does with
    ``restore_callback_states_from_checkpoint=True``) refuses to train.
    """

    def __init__(self, plugin: Laconic | None = None):
        self.plugin = plugin

    def _plugin(self) -> Laconic:
        if self.plugin is None:
            raise ValueError("laconic: this LaconicCallback is not connected to a Laconic (the Trainer rebuilds "
                             "callbacks with restore_callback_states_from_checkpoint=True; leave it False)")
        return self.plugin

    def on_init_end(self, args, state, control, **kwargs):
        if self.plugin is not None:
            self.plugin._attach(args)

    def on_train_begin(self, args, state, control, **kwargs):
        self._plugin()._begin_train(args, state)

    def on_step_begin(self, args, state, control, **kwargs):
        self._plugin()._step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self._plugin()._step_end(state.global_step)

    def state(self) -> dict:
        if self.plugin is None:
            return {"args": {}, "attributes": {}}
        return {"args": {}, "attributes": {"laconic": self.plugin.state.state_dict()}}
