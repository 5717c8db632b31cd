"""LACONIC for verl 0.9 (tested against verl 0.9.1 from PyPI; extra ``[verl]``), through verl's own extension points.

Two Hydra overrides switch it on (docs/integrations.md, examples/integrations/verl_laconic.sh)::

    algorithm.adv_estimator=laconic
    trainer.checkpoint_callback_class=laconic_nemo.integrations.verl.LaconicCheckpointCallback
    +algorithm.laconic.budget=1000 +algorithm.laconic.eta=0.002 ...

- **Advantage estimator** ``laconic``, registered in verl's registry with ``core_algos.register_adv_est``
  (verl/trainer/ppo/core_algos.py:113-150). verl's ``compute_advantage`` calls a registered estimator that is not
  GAE or GRPO with ``token_level_rewards``, ``response_mask``, ``config`` (= ``config.algorithm``) and ``index``
  (the prompt uid) (verl/trainer/ppo/ray_trainer.py:248-279); the v1 trainer reaches it through
  ``compute_advantage_for_multi_trajectories`` (verl/trainer/ppo/v1/utils.py:167-176) from ``_compute_advantage``,
  "executed on the driver process" on the whole batch of one update (v1/trainer_base.py:1743-1786, called once per
  ``_step_once``, :562-614). The estimator turns each response's task score (the row sum of
  ``token_level_rewards``, as verl's GRPO reads it, core_algos.py:306) into the Lagrangian reward ``r - lambda *
  c(L)``, lets verl's own ``grpo`` estimator (``compute_grpo_outcome_advantage``, core_algos.py:267-335, with
  ``algorithm.norm_adv_by_std_in_grpo``) normalise it within each uid group, and then does the dual step with the
  mean L of the batch's real responses. L is ``response_mask.sum(-1)``: the response tokens verl trains on,
  the first EOS included (``get_response_mask``, verl/utils/torch_functional.py:349-369); rows with an all-zero
  mask are the v1 trainer's padding rows (verl/trainer/ppo/padding_utils.py:101,121) and are left out of the mean.
  Because the driver holds the whole batch, that mean is the global one.
- **Checkpoint callback** ``LaconicCheckpointCallback``, named by ``trainer.checkpoint_callback_class``
  (verl/trainer/config/ppo_trainer.yaml:189-196): verl builds it on the driver with the full config when the
  trainer is made (verl/trainer/ppo/checkpoint_callback.py:66-82, v1/trainer_base.py:122) and calls
  ``on_save(trainer, global_step, checkpoint_dir)`` after every checkpoint (v1/trainer_base.py:1010-1029). It
  holds the multipliers, writes them to ``global_step_<N>/laconic_state.json`` and, when built, restores them from
  the folder the trainer resumes from, found by the rule of ``_load_checkpoint`` (v1/trainer_base.py:850-876:
  ``resume_mode`` disable / auto = ``find_latest_ckpt_path(default_local_dir)`` / resume_path). Building it also
  imports this module, which registers the estimator in the driver process.

Per step, the estimator appends ``{"step", "lambda", "mean_length", "next_lambda", ...}`` to
``<trainer.default_local_dir>/laconic_metrics.jsonl`` and logs it: verl gives an advantage estimator no channel
into its metrics. One dual step per actor update (a batch's advantage, then its update); verl splits that update
into ``ppo_mini_batch_size`` optimiser steps, which all see the same lambda.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from verl.trainer.ppo.checkpoint_callback import CheckpointCallback
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, register_adv_est
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from laconic_nemo.integrations.common import BAND_METRICS, LaconicSettings, LaconicState

__all__ = ["ESTIMATOR", "STATE_FILE", "LaconicCheckpointCallback", "compute_laconic_advantage", "resume_folder"]

logger = logging.getLogger(__name__)

ESTIMATOR = "laconic"
STATE_FILE = "laconic_state.json"
METRICS_FILE = "laconic_metrics.jsonl"

_ACTIVE: LaconicCheckpointCallback | None = None  # the driver's callback: the multipliers of this run


def resume_folder(config) -> str | None:
    """The ``global_step_<N>`` folder verl's trainer resumes from, by the rule of v1 ``_load_checkpoint``
    (verl/trainer/ppo/v1/trainer_base.py:850-876); None for a fresh run."""
    trainer = config.trainer
    mode = trainer.get("resume_mode", "auto")
    if mode == "disable":
        return None
    if mode == "auto":
        folder = trainer.default_local_dir
        if not os.path.isabs(folder):
            folder = os.path.join(os.getcwd(), folder)
        return find_latest_ckpt_path(folder)
    if mode == "resume_path":
        folder = trainer.resume_from_path
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)
    raise ValueError(f"trainer.resume_mode must be disable, auto or resume_path, got {mode!r}")


class LaconicCheckpointCallback(CheckpointCallback):
    """Holds the run's multipliers on verl's driver; saves them with every checkpoint, restores them on resume.

    Settings: ``config.algorithm.laconic`` (:class:`LaconicSettings` keys; ``budget`` and ``eta`` required).
    """

    def __init__(self, config=None):
        super().__init__(config=config)
        global _ACTIVE
        section = config.algorithm.get("laconic") if config is not None else None
        if section is None:
            raise ValueError("config key 'algorithm.laconic' is required with the LACONIC checkpoint callback "
                             "(+algorithm.laconic.budget=... +algorithm.laconic.eta=...)")
        self.state = LaconicState(LaconicSettings.from_mapping(dict(section), where="algorithm.laconic"))
        self.metrics_path = Path(config.trainer.default_local_dir) / METRICS_FILE
        self.history: list[dict[str, float]] = []
        folder = resume_folder(config)
        if folder is not None:
            path = Path(folder) / STATE_FILE
            if path.is_file():
                self.state.load_state_dict(json.loads(path.read_text()))
                logger.info("LACONIC: lambda %r restored from %s", self.state.lam, path)
            else:
                logger.warning("LACONIC: %s holds no %s; lambda starts at %r", folder, STATE_FILE, self.state.lam)
        _ACTIVE = self

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False, **kwargs) -> None:
        """Write the multipliers to ``<checkpoint_dir>/laconic_state.json`` (written whole, then renamed)."""
        path = Path(checkpoint_dir) / STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"global_step": int(global_step), **self.state.state_dict()}))
        os.replace(tmp, path)

    def step(self, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The Lagrangian rewards [N] (float64) of one batch's real responses with the current lambda, then the
        dual step on their mean length."""
        lam = self.state.lam
        shaped, metrics = self.state.lagrangian_reward(scores, lengths)
        mean_length = int(lengths.sum()) / lengths.numel()
        new = self.state.dual_step(mean_length)
        row = {"step": self.state.num_steps, "lambda": lam, "mean_length": mean_length, "next_lambda": new,
               "frac_over_budget": metrics["frac_over_budget"], "mean_cost": metrics["mean_cost"],
               "mean_penalty": metrics["mean_penalty"], "task_reward": metrics["task_reward_mean"]}
        row.update({k: metrics[k] for k in BAND_METRICS if k in metrics})  # the band's lambda_lo, its mean penalty
        self.history.append(row)
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        logger.info("LACONIC: lambda %.6g -> %.6g (mean length %.2f)", lam, new, mean_length)
        return shaped


