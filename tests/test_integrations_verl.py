"""The verl plug-in (laconic_nemo/integrations/verl.py) through verl 0.9.1's own functions on CPU.

verl's registry and trainer functions import on CPU without GPUs, vLLM or a Ray cluster (installed with
``pip install --no-deps verl==0.9.1`` plus the few packages they import, containers/cpu_integrations_venv.sh), so
the tests run the real ``core_algos`` registry, the v1 trainer's ``compute_advantage_for_multi_trajectories`` ->
``ray_trainer.compute_advantage`` -> our estimator -> verl's own ``grpo`` estimator, verl's
``build_checkpoint_callback`` and ``find_latest_ckpt_path``, and Hydra composition of verl's packaged
``ppo_trainer.yaml`` with the example's overrides. What the v1 trainer does around them (once per ``_step_once``:
advantages on the driver, then the update; ``_save_checkpoint`` writes ``global_step_N`` and the tracker file, then
calls ``on_save``) is cited in the plug-in's docstring; here the test plays the trainer's part. Skipped unless verl
is installed (the integrations tier of .ci/run).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.integration_frameworks import framework

verl = framework("verl")
from hydra import compose, initialize_config_dir  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback  # noqa: E402
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories  # noqa: E402

import laconic_nemo.integrations.verl as lv  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "integrations" / "verl_laconic.sh"
CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
SWITCH = ["algorithm.adv_estimator=laconic",
          "trainer.checkpoint_callback_class=laconic_nemo.integrations.verl.LaconicCheckpointCallback"]
B, ETA, LAM0, CEILING, G, T = 5, 0.05, 0.2, 1.0, 4, 10


def verl_config(*overrides):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=list(overrides))


@pytest.fixture
def cfg(tmp_path):
    lv._ACTIVE = None  # a fresh driver process
    yield verl_config(*SWITCH, f"+algorithm.laconic.budget={B}", f"+algorithm.laconic.eta={ETA}",
                      f"+algorithm.laconic.lambda_init={LAM0}", f"+algorithm.laconic.ceiling={CEILING}",
                      f"trainer.default_local_dir={tmp_path / 'ckpt'}")
    lv._ACTIVE = None


def make_batch(seed: int, padding: int = 2):
    """3 prompts x G responses in a shuffled order (as after verl's balance_batch), + padding rows (all-zero mask)."""
    g = torch.Generator().manual_seed(seed)
    n = 3 * G
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    scores = torch.randint(0, 2, (n,), generator=g).to(torch.float32)
    uids = np.array([f"u{i // G}" for i in range(n)] + [f"pad_{i}" for i in range(padding)], dtype=object)
    lengths = torch.cat([lengths, torch.zeros(padding, dtype=torch.long)])
    scores = torch.cat([scores, torch.zeros(padding)])
    order = torch.randperm(n + padding, generator=g)
    lengths, scores, uids = lengths[order], scores[order], uids[order.numpy()]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.long)
    tlr = torch.zeros(n + padding, T)
    real = lengths > 0
    tlr[real, lengths[real] - 1] = scores[real]  # the score on the last response token
    return DataProto.from_dict(tensors={"token_level_rewards": tlr, "response_mask": mask}, non_tensors={"uid": uids})


def reference(data, lam, norm=True):
    """float64 advantages [bs, T] and the batch's mean L over real rows: Lagrangian reward, then per-uid
    (s - mean) / (unbiased std + 1e-6), as verl's GRPO (core_algos.py:306-334), written out."""
    mask = data.batch["response_mask"].to(torch.float64)
    L = mask.sum(-1)
    r = data.batch["token_level_rewards"].to(torch.float64).sum(-1)
    s = [float(ri) - lam * max((float(Li) - B) / B, 0.0) if Li > 0 else 0.0 for ri, Li in zip(r, L)]
    uids = list(data.non_tensor_batch["uid"])
    adv = []
    for i, u in enumerate(uids):
        group = [s[j] for j, v in enumerate(uids) if v == u]
        if len(group) == 1:
            adv.append(s[i])
            continue
        mean = sum(group) / len(group)
        std = (sum((x - mean) ** 2 for x in group) / (len(group) - 1)) ** 0.5
        adv.append((s[i] - mean) / (std + 1e-6) if norm else s[i] - mean)
    real = L > 0
    return torch.tensor(adv, dtype=torch.float64)[:, None] * mask, float(L[real].sum() / real.sum())


