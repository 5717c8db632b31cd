"""vLLM's own weight transfer for the colocated vLLM rollout engine (:mod:`laconic_nemo.rollout.vllm`), where the
installed vLLM has it; the hand-written refit (``collective_rpc`` + the model's ``load_weights``) where it has not.

Which refit runs is decided once, from what the installed vLLM provides (:func:`transfer_api`): the trainer-side
engine factory, the weight-source base class, the IPC init info, ``WeightTransferConfig`` and the four control
methods on ``vllm.LLM``. vLLM 0.33.0 has them all; vLLM 0.10.1.1 (the frozen ``containers/Dockerfile.vllm-0.10``
image) has none, and keeps the hand-written refit. ``rollout.vllm.refit`` (auto | rpc | ipc) can force either.

The upstream calls, as read in vllm-0.33.0 (the wheel ``vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl``):

* ``vllm/config/weight_transfer.py:9-17`` ``WeightTransferConfig(backend="ipc")``, passed to ``vllm.LLM(...,
  weight_transfer_config=...)``: the worker builds its receiving engine from it
  (``vllm/v1/worker/gpu_worker.py:606-608``); ``vllm/engine/arg_utils.py:547`` ``device_ids`` (GPU indices or
  UUIDs) places the engine's workers.
* ``vllm/distributed/weight_transfer/factory.py:167-214`` ``WeightTransferTrainerFactory.trainer_init(init_info, *,
  client, source)``: the trainer-side engine of ``init_info.backend``; for IPC
  (``vllm/distributed/weight_transfer/ipc_engine.py:47-59`` ``IPCTrainerInitInfo(*, rank, packed,
  packed_buffer_size_bytes)``, ``trainer_init`` ``:283-316``) every rank must own every parameter; rank 0 is the
  sender and calls ``client.init_weight_transfer_engine({"packed": ...})``.
* ``ipc_engine.py:318-329`` ``send_weights()``: on the sender ``client.start_weight_update()``, then the weights
  (CUDA IPC handles, all-gathered over the default process group, ``:339-376``, so every rank calls it), then
  ``client.update_weights(...)`` per packed chunk (``:423-444``, ``:446-472``) and ``client.finish_weight_update()``.
* ``vllm/distributed/weight_transfer/base.py:215-273`` ``WeightSource``: ``metadata`` must be a
  ``functools.cached_property`` (``__init_subclass__``, ``:236-245``), ``iter_full()`` yields ``(name, full tensor)``
  in metadata order; ``:133-160`` ``ParamMeta(name, dtype, shape)`` (no owners: every rank owns it).
* ``base.py:617-642`` the client protocol (``init_weight_transfer_engine(init_info)``, ``start_weight_update()``,
  ``update_weights(update_info)``, ``finish_weight_update(weight_version=None)``), and
  ``vllm/entrypoints/rl/offline.py:12-60`` the same four on ``vllm.LLM``, which take the request dicts
  ``{"init_info": ...}`` / ``{"update_info": ...}`` instead: :class:`LLMSyncClient` adapts one to the other.

Placement: CUDA IPC opens a handle in another process than the one that exported it (upstream's IPC examples run
the trainer and vLLM as separate processes on the same GPUs), so with the transfer vLLM runs as its own engine
(vLLM's multiprocessing engine, not the in-process external launcher of the hand-written refit) on the GPUs of the
tensor-parallel group, started by the group's rank 0 with ``device_ids`` = the group's GPU UUIDs (gathered over the
group, :func:`tensor_group`); every rank exports its full copy of each tensor and vLLM's worker on each GPU takes
the handle of its own GPU (``ipc_engine.py:218-238``); the group's rank 0 samples and hands the rollout to the
other ranks of the group (:meth:`TensorGroup.share`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from laconic_nemo.bridge.arch import ModelArch
from laconic_nemo.bridge.mapping import hf_names, hf_shapes, iter_hf_tensors

REFITS = ("auto", "rpc", "ipc")  # rollout.vllm.refit
# what the transfer needs of the installed vLLM: (module, names) and the methods of vllm.LLM
NEEDED = (("vllm.distributed.weight_transfer", ("WeightTransferTrainerFactory", "WeightSource", "ParamMeta")),
          ("vllm.distributed.weight_transfer.ipc_engine", ("IPCTrainerInitInfo",)),
          ("vllm.config", ("WeightTransferConfig",)))
LLM_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


@dataclass(frozen=True)
class TransferAPI:
    """The installed vLLM's weight-transfer names (:func:`transfer_api`)."""

    WeightTransferTrainerFactory: Any
    WeightSource: Any
    ParamMeta: Any
    IPCTrainerInitInfo: Any
    WeightTransferConfig: Any


@functools.cache
def transfer_api() -> TransferAPI | None:
    """The weight-transfer API of the installed vLLM, or None where it lacks any part of it (or vLLM is absent):
    decided once per process."""
    import importlib

    found: dict[str, Any] = {}
    try:
        for module, names in NEEDED:
            mod = importlib.import_module(module)
            for name in names:
                found[name] = getattr(mod, name)
        llm = importlib.import_module("vllm").LLM
    except (ImportError, AttributeError):
        return None
    if not all(callable(getattr(llm, m, None)) for m in LLM_METHODS):
        return None
    return TransferAPI(**found)


