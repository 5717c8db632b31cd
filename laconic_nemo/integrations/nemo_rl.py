"""LACONIC for NVIDIA NeMo-RL's synchronous GRPO (written against NVIDIA-NeMo/RL commit 7ea279a, 2026-08-22;
NeMo-RL is not on PyPI, so this module imports nothing of it and tests/test_integrations_nemo_rl.py holds the
contract it relies on).

NeMo-RL's hook is its reward-shaping step. ``grpo_train`` runs on the driver with the whole generation batch and,
when ``grpo.reward_shaping.enabled``, calls ``repeated_batch = apply_reward_shaping(repeated_batch,
master_config.grpo.reward_shaping)`` after ``scale_rewards`` and before the baselines and advantages
(nemo_rl/algorithms/grpo.py:3024-3075). ``apply_reward_shaping`` is a module global of ``nemo_rl.algorithms.grpo``
(imported at grpo.py:57; the data-plane trainer ``grpo_sync`` imports its own name, grpo_sync.py:67, and calls it on
the driver at :694-699), so :meth:`LaconicRewardShaping.attach` puts this object there. Each call, once per GRPO step:

1. ``total_reward`` [B] becomes the Lagrangian reward ``r - lambda * c(L)``; the task reward is kept in
   ``unshaped_total_reward``, as NeMo-RL's own shaping does for DAPO's dynamic sampling
   (nemo_rl/algorithms/reward_functions.py:61-64). L is the response length by NeMo-RL's own rule: the slim
   ``response_token_lengths`` when present, else the token count of each sample's first assistant message
   (reward_functions.py:134-154; those ``token_ids`` are the generated tokens, nemo_rl/experience/rollouts.py:
   500-518); ``truncated`` [B] (rollouts.py:1057-1058) flags the responses cut at the generation limit.
2. The dual step with the mean L of the batch: the driver holds all of it, so the mean is global.
3. The multipliers are written onto the run's ``GRPOSaveState`` as the attribute ``laconic``: ``grpo_train`` saves
   ``vars(grpo_save_state)`` as ``training_info.json`` with every checkpoint (grpo.py:3528-3580,
   nemo_rl/utils/checkpoint.py:274-280), a plain dataclass whose extra attributes it already uses for its own
   metrics (grpo.py:3563-3567). On resume ``_get_grpo_save_state`` keeps only the dataclass's own fields
   (grpo.py:338-351), so :meth:`attach` reads the multipliers back from the raw ``training_info.json`` through
   the checkpointer (``get_latest_checkpoint_path`` / ``load_training_info``, checkpoint.py:552-587).

Not supported: dynamic sampling (``grpo.use_dynamic_sampling``: the shaping then runs once per generation batch,
several per step, grpo.py:3083-3110; refused by :meth:`attach`) and async GRPO (NeMo-RL refuses reward shaping
there itself, examples/run_grpo.py).
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, Sequence

import torch

from laconic_nemo.integrations.common import BAND_METRICS, LaconicSettings, LaconicState

__all__ = ["SAVE_STATE_KEY", "LaconicRewardShaping", "response_lengths"]

SAVE_STATE_KEY = "laconic"  # the GRPOSaveState attribute / training_info.json key
DEFAULT_MODULES = ("nemo_rl.algorithms.grpo", "nemo_rl.algorithms.grpo_sync")


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def response_lengths(batch: Mapping[str, Any]) -> torch.Tensor:
    """[B] int64 response lengths of a NeMo-RL batch, by the rule of its reward shaping
    (reward_functions.py:134-154): ``response_token_lengths`` if present, else the first assistant message's
    ``token_ids`` length."""
    slim = batch.get("response_token_lengths")
    if slim is not None:
        return torch.as_tensor(slim).to(torch.long).reshape(-1)
    lengths = []
    for i, message_log in enumerate(batch["message_log"]):
        first = next((m for m in message_log if m["role"] == "assistant"), None)
        if first is None:
            raise ValueError(f"laconic: sample {i} of the batch has no assistant message")
        lengths.append(int(torch.as_tensor(first["token_ids"]).shape[0]))
    return torch.tensor(lengths, dtype=torch.long)


class LaconicRewardShaping:
    """NeMo-RL's ``apply_reward_shaping(batch, cfg)`` with the Lagrangian reward and the dual step.

    Args:
        settings: :class:`LaconicSettings` or its keys as a mapping (the ``grpo.reward_shaping.laconic`` section).
        logger: NeMo-RL's ``Logger`` (from ``setup``); each step's ``laconic/*`` metrics go to
            ``logger.log_metrics(metrics, step, prefix="train")`` with NeMo-RL's step number.

    Attributes:
        state: the multipliers. history: one dict per step (``step``, ``lambda`` used, ``mean_length``,
        ``next_lambda`` and the batch metrics).
    """

    def __init__(self, settings: LaconicSettings | Mapping[str, Any], logger: Any = None):
        if not isinstance(settings, LaconicSettings):
            settings = LaconicSettings.from_mapping(dict(settings), where="grpo.reward_shaping.laconic")
        self.state = LaconicState(settings)
        self.logger = logger
        self.history: list[dict[str, float]] = []
        self._save_state: Any = None

    @classmethod
    def from_config(cls, master_config: Any, logger: Any = None) -> LaconicRewardShaping:
        """From ``grpo.reward_shaping.laconic`` of a NeMo-RL master config (a ``MasterConfig`` or a dict)."""
        shaping = _get(_get(master_config, "grpo"), "reward_shaping")
        section = _get(shaping, "laconic") if shaping is not None else None
        if section is None:
            raise ValueError("config key 'grpo.reward_shaping.laconic' is required (budget, eta, ...)")
        return cls(section, logger=logger)

    def __call__(self, batch: Any, cfg: Any = None) -> Any:
        """One GRPO step's shaping (the signature of NeMo-RL's ``apply_reward_shaping``): the batch with
        ``total_reward`` [B] replaced by the Lagrangian reward, ``unshaped_total_reward`` the task reward."""
        rewards = batch["total_reward"]
        lengths = response_lengths(batch)
        if lengths.shape != rewards.shape:
            raise ValueError(f"laconic: {lengths.numel()} response lengths for {rewards.numel()} rewards")
        truncated = batch.get("truncated")
        if truncated is not None:
            truncated = torch.as_tensor(truncated).to(torch.bool).reshape(-1)
        lam = self.state.lam
        shaped, metrics = self.state.lagrangian_reward(rewards, lengths, truncated)
        batch["unshaped_total_reward"] = rewards.clone()
        batch["total_reward"] = shaped.to(device=rewards.device, dtype=rewards.dtype)
        mean_length = int(lengths.sum()) / lengths.numel()
        new = self.state.dual_step(mean_length)
        row = {"step": self.state.num_steps, "lambda": lam, "mean_length": mean_length, "next_lambda": new,
               "frac_over_budget": metrics["frac_over_budget"], "frac_truncated": metrics["frac_truncated"],
               "mean_cost": metrics["mean_cost"], "mean_penalty": metrics["mean_penalty"],
               "task_reward": metrics["task_reward_mean"]}
        row.update({k: metrics[k] for k in BAND_METRICS if k in metrics})  # the band's lambda_lo, its mean penalty
        self.history.append(row)
        self._publish()
        if self.logger is not None:
            self.logger.log_metrics({f"laconic/{k}": v for k, v in row.items() if k != "step"}, row["step"],
                                    prefix="train")
        return batch

    def _publish(self) -> None:
        if self._save_state is not None:
            setattr(self._save_state, SAVE_STATE_KEY, self.state.state_dict())

    def restore(self, training_info: Mapping[str, Any] | None) -> bool:
        """Restore the multipliers from a checkpoint's ``training_info`` dict (None: a fresh run); True if it held
        them."""
        if training_info is None or SAVE_STATE_KEY not in training_info:
            return False
        self.state.load_state_dict(training_info[SAVE_STATE_KEY])
        return True

    def attach(self, master_config: Any, checkpointer: Any, grpo_save_state: Any,
               modules: Sequence[Any] | None = None) -> LaconicRewardShaping:
        """Wire this object into NeMo-RL before ``grpo_train``: refuse what it cannot support, restore lambda from
        the latest checkpoint, keep the state on ``grpo_save_state`` and replace ``apply_reward_shaping`` in the
        GRPO modules (default: ``nemo_rl.algorithms.grpo`` and ``grpo_sync``, those that import)."""
        grpo = _get(master_config, "grpo")
        if _get(grpo, "use_dynamic_sampling", False):
            raise ValueError("laconic: grpo.use_dynamic_sampling must be false (with dynamic sampling NeMo-RL shapes "
                             "several generation batches per step and the dual step would run once per batch)")
        if not _get(_get(grpo, "reward_shaping"), "enabled", False):
            raise ValueError("laconic: grpo.reward_shaping.enabled must be true (NeMo-RL calls the shaping only then)")
        self.restore(checkpointer.load_training_info(checkpointer.get_latest_checkpoint_path()))
        self._save_state = grpo_save_state
        self._publish()
        if modules is None:
            modules = []
            for name in DEFAULT_MODULES:
                try:
                    modules.append(importlib.import_module(name))
                except ImportError:
                    continue
            if not modules:
                raise ImportError("laconic: nemo_rl.algorithms.grpo does not import; is NeMo-RL installed?")
        for module in modules:
            if not hasattr(module, "apply_reward_shaping"):
                raise ValueError(f"laconic: {getattr(module, '__name__', module)!r} has no apply_reward_shaping to "
                                 "replace")
            module.apply_reward_shaping = self
        return self
