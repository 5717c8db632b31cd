"""Contract tests of vLLM 0.33's own weight transfer in the vLLM rollout engine (laconic_nemo/rollout/vllm.py,
laconic_nemo/rollout/vllm_transfer.py). vLLM needs a GPU (and 0.33 needs torch 2.14), so it cannot run here: the
stand-in modules below have exactly the upstream signatures of the calls the engine makes, read in the wheel
``vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl`` (the file and line of each is on its stand-in), and reproduce
the behaviour the engine relies on (the sender guard, the order of the update calls, the worker's refusal of an
update outside start/finish). The refit of vLLM 0.10.1.1 (no transfer API) is tests/test_vllm_engine.py's.

The policy is a real megatron-core GPTModel built from a tiny Hugging Face Qwen2 by the project's bridge (CPU), so
the tensors vLLM receives are compared with the checkpoint's own.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import sys
import types
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from bridge_common import hf_checkpoint_tensors, tiny_hf_model  # noqa: E402

from laconic_nemo.bridge import arch_from_hf_config, hf_names, load_hf_state_dict, model_provider  # noqa: E402
from laconic_nemo.grpo.interfaces import GenerationOutput, SamplingParams  # noqa: E402
from laconic_nemo.rollout import vllm as rv  # noqa: E402
from laconic_nemo.rollout import vllm_transfer as vt  # noqa: E402

torch.set_num_threads(1)
SAMPLING = SamplingParams(temperature=0.6, top_p=1.0, max_new_tokens=4, eos_id=9, seed=1)


# ------------------------------------------------------------------------------------ vLLM 0.33.0 stand-ins
@dataclasses.dataclass
class WeightTransferConfig:
    """vllm/config/weight_transfer.py:9-17: one field, ``backend`` (default "nccl")."""

    backend: str = "nccl"


@dataclasses.dataclass(frozen=True)
class ParamMeta:
    """vllm/distributed/weight_transfer/base.py:132-160: ``name, dtype, shape`` and keyword-only ownership."""

    name: str
    dtype: torch.dtype
    shape: tuple
    owners: tuple | None = dataclasses.field(default=None, kw_only=True)
    mesh_shape: tuple | None = dataclasses.field(default=None, kw_only=True)
    placements: tuple | None = dataclasses.field(default=None, kw_only=True)


class WeightSource(ABC):
    """base.py:215-273: ``metadata`` must be a functools.cached_property (``__init_subclass__`` :236-245);
    ``owned_names(rank)`` :256-258; ``implements_iter_full()`` :260-261; ``iter_full()`` :266-268."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        metadata = cls.__dict__.get("metadata")
        if metadata is not None and not isinstance(metadata, functools.cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

    @property
    @abstractmethod
    def metadata(self) -> list:
        raise NotImplementedError

    def owned_names(self, rank: int) -> list:
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not WeightSource.iter_full

    def iter_full(self):
        raise NotImplementedError


@dataclasses.dataclass
class IPCTrainerInitInfo:
    """vllm/distributed/weight_transfer/ipc_engine.py:47-59 (with base.py:371-404 ``TrainerInitInfo``): keyword-only
    ``rank``, ``backend = "ipc"``, ``packed``, ``packed_buffer_size_bytes``; rank 0 is the sender."""

    backend: ClassVar[str] = "ipc"
    rank: int = dataclasses.field(kw_only=True)
    packed: bool = False
    packed_buffer_size_bytes: int = 1024 * 1024 * 1024

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class IPCTrainerEngine:
    """ipc_engine.py:251-472 as far as the calls go: ``trainer_init`` (:283-316) checks the source and, on the
    sender, ships ``{"packed": ...}``; ``send_weights`` (:318-329) runs start / the update (here the tensors stand
    for their IPC handles) / finish on the sender only, every rank iterating the source."""

    made: list = []

    def __init__(self, client, source, is_sender, packed):
        self.client, self.source, self.is_sender, self.packed = client, source, is_sender, packed
        self.sends = 0

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None or not source.implements_iter_full():
            raise TypeError("IPC needs a WeightSource with iter_full()")
        if len(source.owned_names(init_info.rank)) != len(source.metadata):
            raise ValueError("IPC needs every trainer rank to own every parameter")
        engine = cls(client, source, init_info.is_sender, init_info.packed)
        if engine.is_sender:
            engine.client.init_weight_transfer_engine({"packed": init_info.packed})
        cls.made.append(engine)
        return engine

    def send_weights(self) -> None:
        self.sends += 1
        if self.is_sender:
            self.client.start_weight_update()
        pairs = list(self.source.iter_full())
        if self.is_sender:
            self.client.update_weights({"names": [n for n, _ in pairs],
                                        "dtype_names": [str(t.dtype).split(".")[-1] for _, t in pairs],
                                        "shapes": [list(t.shape) for _, t in pairs],
                                        "ipc_handles": {"GPU-stand-in": [t.clone() for _, t in pairs]}})
            self.client.finish_weight_update()


class WeightTransferTrainerFactory:
    """vllm/distributed/weight_transfer/factory.py:167-214: ``trainer_init(init_info, *, client, source=None)``
    dispatches on ``init_info.backend`` (registered: nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n)."""

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if init_info.backend != "ipc":
            raise ValueError(f"Invalid weight transfer backend: {init_info.backend}")
        return IPCTrainerEngine.trainer_init(init_info, client=client, source=source)


class LLM:
    """vllm.LLM of 0.33.0 as the engine uses it. ``__init__`` (vllm/entrypoints/llm.py:177-336: ``model``, then
    keyword-only ``tensor_parallel_size``, ``dtype``, ``seed``, ``gpu_memory_utilization``, the rest ``**kwargs`` into
    ``EngineArgs``, whose fields are checked here: vllm/engine/arg_utils.py:520 max_model_len, :531
    distributed_executor_backend, :547 device_ids, :799 enable_sleep_mode, :866 weight_transfer_config);
    ``sleep(level=1, mode="abort")`` :839 (level 2 discards the weights); ``wake_up(tags=None) -> bool`` :872;
    ``generate(prompts, sampling_params=None, *, use_tqdm=True, ...)`` :417-427; ``collective_rpc`` :573-579; the four
    transfer calls of vllm/entrypoints/rl/offline.py: ``init_weight_transfer_engine(request)`` :12-27,
    ``start_weight_update()`` :33-35, ``update_weights(request)`` :41-54, ``finish_weight_update(weight_version=None)``
    :56-60; the worker refuses an update outside start / finish (vllm/v1/worker/gpu_worker.py:1592-1609, :1633-1643)."""

    ENGINE_ARGS = {"max_model_len", "distributed_executor_backend", "device_ids", "enable_sleep_mode",
                   "weight_transfer_config"}
    made: list = []

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, dtype: str = "auto", seed: int = 0,
                 gpu_memory_utilization: float = 0.92, **kwargs: Any):
        unknown = set(kwargs) - self.ENGINE_ARGS
        if unknown:
            raise TypeError(f"EngineArgs has no field {sorted(unknown)}")
        self.model, self.tp, self.kwargs = model, tensor_parallel_size, kwargs
        self.log: list = []
        self.weights: dict | None = {"checkpoint": True}
        self.packed = None
        self.updating = False
        LLM.made.append(self)

    def sleep(self, level: int = 1, mode: str = "abort"):
        self.log.append(f"sleep{level}")
        if level == 2:
            self.weights = None

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.log.append(f"wake_up:{','.join(tags or [])}")
        return tags is None or "kv_cache" in tags

    def init_weight_transfer_engine(self, request) -> None:
        init_info = request["init_info"] if isinstance(request, dict) else request.init_info
        self.log.append(("init", dict(init_info)))
        self.packed = init_info["packed"]

    def start_weight_update(self) -> None:
        self.log.append("start")
        self.updating = True

    def update_weights(self, request) -> None:
        update_info = request["update_info"] if isinstance(request, dict) else request.update_info
        if not self.updating:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        tensors = update_info["ipc_handles"]["GPU-stand-in"]
        self.log.append(("update", list(update_info["names"])))
        self.received = dict(zip(update_info["names"], tensors))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if not self.updating:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.log.append("finish")
        self.updating = False
        self.weights = self.received

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, lora_request=None, priority=None,
                 tokenization_kwargs=None, mm_processor_kwargs=None):
        if self.weights is None:
            raise AssertionError("generated with discarded weights")
        self.log.append("generate")
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[5, 9], finish_reason="stop")])
                for _ in prompts]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        raise AssertionError("the transfer path never runs a callable on vLLM's workers")


