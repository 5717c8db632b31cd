"""Contract tests of the colocated vLLM rollout engine (vLLM needs a GPU, so it cannot run here).

The stand-in ``vllm`` module below encodes the behaviour of vLLM 0.10.1.1 that the engine relies on, read
in the wheel ``vllm-0.10.1.1-cp38-abi3-manylinux1_x86_64.whl``:

* ``vllm/entrypoints/llm.py:1538-1558`` ``LLM.sleep``: "Level 2 sleep will discard both the model weights
  and the kv cache. The content of both the model weights and kv cache is forgotten."
  (``vllm/v1/worker/gpu_worker.py:96-111``: level 2 offloads no tag, ``CuMemAllocator.sleep`` unmaps all.)
* ``vllm/device_allocator/cumem.py:212-233`` ``CuMemAllocator.wake_up`` maps new memory for every tagged
  allocation without releasing PyTorch's cache (only ``sleep`` runs ``gc.collect(); torch.cuda.empty_cache()``,
  lines 209-210), so blocks cached by the training step stay reserved unless the caller frees them first.
* ``vllm/sampling_params.py:437-461`` ``update_from_generation_config``: the ``eos_token_id`` list of the
  model's generation_config joins every request's ``stop_token_ids``; ``vllm/v1/core/sched/utils.py:10-35``
  ``check_stop``: the stop token stays in ``output_token_ids`` (finish "stop"), and a request that reaches
  ``max_tokens`` is LENGTH_CAPPED (finish "length") even when that last token is EOS (line 13-16 run first).
* ``vllm/executor/uniproc_executor.py:25-33``: without a device index every engine uses ``local_rank = 0``,
  so separate-GPU engines of all ranks would share ``cuda:0`` (colocate = false is refused).
* vLLM 0.10.1.1 has no ``vllm.distributed.weight_transfer`` package (the wheel's ``vllm/distributed/`` holds none),
  so the engine takes the hand-written refit there (vLLM 0.33's transfer: tests/test_vllm_transfer.py).
"""

from __future__ import annotations

import gc
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from laconic_nemo.config import ConfigError, load_config
from laconic_nemo.grpo.interfaces import SamplingParams
from laconic_nemo.rollout import vllm as rv
from laconic_nemo.rollout import vllm_transfer as vt

ROOT = Path(__file__).resolve().parent.parent


class FakeLLM:
    """vllm.LLM as far as the engine uses it (see the module docstring for the upstream lines)."""

    def __init__(self, log: list, outputs: list, **kwargs):
        self.kwargs, self.log, self.outputs = kwargs, log, outputs
        self.weights = "checkpoint"  # vLLM loads model_path at construction

    def sleep(self, level: int = 1):
        self.log.append(f"sleep{level}")
        if level == 2:
            self.weights = None  # discarded, not offloaded

    def wake_up(self, tags=None):
        self.log.append(f"wake_up:{','.join(tags or [])}")

    def collective_rpc(self, fn):
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(
            model=types.SimpleNamespace(load_weights=self._load)))
        return [fn(worker)]

    def _load(self, weights):
        self.weights = dict(weights)
        self.log.append("load_weights")

    def generate(self, prompts, params, use_tqdm=False):
        if self.weights is None:
            raise AssertionError("generated with discarded weights")
        self.log.append("generate")
        self.last_params = params
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, finish_reason=fin)])
                for ids, fin in self.outputs[: len(prompts)]]


@pytest.fixture
def fake_vllm(monkeypatch):
    """Install the stand-in ``vllm`` module and a recorder of gc.collect / torch.cuda.empty_cache calls."""
    log: list[str] = []
    outputs: list = []
    mod = types.ModuleType("vllm")
    mod.LLM = lambda **kw: FakeLLM(log, outputs, **kw)
    mod.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    vt.transfer_api.cache_clear()  # the refit is chosen from this stand-in, not from an earlier one
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty_cache"))
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: (log.append("gc"), real_collect(*a))[1])

    def fake_stream(model_chunks, arch, sink, dtype=None):
        if sink is not None:
            sink(iter([("w", torch.ones(2))]))
        return 1

    monkeypatch.setattr(rv, "stream_policy_weights", fake_stream)
    yield types.SimpleNamespace(log=log, outputs=outputs)
    vt.transfer_api.cache_clear()


