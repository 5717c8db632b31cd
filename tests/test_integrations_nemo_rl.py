"""The NeMo-RL plug-in (laconic_nemo/integrations/nemo_rl.py) against the contract of NeMo-RL's GRPO.

NeMo-RL does not install from the registry here, so these tests encode the upstream behaviour the plug-in relies on,
each piece citing NVIDIA-NeMo/RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909 (2026-08-22):

- ``grpo_train`` runs on the driver with the whole batch and, when ``grpo.reward_shaping.enabled``, calls the
  MODULE GLOBAL ``apply_reward_shaping(repeated_batch, master_config.grpo.reward_shaping)`` and uses the returned
  batch's ``total_reward`` for the baselines (nemo_rl/algorithms/grpo.py:57, 3024-3075); ``grpo_sync`` imports and
  calls its own copy of the name (grpo_sync.py:67, 694-699);
- the batch (a ``BatchedDataDict``, a ``UserDict``, batched_data_dict.py:125) carries ``total_reward`` [B] and
  ``truncated`` [B] (experience/rollouts.py:1057-1058) and a ``message_log`` per sample whose assistant message's
  ``token_ids`` are the generated tokens (rollouts.py:500-518); NeMo-RL's own shaping measures the length from
  ``response_token_lengths`` when present, else from the first assistant message (reward_functions.py:134-154),
  and keeps the unshaped reward in ``unshaped_total_reward`` (reward_functions.py:61-64);
- at a checkpoint it saves ``vars(grpo_save_state)`` (a plain dataclass, grpo.py:312-323; extra attributes are
  saved too, grpo.py:3563-3567) as ``training_info.json`` via ``json.dump`` after turning tensors into scalars
  (grpo.py:3528-3580, utils/checkpoint.py:274-280) in ``tmp_step_N``, renamed ``step_N`` when complete; the latest
  checkpoint is the highest ``step_N`` and ``load_training_info`` is ``json.load`` of that file (None for no
  checkpoint) (checkpoint.py:552-587); on resume ``_get_grpo_save_state`` keeps only the dataclass's own fields
  (grpo.py:338-351).

``GRPOLoop`` below is that contract in a few lines, a stand-in for ``grpo_train`` around the shaping call.
"""

from __future__ import annotations

import json
import re
import types
from collections import UserDict
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import pytest
import torch
import yaml

from laconic_nemo.integrations.nemo_rl import SAVE_STATE_KEY, LaconicRewardShaping, response_lengths

ROOT = Path(__file__).resolve().parent.parent
B, ETA, CEIL = 5.0, 0.05, 0.4


@dataclass
class GRPOSaveState:  # nemo_rl/algorithms/grpo.py:312-323
    consumed_samples: int
    current_step: int
    current_epoch: int
    total_steps: int
    total_valid_tokens: int
    val_reward: float
    sampler_name: Optional[str] = None


def initial_save_state() -> GRPOSaveState:  # grpo.py:326-335
    return GRPOSaveState(0, 0, 0, 0, 0, -99999999.0, None)


def get_grpo_save_state(loaded):  # grpo.py:338-351: unknown keys are dropped
    if loaded is None:
        return initial_save_state()
    known = {f.name for f in fields(GRPOSaveState)}
    values = vars(initial_save_state()).copy()
    values.update({k: v for k, v in loaded.items() if k in known})
    return GRPOSaveState(**values)


class Checkpointer:  # nemo_rl/utils/checkpoint.py:241-287, 552-587
    def __init__(self, root: Path):
        self.root = root

    def save(self, step: int, training_info: dict) -> None:
        tmp = self.root / f"tmp_step_{step}"
        tmp.mkdir(parents=True)
        info = dict(training_info)
        for k, v in info.items():
            if isinstance(v, torch.Tensor):
                info[k] = v.item()
        (tmp / "training_info.json").write_text(json.dumps(info))
        tmp.rename(self.root / f"step_{step}")

    def get_latest_checkpoint_path(self):
        steps = sorted((p for p in self.root.glob("step_*") if re.fullmatch(r"step_\d+", p.name)),
                       key=lambda p: int(p.name.split("_")[1]))
        return str(steps[-1]) if steps else None

    def load_training_info(self, path):
        return None if path is None else json.loads((Path(path) / "training_info.json").read_text())


def master_config(**grpo):
    return {"grpo": {"use_dynamic_sampling": False, "reward_shaping": {
        "enabled": True, "laconic": {"budget": B, "eta": ETA, "ceiling": CEIL}}, **grpo}}