def _modules(transfer: bool = True, llm_cls=LLM) -> dict[str, types.ModuleType]:
    """sys.modules entries of a vLLM 0.33.0 stand-in (``transfer=False``: the 0.10.1.1 layout, no transfer)."""
    vllm = types.ModuleType("vllm")
    vllm.LLM = llm_cls
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    mods = {"vllm": vllm, "vllm.inputs": inputs}
    if transfer:
        config = types.ModuleType("vllm.config")
        config.WeightTransferConfig = WeightTransferConfig
        wt = types.ModuleType("vllm.distributed.weight_transfer")
        wt.WeightTransferTrainerFactory, wt.WeightSource, wt.ParamMeta = WeightTransferTrainerFactory, WeightSource, \
            ParamMeta
        ipc = types.ModuleType("vllm.distributed.weight_transfer.ipc_engine")
        ipc.IPCTrainerInitInfo = IPCTrainerInitInfo
        mods.update({"vllm.config": config, "vllm.distributed": types.ModuleType("vllm.distributed"),
                     "vllm.distributed.weight_transfer": wt, "vllm.distributed.weight_transfer.ipc_engine": ipc})
    return mods


@pytest.fixture
def stand_in(monkeypatch):
    """Install a vLLM stand-in: ``stand_in(transfer=True, llm_cls=LLM)``; the refit choice is made afresh."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.setenv(var, "")  # recorded, so that teardown restores what was there
        monkeypatch.delenv(var)
    LLM.made.clear()
    IPCTrainerEngine.made.clear()

    def install(transfer: bool = True, llm_cls=LLM):
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            monkeypatch.delitem(sys.modules, name)
        for name, mod in _modules(transfer, llm_cls).items():
            monkeypatch.setitem(sys.modules, name, mod)
        vt.transfer_api.cache_clear()

    yield install
    vt.transfer_api.cache_clear()


@pytest.fixture(scope="module")
def policy():
    """A megatron-core GPTModel loaded from a tiny HF Qwen2 through the bridge, and that checkpoint's tensors."""
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    init_distributed(1, 1, seed=0)
    cfg, hf = tiny_hf_model("qwen2")
    arch = arch_from_hf_config(cfg)
    model = model_provider(arch, cpu=True)(True, True).eval()
    load_hf_state_dict([model], hf.state_dict(), arch)
    yield types.SimpleNamespace(arch=arch, chunks=[model], tensors=hf_checkpoint_tensors(hf, arch.tie_word_embeddings))
    destroy_distributed()


