"""Start-up of megatron-core: CPU patches, torch.distributed and model-parallel initialisation.

megatron-core (0.11.0, 0.16.1) is written for CUDA, but its model, tensor-parallel layers, pipeline schedules and
plain (non-distributed) optimizer run on CPU over the gloo backend once a handful of hard CUDA calls
are redirected. :func:`apply_cpu_patches` does exactly that and nothing else; every patch only turns a
call that would raise without CUDA into its CPU equivalent, so it is a no-op when CUDA is available.
See ``docs/megatron_cpu.md`` for the list and the reasons.

Typical use (every rank, SPMD, launched with torchrun or as a single process)::

    info = init_distributed(tp=2, pp=1, seed=1234)
    ...  # build the model with megatron-core
    destroy_distributed()
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ParallelInfo", "free_port", "apply_cpu_patches", "cpu_patches_applied", "init_distributed", "parallel_info",
           "destroy_distributed"]

_PATCHED = False

# Modules of megatron-core that create tensors with a literal ``device="cuda"`` (or call ``.cuda()``,
# ``torch.cuda.synchronize``) on code paths used by a dense GPT with the plain optimizer.
_DEVICE_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
)


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec ("cuda", "cuda:0", torch.device("cuda"), an int index) to "cpu"."""
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


def _redirect_device(fn):
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "wrapper")
    return wrapper


class _CpuCudaNamespace(types.SimpleNamespace):
    """Stand-in for ``torch.cuda`` inside the patched megatron modules: device queries answer "cpu",
    synchronisation is a no-op, RNG calls go to the CPU generator; anything else falls through."""

    def __getattr__(self, name: str) -> Any:  # only called for names not set below
        return getattr(torch.cuda, name)


def _make_cpu_cuda_namespace() -> _CpuCudaNamespace:
    return _CpuCudaNamespace(
        current_device=lambda: "cpu",
        synchronize=lambda *a, **k: None,
        is_available=lambda: False,
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        manual_seed=lambda seed: torch.manual_seed(seed),
        random=types.SimpleNamespace(
            get_rng_state=lambda *a, **k: torch.get_rng_state(),
            set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        ),
    )