@register_adv_est(ESTIMATOR)
def compute_laconic_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None,
                              config: Any = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """verl advantage estimator ``laconic``: the Lagrangian reward, verl's GRPO advantage, then the dual step.

    Args:
        token_level_rewards: [bs, response_length] rewards (the task score is each row's sum).
        response_mask: [bs, response_length] 1 on the response tokens.
        index: [bs] prompt uids (the GRPO groups).
        config: ``config.algorithm`` (``norm_adv_by_std_in_grpo`` is read from it).

    Returns:
        (advantages, returns), each [bs, response_length], as verl's ``grpo`` estimator returns them.
    """
    if _ACTIVE is None:
        raise RuntimeError("algorithm.adv_estimator=laconic needs trainer.checkpoint_callback_class="
                           "laconic_nemo.integrations.verl.LaconicCheckpointCallback (it holds lambda and "
                           "checkpoints it)")
    lengths = response_mask.sum(dim=-1).to(torch.long)                    # [bs]
    real = lengths > 0                                                    # padding rows have no response token
    if not bool(real.any()):
        raise ValueError("laconic: the batch has no response token (every response_mask row is zero)")
    scores = token_level_rewards.sum(dim=-1)                              # [bs]
    shaped = _ACTIVE.step(scores[real], lengths[real]).to(token_level_rewards.dtype)
    # one value per response, on its last response token: verl's GRPO reads the row sum
    last = response_mask.shape[-1] - 1 - response_mask.flip(-1).to(torch.long).argmax(dim=-1)   # [bs]
    rows = torch.nonzero(real).squeeze(-1)
    lagrangian = torch.zeros_like(token_level_rewards)
    lagrangian[rows, last[rows]] = shaped
    norm = config.get("norm_adv_by_std_in_grpo", True) if config is not None else True
    return get_adv_estimator_fn("grpo")(token_level_rewards=lagrangian, response_mask=response_mask, index=index,
                                        norm_adv_by_std_in_grpo=norm, config=config)