def choose_refit(refit: str) -> TransferAPI | None:
    """The refit ``rollout.vllm.refit`` asks for: the transfer API (``ipc``, or ``auto`` where the installed vLLM has
    it) or None for the hand-written refit (``rpc``, or ``auto`` without it). ``ipc`` without it is an error."""
    if refit not in REFITS:
        raise ValueError(f"rollout.vllm.refit must be one of {', '.join(REFITS)}, got {refit!r}")
    if refit == "rpc":
        return None
    api = transfer_api()
    if api is None and refit == "ipc":
        raise ValueError("rollout.vllm.refit = ipc needs vLLM's weight transfer (vLLM 0.33: "
                         "vllm.distributed.weight_transfer); the installed vLLM has none: use auto or rpc")
    return api


class LLMSyncClient:
    """The trainer engines' client protocol (``base.py:617-642``) over an offline ``vllm.LLM``, whose methods take
    request dicts (``vllm/entrypoints/rl/offline.py:12-60``)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class NoEngine:
    """The client of a rank that holds no vLLM engine: upstream's trainer engines call the client on the sender only
    (``ipc_engine.py:314-327``, ``:460-461``), so any call here is a bug."""

    def _refuse(self, *args, **kwargs):
        raise RuntimeError("a rank without a vLLM engine was asked to drive vLLM's weight update")

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = _refuse


def transfer_names(arch: ModelArch) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor :func:`laconic_nemo.bridge.mapping.iter_hf_tensors` yields, in its order
    (the order the transfer's metadata must have)."""
    shapes = hf_shapes(arch)
    return [(n, shapes[n]) for n in hf_names(arch)]


@functools.cache
def _source_class(base: type, param_meta: Callable) -> type:
    """A ``WeightSource`` subclass of the installed vLLM over the bridge's export (one per vLLM, built once)."""

    class BridgeSource(base):
        """The policy as full HF tensors (the bridge's export, collective over the model-parallel ranks) in the
        transfer dtype; every rank owns every tensor."""

        def __init__(self, model_chunks, arch: ModelArch, dtype: torch.dtype):
            self.model_chunks, self.arch, self.dtype = model_chunks, arch, dtype

        @functools.cached_property
        def metadata(self):
            return [param_meta(name, self.dtype, shape) for name, shape in transfer_names(self.arch)]

        def iter_full(self):
            for name, tensor in iter_hf_tensors(self.model_chunks, self.arch):
                yield name, tensor if tensor.dtype == self.dtype else tensor.to(self.dtype)

    return BridgeSource


def bridge_source(api: TransferAPI, model_chunks, arch: ModelArch, dtype: torch.dtype):
    """The weight source of ``model_chunks`` for the installed vLLM's trainer engines."""
    return _source_class(api.WeightSource, api.ParamMeta)(model_chunks, arch, dtype)


def ipc_sender(api: TransferAPI, llm, model_chunks, arch: ModelArch, dtype: torch.dtype, rank: int):
    """The IPC trainer engine of this rank (every rank builds one; ``rank`` 0 holds ``llm`` and drives vLLM's update,
    the others only export their handles). Packed: the tensors travel in 1 GiB buffers (the default of
    ``packed_buffer_size_bytes``) instead of a full copy of the model held until the update finishes."""
    info = api.IPCTrainerInitInfo(rank=rank, packed=True)
    client = LLMSyncClient(llm) if llm is not None else NoEngine()
    return api.WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                         source=bridge_source(api, model_chunks, arch, dtype))


# ------------------------------------------------------------------------------------------ the TP group
@dataclass
class TensorGroup:
    """The tensor-parallel group of this rank (megatron's), for the engine's placement: rank, size, the global rank
    of its rank 0, the process group (None: one process), the GPU UUIDs of its ranks."""

    rank: int = 0
    size: int = 1
    src: int = 0
    group: Any = None
    gpu_uuids: tuple[str, ...] = ()

    def share(self, value):
        """``value`` of the group's rank 0 on every rank of the group (collective)."""
        if self.group is None or self.size == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


def gpu_uuid() -> str:
    """The UUID of this process's current CUDA device (what vLLM's ``device_ids`` and IPC handles are keyed by)."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def tensor_group(uuid: Callable[[], str] = gpu_uuid) -> TensorGroup:
    """This rank's :class:`TensorGroup` (collective over the group: the UUIDs are all-gathered)."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        ps = None
    if ps is None or not ps.model_parallel_is_initialized() or not torch.distributed.is_initialized():
        return TensorGroup(gpu_uuids=(uuid(),))
    group = ps.get_tensor_model_parallel_group()
    size = ps.get_tensor_model_parallel_world_size()
    uuids: list = [None] * size
    torch.distributed.all_gather_object(uuids, uuid(), group=group)
    return TensorGroup(rank=ps.get_tensor_model_parallel_rank(), size=size,
                       src=torch.distributed.get_global_rank(group, 0), group=group, gpu_uuids=tuple(uuids))