class _CpuTorchProxy(types.ModuleType):
    """A view of ``torch`` for one megatron module: tensor factories map ``device="cuda"`` to CPU and
    ``torch.cuda`` is the CPU namespace above. Everything else is the real ``torch``."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")

    def __init__(self):
        super().__init__("torch")
        self.cuda = _make_cpu_cuda_namespace()
        for name in self._FACTORIES:
            setattr(self, name, _redirect_device(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def cpu_patches_applied() -> bool:
    """True once :func:`apply_cpu_patches` has patched megatron-core for CPU."""
    return _PATCHED


def apply_cpu_patches() -> bool:
    """Make megatron-core (0.11.0, 0.16.1) run on CPU (idempotent). Returns True when patches are active.

    Does nothing (returns False) when CUDA is available. The patches, each confined to a call that
    raises without CUDA:

    1. ``torch.cuda.current_device`` returns ``"cpu"`` (RoPE, tensor-parallel layers, the global memory
       buffer and the DDP grad buffer allocate on ``torch.cuda.current_device()``).
    2. ``torch.cuda.synchronize`` is a no-op (p2p communication, timers).
    3. ``torch.Tensor.cuda`` returns the tensor itself (``torch.tensor(0).cuda()`` in the schedules).
    4. In the modules of ``_DEVICE_LITERAL_MODULES`` the name ``torch`` is a proxy whose tensor factories
       map ``device="cuda"`` to CPU (found_inf/scale buffers of the optimizer, grad-norm buffers of
       clip_grads, token counters of the schedules, l2-norm buffers of utils, the default causal mask of
       transformer.utils).
    5. The model-parallel RNG tracker keeps CPU generator states: ``tensor_parallel.random``'s
       ``_get_cuda_rng_state``/``_set_cuda_rng_state`` and its ``torch.cuda`` RNG calls use
       ``torch.get_rng_state``/``torch.set_rng_state``/``torch.manual_seed``, so
       ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` work.
    """
    global _PATCHED
    if torch.cuda.is_available():
        return False
    if _PATCHED:
        return True

    import importlib

    # 1-3: global, only reachable on a CUDA-less machine where they would raise.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None

    def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    torch.Tensor.cuda = _tensor_cuda

    # 4: device literals.
    for name in _DEVICE_LITERAL_MODULES:
        module = importlib.import_module(name)
        module.torch = _CpuTorchProxy()

    # 5: RNG tracker on the CPU generator.
    random_mod = importlib.import_module("megatron.core.tensor_parallel.random")
    random_mod.torch = _CpuTorchProxy()

    def _get_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    random_mod._get_cuda_rng_state = _get_rng_state
    random_mod._set_cuda_rng_state = _set_rng_state
    # modules that imported the helpers by name
    for name in ("megatron.core.tensor_parallel",):
        module = importlib.import_module(name)
        if hasattr(module, "_get_cuda_rng_state"):
            module._get_cuda_rng_state = _get_rng_state
        if hasattr(module, "_set_cuda_rng_state"):
            module._set_cuda_rng_state = _set_rng_state

    _PATCHED = True
    return True


@dataclass
class ParallelInfo:
    """Where this process sits in the (TP, PP, DP) grid.

    world_size, rank: global; tp/pp/dp *_size and *_rank: within the model-parallel groups;
    dp_group: the data-parallel process group (sum gradients, all-reduce rollout statistics);
    device: torch.device for tensors of this rank ("cpu" over gloo, "cuda:<local_rank>" over NCCL);
    backend: "gloo" or "nccl".
    """

    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    dp_group: Any
    device: torch.device
    backend: str

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0


THREADS_ENV = "LACONIC_THREADS"


def cpu_threads() -> int:
    """torch's intra-op threads per process of the CPU entry points (train, eval): ``LACONIC_THREADS``, default 1
    (the ranks of a run share the cores; the thread count also sets how a CPU matmul splits its sums)."""
    return max(1, int(os.environ.get(THREADS_ENV, "1")))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(tp: int, pp: int, backend: str = "auto", seed: int = 0,
                     timeout_s: float | None = None) -> ParallelInfo:
    """Initialise torch.distributed and megatron's model-parallel state; seed every generator.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun). Without them a
    single-process world is created. ``tp * pp`` must divide the world size; DP = world / (tp * pp).
    backend: "auto" (nccl with CUDA, else gloo), "nccl" or "gloo".
    seed: base seed; megatron's model-parallel RNG tracker gets ``seed + 2718 + tp_rank`` as usual and
    the default generator gets ``seed`` (identical on all ranks, so CPU initialisation is identical).
    timeout_s: how long a collective may wait before it fails, for the default group and every megatron
    group (None: torch's default for the default group, megatron's 30 minutes for its groups).
    """
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"backend must be one of auto|nccl|gloo, got {backend!r}")
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA; use 'gloo' or 'auto' on CPU")
    if not use_cuda:
        apply_cpu_patches()

    from datetime import timedelta

    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=float(timeout_s))}
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ:  # torchrun / srun / the local launcher
            dist.init_process_group(backend=backend, **timeout)
        else:
            # A one-process world on a private loopback port. The environment is left untouched, so
            # child processes (e.g. a launcher started from a test) do not inherit RANK / WORLD_SIZE.
            dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1, **timeout)
    world_size = dist.get_world_size()
    if world_size % (tp * pp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp}")

    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        extra = {} if timeout_s is None else {"distributed_timeout_minutes": float(timeout_s) / 60.0}
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **extra
        )

    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    # model_parallel_cuda_manual_seed reseeds "cuda" (the CPU generator on CPU) with the data-parallel
    # seed, which equals ``seed``; set it again explicitly so CPU and GPU runs start alike.
    torch.manual_seed(seed)

    return parallel_info(tp, pp)


def parallel_info(tp: int | None = None, pp: int | None = None) -> ParallelInfo:
    """This rank's layout once :func:`init_distributed` has run (the entry point calls it; the actor only
    reads it). RuntimeError when it has not run; ValueError when ``tp`` / ``pp`` (if given) differ from it."""
    from megatron.core import parallel_state

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        raise RuntimeError("torch.distributed and megatron's parallel state are not initialised: the entry point "
                           "calls laconic_nemo.runtime.megatron_env.init_distributed(tp, pp, ...) before building the actor")
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if (tp is not None and tp != tp_size) or (pp is not None and pp != pp_size):
        raise ValueError(f"the recipe asks for TP {tp} x PP {pp} but megatron's parallel state was initialised "
                         f"with TP {tp_size} x PP {pp_size}")
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return ParallelInfo(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_size=tp_size,
        pp_size=pp_size,
        dp_size=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_group=parallel_state.get_data_parallel_group(),
        device=device,
        backend=backend,
    )


def destroy_distributed() -> None:
    """Tear down megatron's parallel state and the torch.distributed process group (idempotent)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