class Group(vt.TensorGroup):
    """A tensor-parallel group whose rank 0's rollout is given (``shared``), for the ranks that hold no engine."""

    def __init__(self, rank: int, uuids: tuple, shared=None):
        super().__init__(rank=rank, size=len(uuids), gpu_uuids=uuids)
        self.shared, self.calls = shared, 0

    def share(self, value):
        self.calls += 1
        return value if self.rank == 0 else self.shared


def _engine(tmp_path, policy, refit="auto", rank=0, shared=None):
    (tmp_path / "hf").mkdir(exist_ok=True)
    return rv.VLLMRolloutEngine(str(tmp_path / "hf"), policy.arch, tensor_parallel_size=2, refit=refit,
                                group=Group(rank, ("GPU-aaaa", "GPU-bbbb"), shared), dtype="bfloat16")


def test_refit_is_decided_once_from_what_the_installed_vllm_provides(stand_in, tmp_path, policy):
    """vLLM 0.33.0's names present: the transfer; any of them missing (the 0.10.1.1 layout, or an LLM without one of
    the four control calls): the hand-written refit, in-process on every rank; ``ipc`` forced without them is
    refused, ``rpc`` forced with them takes the hand-written path."""
    stand_in(transfer=True)
    assert vt.transfer_api() is vt.transfer_api() is not None and vt.choose_refit("auto") is vt.transfer_api()
    e = _engine(tmp_path, policy)
    (llm,) = LLM.made
    assert e.transfer is not None and llm.kwargs["weight_transfer_config"] == WeightTransferConfig(backend="ipc")
    assert llm.kwargs["device_ids"] == ["GPU-aaaa", "GPU-bbbb"] and llm.tp == 2
    assert "distributed_executor_backend" not in llm.kwargs and llm.kwargs["enable_sleep_mode"] is True
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ  # vLLM's engine runs in its own processes
    # the IPC handles go to that process through collective_rpc's msgpack, which takes them only with pickle allowed
    # (vllm/v1/serial_utils.py:220-233, :476-480)
    assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert llm.log == ["sleep2"]

    LLM.made.clear()
    del os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"]
    rpc = _engine(tmp_path, policy, refit="rpc")
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ
    assert rpc.transfer is None and LLM.made[0].kwargs["distributed_executor_backend"] == "external_launcher"

    class NoFinish(LLM):
        finish_weight_update = None

    stand_in(transfer=True, llm_cls=NoFinish)
    assert vt.transfer_api() is None
    stand_in(transfer=False)
    assert vt.transfer_api() is None and vt.choose_refit("auto") is None
    with pytest.raises(ValueError, match="rollout.vllm.refit = ipc needs vLLM's weight transfer"):
        vt.choose_refit("ipc")
    with pytest.raises(ValueError, match="rollout.vllm.refit must be one of"):
        vt.choose_refit("nccl")