def make_batch(seed: int, n: int = 8, slim: bool = False) -> UserDict:
    """A rollout batch as rollouts.py builds it: a user turn, an assistant turn, total_reward, truncated."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 13, (n,), generator=g)
    batch = UserDict()
    batch["message_log"] = [[{"role": "user", "content": "q", "token_ids": torch.arange(5)},
                             {"role": "assistant", "content": "a", "token_ids": torch.arange(int(L))}]
                            for L in lengths]
    batch["total_reward"] = torch.randint(0, 2, (n,), generator=g).to(torch.float32)
    batch["truncated"] = lengths >= 12
    if slim:
        batch["response_token_lengths"] = lengths.clone()
    return batch


class GRPOLoop:
    """grpo_train around the shaping call: shape (module global), baselines from total_reward, checkpoint."""

    def __init__(self, module, cfg, save_state, checkpointer):
        self.module, self.cfg, self.save_state, self.checkpointer = module, cfg, save_state, checkpointer

    def step(self, batch, total_steps: int):
        shaping = self.cfg["grpo"]["reward_shaping"]
        if shaping["enabled"]:  # grpo.py:3028-3031
            batch = self.module.apply_reward_shaping(batch, shaping)
        rewards = batch["total_reward"]  # grpo.py:3038
        self.save_state.total_steps = total_steps + 1  # grpo.py:3529
        self.checkpointer.save(total_steps + 1, vars(self.save_state))  # grpo.py:3578-3580
        return rewards


def reference_run(batches, lam=0.0):
    """float64 reference of every step: the rewards NeMo-RL gets and lambda after the step."""
    out = []
    for batch in batches:
        L = [int(m[1]["token_ids"].shape[0]) for m in batch["message_log"]]
        r = batch["total_reward"].tolist()
        shaped = [ri - lam * max((Li - B) / B, 0.0) for ri, Li in zip(r, L)]
        lam = min(max(lam + ETA * ((sum(L) / len(L)) / B - 1.0), 0.0), CEIL)
        out.append((shaped, lam))
    return out


def fake_grpo_module():
    def apply_reward_shaping(batch, cfg):  # NeMo-RL's own, which the plug-in must replace
        raise AssertionError("NeMo-RL's DAPO shaping was called instead of LACONIC")
    return types.SimpleNamespace(__name__="nemo_rl.algorithms.grpo", apply_reward_shaping=apply_reward_shaping)


def test_three_steps_shape_the_rewards_and_step_lambda_like_the_reference(tmp_path):
    module, cfg, state = fake_grpo_module(), master_config(), initial_save_state()
    ckpt = Checkpointer(tmp_path)
    shaping = LaconicRewardShaping.from_config(cfg).attach(cfg, ckpt, state, modules=[module])
    assert module.apply_reward_shaping is shaping
    batches = [make_batch(s) for s in range(3)]
    originals = [b["total_reward"].clone() for b in batches]
    ref = reference_run([make_batch(s) for s in range(3)])
    loop = GRPOLoop(module, cfg, state, ckpt)
    for step, (batch, original, (shaped, lam)) in enumerate(zip(batches, originals, ref)):
        rewards = loop.step(batch, step)
        assert rewards.dtype == torch.float32
        assert torch.equal(rewards, torch.tensor(shaped, dtype=torch.float64).to(torch.float32))
        assert torch.equal(batch["unshaped_total_reward"], original)
        assert shaping.state.lam == lam
    assert [h["next_lambda"] for h in shaping.history] == [lam for _, lam in ref]
    # the check has teeth: lambda moved and the last steps' rewards differ from the task rewards
    assert ref[-1][1] > 0 and not torch.equal(batches[-1]["total_reward"], originals[-1])
    # the state is in the checkpoint's training_info.json (vars of the save state)
    info = ckpt.load_training_info(ckpt.get_latest_checkpoint_path())
    assert info[SAVE_STATE_KEY]["multipliers"]["length"]["lam"] == ref[-1][1]


def test_resume_restores_lambda_exactly_from_training_info(tmp_path):
    batches = [make_batch(s) for s in range(4)]
    # uninterrupted run: 4 steps
    full = LaconicRewardShaping(master_config()["grpo"]["reward_shaping"]["laconic"])
    full_rewards = [full(make_batch(s), None)["total_reward"] for s in range(4)]
    # interrupted after 2 steps, then a new driver process resumes from step_2
    cfg, ckpt = master_config(), Checkpointer(tmp_path)
    module = fake_grpo_module()
    first = LaconicRewardShaping.from_config(cfg).attach(cfg, ckpt, initial_save_state(), modules=[module])
    loop = GRPOLoop(module, cfg, first._save_state, ckpt)
    for step in range(2):
        loop.step(batches[step], step)
    loaded = ckpt.load_training_info(ckpt.get_latest_checkpoint_path())
    resumed_state = get_grpo_save_state(loaded)
    assert not hasattr(resumed_state, SAVE_STATE_KEY)  # NeMo-RL drops it: the plug-in must read training_info
    module2 = fake_grpo_module()
    second = LaconicRewardShaping.from_config(cfg).attach(cfg, ckpt, resumed_state, modules=[module2])
    assert second.state.lam == full.history[1]["next_lambda"] and second.state.num_steps == 2
    loop2 = GRPOLoop(module2, cfg, resumed_state, ckpt)
    resumed_rewards = [loop2.step(batches[step], step) for step in (2, 3)]
    assert second.state.lam == full.state.lam
    assert [h["lambda"] for h in second.history] == [h["lambda"] for h in full.history[2:]]
    assert all(torch.equal(a, b) for a, b in zip(resumed_rewards, full_rewards[2:]))


def test_lengths_follow_nemo_rl_rule_slim_field_first_then_first_assistant_message():
    batch = make_batch(0, slim=True)
    batch["response_token_lengths"] = torch.full((8,), 3)
    assert response_lengths(batch).tolist() == [3] * 8
    batch = make_batch(0)
    batch["message_log"][0].append({"role": "assistant", "content": "more", "token_ids": torch.arange(99)})
    assert response_lengths(batch)[0] == batch["message_log"][0][1]["token_ids"].shape[0]
    batch["message_log"][1] = batch["message_log"][1][:1]
    with pytest.raises(ValueError, match="sample 1 of the batch has no assistant message"):
        response_lengths(batch)


def test_hit_cap_uses_nemo_rl_truncated_flags():
    shaping = LaconicRewardShaping({"budget": B, "eta": ETA, "hit_cap": 0.5, "lambda_init": 0.0})
    batch = make_batch(1)
    want = batch["total_reward"] - 0.5 * batch["truncated"].to(torch.float32)
    assert batch["truncated"].any()
    assert torch.equal(shaping(batch, None)["total_reward"], want)


def test_metrics_go_to_nemo_rl_logger_with_its_step_number():
    calls = []
    logger = types.SimpleNamespace(log_metrics=lambda m, step, prefix="": calls.append((m, step, prefix)))
    shaping = LaconicRewardShaping({"budget": B, "eta": ETA}, logger=logger)
    for s in range(2):
        shaping(make_batch(s), None)
    assert [(c[1], c[2]) for c in calls] == [(1, "train"), (2, "train")]
    assert calls[1][0]["laconic/lambda"] == shaping.history[1]["lambda"]


@pytest.mark.parametrize("grpo, message", [
    ({"use_dynamic_sampling": True}, "grpo.use_dynamic_sampling must be false"),
    ({"reward_shaping": {"enabled": False, "laconic": {"budget": B, "eta": ETA}}},
     "grpo.reward_shaping.enabled must be true"),
])
def test_attach_refuses_what_the_loop_cannot_support(tmp_path, grpo, message):
    cfg = master_config(**grpo)
    with pytest.raises(ValueError, match=message):
        LaconicRewardShaping({"budget": B, "eta": ETA}).attach(cfg, Checkpointer(tmp_path), initial_save_state(),
                                                               modules=[fake_grpo_module()])


def test_config_errors_name_the_nemo_rl_key():
    with pytest.raises(ValueError, match="'grpo.reward_shaping.laconic' is required"):
        LaconicRewardShaping.from_config({"grpo": {"reward_shaping": {"enabled": True}}})
    with pytest.raises(ValueError, match="grpo.reward_shaping.laconic.eta must be"):
        LaconicRewardShaping({"budget": B, "eta": -1})


def test_the_example_config_and_script_wire_the_plug_in():
    cfg = yaml.safe_load((ROOT / "examples/integrations/nemo_rl_grpo_laconic.yaml").read_text())
    assert cfg["defaults"] == "grpo_math_1B.yaml"
    shaping = LaconicRewardShaping.from_config(cfg)
    assert shaping.state.settings.budget == 1000 and shaping.state.settings.max_length == 4096
    assert cfg["grpo"]["reward_shaping"]["enabled"] is True and cfg["grpo"]["use_dynamic_sampling"] is False
    script = (ROOT / "examples/integrations/nemo_rl_grpo_laconic.py").read_text()
    attach = script.index("LaconicRewardShaping.from_config(master_config, logger=logger).attach(master_config, "
                          "checkpointer, grpo_state)")
    assert attach < script.index("grpo.grpo_train(")


def test_the_band_shapes_with_both_multipliers_and_logs_lambda_lo():
    """grpo.reward_shaping.laconic.band: the reward NeMo-RL gets holds the lower bound's term and the metrics
    its multiplier, both following the float64 reference."""
    calls = []
    logger = types.SimpleNamespace(log_metrics=lambda m, step, prefix="": calls.append(m))
    shaping = LaconicRewardShaping({"budget": B, "eta": ETA, "ceiling": CEIL, "band": 0.9}, logger=logger)
    lam, lo = 0.0, 0.0
    for s in range(3):
        batch = make_batch(s)
        L = [int(m[1]["token_ids"].shape[0]) for m in batch["message_log"]]
        r = batch["total_reward"].tolist()
        want = [ri - lam * max((Li - B) / B, 0.0) - lo * max((0.9 * B - Li) / (0.9 * B), 0.0) for ri, Li in zip(r, L)]
        got = shaping(batch, None)["total_reward"]
        assert torch.allclose(got.to(torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-6)
        assert calls[-1]["laconic/lambda_lo"] == pytest.approx(lo, abs=1e-15)
        mean = sum(L) / len(L)
        lam = min(max(lam + ETA * (mean / B - 1.0), 0.0), CEIL)
        lo = min(max(lo + ETA * (1.0 - (mean / B) / 0.9), 0.0), CEIL)
    assert lo > 0 and "laconic/mean_band_penalty" in calls[-1]
    assert shaping.state.state_dict()["multipliers"]["length_lo"]["lam"] == pytest.approx(lo, abs=1e-15)