def advantages(data, config):
    """What the v1 trainer's _compute_advantage calls (v1/trainer_base.py:1774-1784)."""
    keys = [f"{u}_0_0" for u in data.non_tensor_batch["uid"]]
    out = compute_advantage_for_multi_trajectories(data, batch_keys=keys, adv_estimator=config.algorithm.adv_estimator,
                                                   num_repeat=G, config=config.algorithm)
    return out.batch["advantages"]


def test_importing_the_plug_in_registers_the_estimator_in_verls_registry():
    assert core_algos.get_adv_estimator_fn("laconic") is lv.compute_laconic_advantage


def test_advantages_and_lambda_through_verls_compute_advantage_match_a_float64_reference(cfg):
    callback = build_checkpoint_callback(cfg)
    assert isinstance(callback, lv.LaconicCheckpointCallback) and callback.state.lam == LAM0
    lam = LAM0
    for seed in range(3):
        data = make_batch(seed)
        want, mean = reference(data, lam)
        got = advantages(data, cfg)
        assert got.dtype == torch.float32 and torch.allclose(got.to(torch.float64), want, atol=2e-5, rtol=0)
        # padding rows are left out of the mean: with them it would be another number
        with_padding = float(data.batch["response_mask"].sum()) / len(data)
        assert with_padding != mean
        lam = min(max(lam + ETA * (mean / B - 1.0), 0.0), CEILING)
        assert callback.state.lam == lam and callback.history[-1]["mean_length"] == mean
    assert lam != LAM0
    rows = [json.loads(x) for x in callback.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["next_lambda"] == lam


def test_norm_adv_by_std_in_grpo_false_is_passed_to_verls_grpo(tmp_path):
    lv._ACTIVE = None
    config = verl_config(*SWITCH, f"+algorithm.laconic.budget={B}", f"+algorithm.laconic.eta={ETA}",
                         f"+algorithm.laconic.lambda_init={LAM0}", "algorithm.norm_adv_by_std_in_grpo=False",
                         f"trainer.default_local_dir={tmp_path}")
    build_checkpoint_callback(config)
    data = make_batch(7)
    want, _ = reference(data, LAM0, norm=False)
    assert torch.allclose(advantages(data, config).to(torch.float64), want, atol=2e-5, rtol=0)
    lv._ACTIVE = None


def test_lambda_is_saved_with_each_checkpoint_and_restored_on_resume(cfg, tmp_path):
    callback = build_checkpoint_callback(cfg)
    for seed in range(3):
        advantages(make_batch(seed), cfg)
    # the trainer's _save_checkpoint: global_step_3 written, the tracker file, then on_save
    # (verl/trainer/ppo/v1/trainer_base.py:948-1029)
    folder = Path(cfg.trainer.default_local_dir) / "global_step_3"
    folder.mkdir(parents=True)
    (folder.parent / "latest_checkpointed_iteration.txt").write_text("3")
    callback.on_save(trainer=None, global_step=3, checkpoint_dir=str(folder), async_save=False)
    saved = json.loads((folder / lv.STATE_FILE).read_text())
    assert saved["global_step"] == 3 and saved["multipliers"]["length"]["lam"] == callback.state.lam
    # a new driver resumes (resume_mode auto: verl's find_latest_ckpt_path on default_local_dir)
    lv._ACTIVE = None
    resumed = build_checkpoint_callback(cfg)
    assert resumed.state.lam == callback.state.lam and resumed.state.num_steps == 3
    data = make_batch(3)
    want, mean = reference(data, resumed.state.lam)
    assert torch.allclose(advantages(data, cfg).to(torch.float64), want, atol=2e-5, rtol=0)
    assert resumed.history[-1]["step"] == 4 and resumed.history[-1]["lambda"] == callback.state.lam
    # the other resume modes of _load_checkpoint (trainer_base.py:850-873)
    lv._ACTIVE = None
    cfg.trainer.resume_mode = "disable"
    assert build_checkpoint_callback(cfg).state.lam == LAM0
    cfg.trainer.resume_mode, cfg.trainer.resume_from_path = "resume_path", str(folder)
    assert build_checkpoint_callback(cfg).state.lam == callback.state.lam


def test_the_band_through_verls_compute_advantage_and_its_checkpoint(tmp_path):
    """+algorithm.laconic.band: the estimator prices the lower bound B_lo = rho B (0.9 x 8) with lambda_lo, moves it
    on the batch's mean length, logs it and saves it beside lambda (``length_lo``)."""
    lv._ACTIVE = None
    config = verl_config(*SWITCH, "+algorithm.laconic.budget=8", f"+algorithm.laconic.eta={ETA}",
                         f"+algorithm.laconic.ceiling={CEILING}", "+algorithm.laconic.band=0.9",
                         "+algorithm.laconic.band_eta=0.5", f"trainer.default_local_dir={tmp_path / 'ckpt'}")
    callback = build_checkpoint_callback(config)
    lo = 0.0
    for seed in range(3):
        data = make_batch(seed)
        mask = data.batch["response_mask"].to(torch.float64)
        L = mask.sum(-1)
        lam = callback.state.lam
        r = data.batch["token_level_rewards"].to(torch.float64).sum(-1)
        shaped = [float(ri) - lam * max((float(Li) - 8) / 8, 0.0) - lo * max((7.2 - float(Li)) / 7.2, 0.0)
                  if Li > 0 else 0.0 for ri, Li in zip(r, L)]
        got = callback.state.lagrangian_reward(r[L > 0], L[L > 0].to(torch.long))[0]
        assert got.tolist() == pytest.approx([s for s, Li in zip(shaped, L) if Li > 0], abs=1e-12)
        advantages(data, config)
        mean = float(L[L > 0].sum() / (L > 0).sum())
        assert callback.history[-1]["lambda_lo"] == pytest.approx(lo, abs=1e-15)
        lo = min(max(lo + 0.5 * (1.0 - (mean / 8) / 0.9), 0.0), CEILING)
        assert callback.state.band.value == pytest.approx(lo, abs=1e-15)
    assert lo > 0  # the batches' mean length (about 5.5) sits below B_lo = 7.2
    folder = Path(config.trainer.default_local_dir) / "global_step_3"
    folder.mkdir(parents=True)
    callback.on_save(trainer=None, global_step=3, checkpoint_dir=str(folder), async_save=False)
    saved = json.loads((folder / lv.STATE_FILE).read_text())
    assert saved["multipliers"]["length_lo"]["lam"] == callback.state.band.value
    lv._ACTIVE = None


def test_missing_wiring_and_bad_settings_are_refused_by_name(tmp_path):
    lv._ACTIVE = None
    data = make_batch(0)
    with pytest.raises(RuntimeError, match="trainer.checkpoint_callback_class=laconic_nemo.integrations.verl"):
        lv.compute_laconic_advantage(data.batch["token_level_rewards"], data.batch["response_mask"],
                                     index=data.non_tensor_batch["uid"])
    with pytest.raises(ValueError, match="'algorithm.laconic' is required"):
        build_checkpoint_callback(verl_config(*SWITCH))
    with pytest.raises(ValueError, match="unknown config key 'algorithm.laconic.budgte'"):
        build_checkpoint_callback(verl_config(*SWITCH, "+algorithm.laconic.budgte=5", "+algorithm.laconic.eta=0.1"))
    with pytest.raises(ValueError, match="algorithm.laconic.eta must be a finite number >= 0"):
        build_checkpoint_callback(verl_config(*SWITCH, "+algorithm.laconic.budget=5", "+algorithm.laconic.eta=-1"))


def example_overrides() -> list[str]:
    """The key=value overrides of the example's verl command, with $DATA expanded."""
    text = EXAMPLE.read_text().replace("\\\n", " ")
    command = next(line for line in text.splitlines() if "verl.trainer.main_ppo" in line)
    tokens = shlex.split(os.path.expandvars(command.replace("${DATA}", "/data").replace("$DATA", "/data")))
    return [t for t in tokens[tokens.index("verl.trainer.main_ppo") + 1:] if re.match(r"^\+?[\w.]+=", t)]


def test_the_example_composes_with_verls_config_and_builds_the_plug_in(tmp_path):
    overrides = example_overrides()
    assert SWITCH[0] in overrides and SWITCH[1] in overrides
    config = verl_config(*overrides, f"trainer.default_local_dir={tmp_path}")
    assert config.trainer.use_v1 is True  # the trainer that calls checkpoint callbacks (the default)
    lv._ACTIVE = None
    callback = build_checkpoint_callback(config)
    s = callback.state.settings
    assert (s.budget, s.eta, s.max_length) == (1000, 0.002, config.data.max_response_length)
    assert callback.state.multipliers["length"].ceiling == 1000 / (4096 - 1000)  # the paper's default ceiling
    lv._ACTIVE = None