def test_ipc_refit_sends_the_policy_through_vllms_update_calls(stand_in, tmp_path, policy):
    """A rollout at a new policy version on the group's rank 0: wake the weights, build the trainer engine once
    (its init ships ``{"init_info": {"packed": True}}``), then ``start_weight_update`` / ``update_weights({"update_info":
    ...})`` / ``finish_weight_update``, then the KV cache and the sampling, then asleep again. vLLM receives every
    HF tensor of the checkpoint, in the bridge's order, in vLLM's dtype, equal to the checkpoint's."""
    stand_in(transfer=True)
    engine = _engine(tmp_path, policy)
    (llm,) = LLM.made
    out = engine.generate_from(policy.chunks, 0, [[1, 2]], SAMPLING)
    assert out.tokens.tolist() == [[1, 2, 5, 9]]
    assert llm.log == ["sleep2", "wake_up:weights", ("init", {"packed": True}), "start",
                       ("update", hf_names(policy.arch)), "finish", "wake_up:kv_cache", "generate", "sleep2"]
    assert sorted(llm.received) == sorted(policy.tensors)
    for name, t in policy.tensors.items():
        assert llm.received[name].dtype == torch.bfloat16 and torch.equal(llm.received[name], t.to(torch.bfloat16))
    (sender,) = IPCTrainerEngine.made
    assert sender.is_sender and sender.packed
    # the next version: the same trainer engine, another update; the same version after a level-2 sleep: refit again
    engine.generate_from(policy.chunks, 1, [[1]], SAMPLING)
    engine.generate_from(policy.chunks, 1, [[1]], SAMPLING)
    assert IPCTrainerEngine.made == [sender] and sender.sends == 3
    assert [e for e in llm.log if isinstance(e, tuple) and e[0] == "init"] == [("init", {"packed": True})]
    assert engine.needs_refit
    with pytest.raises(RuntimeError, match="call refit"):
        engine.generate([[1]], SAMPLING)