def _engine(tmp_path, eos_ids=None):
    model = tmp_path / "hf"
    model.mkdir(exist_ok=True)
    if eos_ids is not None:
        (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return rv.VLLMRolloutEngine(str(model), arch=None, colocate=True, pad_id=0)


SAMPLING = SamplingParams(temperature=0.6, top_p=1.0, max_new_tokens=4, eos_id=9, seed=1)


def test_vllm_without_the_transfer_gets_the_hand_written_refit_in_process(fake_vllm, tmp_path):
    """The 0.10.1.1 stand-in has no weight-transfer API: every rank hosts its vLLM worker in-process (the external
    launcher, V1 multiprocessing off) and the refit loads the weights through collective_rpc."""
    import os

    engine = _engine(tmp_path)
    assert engine.transfer is None and vt.transfer_api() is None
    assert engine.llm.kwargs["distributed_executor_backend"] == "external_launcher"
    assert "weight_transfer_config" not in engine.llm.kwargs and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    engine.refit([None])
    assert fake_vllm.log[-1] == "load_weights" and not engine.needs_refit


def test_second_generate_without_training_refits_discarded_weights(fake_vllm, tmp_path):
    """An evaluation rollout or a retry (no optimiser step in between) must not run on the weights that
    the level-2 sleep after the previous rollout discarded."""
    engine = _engine(tmp_path)
    fake_vllm.outputs[:] = [([5, 9], "stop")]
    first = engine.generate_from([None], 0, [[1, 2]], SAMPLING)  # the actor's call: its model, its step count
    second = engine.generate_from([None], 0, [[1, 2]], SAMPLING)  # same step: no training
    assert first.tokens.tolist() == second.tokens.tolist() == [[1, 2, 5, 9]]
    assert fake_vllm.log.count("load_weights") == 2
    assert engine.needs_refit  # asleep again, weights gone
    with pytest.raises(RuntimeError, match="refit"):
        engine.generate([[1, 2]], SAMPLING)


def test_torch_cache_released_before_every_wake_up(fake_vllm, tmp_path):
    engine = _engine(tmp_path)
    fake_vllm.outputs[:] = [([5, 9], "stop")]
    for _ in range(2):
        engine.refit([None])
        engine.generate([[1]], SAMPLING)
        engine.sleep()
    wakes = [i for i, e in enumerate(fake_vllm.log) if e.startswith("wake_up")]
    assert len(wakes) == 4
    for i in wakes:
        assert fake_vllm.log[i - 2 : i] == ["gc", "empty_cache"], fake_vllm.log


def test_stop_on_generation_config_eos_keeps_the_sampled_token(fake_vllm, tmp_path):
    """Qwen-style generation_config (eos [im_end, endoftext]): a response that stopped on the id that is not
    ``sampling.eos_id`` keeps that token as its end; nothing unsampled is appended."""
    engine = _engine(tmp_path, eos_ids=[7, 9])
    fake_vllm.outputs[:] = [([5, 7], "stop"), ([5, 6, 6, 9], "length"), ([5, 6, 6, 6], "length")]
    engine.refit([None])
    out = engine.generate([[1], [2], [3]], SAMPLING)
    assert out.tokens.tolist() == [[1, 5, 7, 0, 0], [2, 5, 6, 6, 9], [3, 5, 6, 6, 6]]
    assert out.response_lengths.tolist() == [2, 4, 4]
    assert out.lengths.tolist() == [1, 3, 4]  # end token excluded; an EOS at max_tokens is an end, not a cut
    assert out.truncated.tolist() == [False, False, True]
    assert sorted(engine.llm.last_params[0].stop_token_ids) == [7, 9]


def test_build_generation_output_stop_ids():
    out = rv.build_generation_output([[1]], [[4, 7]], ["stop"], eos_id=9, max_new_tokens=4, pad_id=0, stop_ids={7})
    assert out.tokens.tolist() == [[1, 4, 7]] and out.lengths.tolist() == [1]


def test_separate_gpu_placement_refused(fake_vllm, tmp_path):
    with pytest.raises(ValueError, match="colocate"):
        rv.VLLMRolloutEngine(str(tmp_path), arch=None, colocate=False)
    recipe = ROOT / "recipes" / "qwen3_8b_b1000.yaml"
    with pytest.raises(ConfigError, match="rollout.vllm.colocate"):
        load_config(recipe, ["rollout.engine=vllm", "rollout.vllm.colocate=false"])