def test_ranks_without_an_engine_export_and_receive_the_rollout_of_their_group(stand_in, tmp_path, policy):
    """Rank 1 of a tensor-parallel group starts no vLLM and never drives vLLM's update (its trainer engine is not the
    sender: rank != 0), yet it refits and sleeps in step with rank 0 (the IPC handles are gathered over every rank)
    and returns its group's rollout."""
    stand_in(transfer=True)
    owner_out = GenerationOutput(tokens=torch.tensor([[1, 2, 5, 9]]), prompt_lengths=torch.tensor([2]),
                                 response_lengths=torch.tensor([2]), lengths=torch.tensor([1]),
                                 truncated=torch.tensor([False]))
    engine = _engine(tmp_path, policy, rank=1, shared=owner_out)
    assert engine.llm is None and LLM.made == [] and engine.needs_refit
    out = engine.generate_from(policy.chunks, 0, [[1, 2]], SAMPLING)
    assert out is owner_out and engine.group.calls == 1
    (sender,) = IPCTrainerEngine.made
    assert not sender.is_sender and isinstance(sender.client, vt.NoEngine) and sender.sends == 1
    assert engine.needs_refit  # asleep like its group's engine: the next rollout refits on every rank alike
    with pytest.raises(RuntimeError, match="without a vLLM engine"):
        sender.client.start_weight_update()


def test_transfer_metadata_is_what_the_bridge_yields_in_order(stand_in, policy):
    """The weight source's metadata (names, shapes, dtype) is exactly what its ``iter_full`` yields, in order: the
    contract of every trainer engine (base.py:243-255; the NCCL engine checks it tensor by tensor,
    nccl_engine.py:410-446); the source subclass passes the installed vLLM's ``__init_subclass__`` check."""
    stand_in(transfer=True)
    api = vt.transfer_api()
    source = vt.bridge_source(api, policy.chunks, policy.arch, torch.bfloat16)
    assert isinstance(source, WeightSource) and source.implements_iter_full()
    pairs = list(source.iter_full())
    assert [(m.name, m.shape, m.dtype) for m in source.metadata] == [(n, tuple(t.shape), t.dtype) for n, t in pairs]
    assert source.owned_names(3) == [n for n, _ in pairs]
    gc.collect()


def test_the_client_wraps_the_trainer_calls_in_vllms_request_dicts():
    """LLMSyncClient: the trainer engines' protocol (base.py:617-642, plain dicts) onto the offline LLM's request
    dicts (offline.py:12-60): ``{"init_info": ...}``, ``{"update_info": ...}``, and the weight version passed on."""
    calls = []
    llm = types.SimpleNamespace(init_weight_transfer_engine=lambda r: calls.append(("init", r)),
                                start_weight_update=lambda: calls.append("start"),
                                update_weights=lambda r: calls.append(("update", r)),
                                finish_weight_update=lambda v=None: calls.append(("finish", v)))
    c = vt.LLMSyncClient(llm)
    c.init_weight_transfer_engine({"packed": True})
    c.start_weight_update()
    c.update_weights({"names": ["a"]})
    c.finish_weight_update("7")
    assert calls == [("init", {"init_info": {"packed": True}}), "start", ("update", {"update_info": {"names": ["a"]}}),
                     ("finish", "7")]


def test_tensor_group_of_one_process_is_this_gpu():
    """One process (with or without megatron's parallel state): rank 0 of a group of one, this GPU's UUID; its
    rollout is its own."""
    g = vt.tensor_group(uuid=lambda: "GPU-only")
    assert (g.rank, g.size, g.gpu_uuids) == (0, 1, ("GPU-only",)) and g.share("x") == "x"
