"""vLLM rollout engine with in-memory weight refit from a megatron-core policy (GPU only).

Written against the vLLM V1 offline API: ``vllm.LLM(model, tensor_parallel_size, gpu_memory_utilization,
enable_sleep_mode, seed, dtype, max_model_len, ...)``, ``LLM.generate(prompts, sampling_params, use_tqdm)``,
``vllm.SamplingParams``, ``vllm.inputs.TokensPrompt``, ``LLM.sleep(level)`` and ``LLM.wake_up(tags)`` (vLLM 0.10.1.1
and 0.33.0 alike: ``vllm/entrypoints/llm.py:839-870``, ``:872-889`` in 0.33.0).

Two refits, chosen once from what the installed vLLM provides (:func:`laconic_nemo.rollout.vllm_transfer.choose_refit`,
``rollout.vllm.refit``):

* ``ipc``, vLLM's own weight transfer (vLLM 0.33): vLLM runs as its own engine on the GPUs of each tensor-parallel
  group, started by the group's rank 0; every refit hands the policy's full HF tensors over by CUDA IPC through the
  trainer engine of :mod:`laconic_nemo.rollout.vllm_transfer` (its module docstring cites the upstream calls); the
  group's rank 0 samples and the others receive its rollout.
* ``rpc``, the hand-written refit (vLLM 0.10.1.1, the frozen ``containers/Dockerfile.vllm-0.10`` image): every
  training rank (torchrun) hosts the vLLM worker of its own rank in-process (``distributed_executor_backend=
  "external_launcher"``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here), and ``LLM.collective_rpc(callable)`` runs
  ``worker.model_runner.model.load_weights(iterable)`` with (HF name, full tensor) pairs on it; the model's own
  loader shards them for vLLM's tensor parallelism.

Placement: colocated only. vLLM sleeps (weights and KV cache released) while megatron trains and wakes up for rollouts;
``tensor_parallel_size`` of vLLM is the megatron TP size. vLLM on separate GPUs is refused: it needs a channel across
GPUs (vLLM's NCCL weight transfer) and a placement of its own, neither of which exists here.

Memory and weights across sleep: ``sleep(level=2)`` DISCARDS the weights (``LLM.sleep``: "Level 2: Discard all GPU
memory (weights + KV cache)", meant for updating the model), so the engine records it on every rank and refuses to
generate until the next :meth:`refit` (``needs_refit``). Before every ``wake_up`` the engine runs
``gc.collect(); torch.cuda.empty_cache()``: vLLM's ``CuMemAllocator.wake_up`` maps fresh memory, while PyTorch's
caching allocator still holds the blocks of the training step unless they are handed back to the driver first.

What runs on CPU (and is tested): the weight stream (``stream_policy_weights``: the names and shapes vLLM's
``load_weights`` expects are the HF ones), the choice of refit and the upstream calls with a stand-in vLLM of the
upstream signatures, and the conversion of vLLM outputs into a :class:`~laconic_nemo.grpo.interfaces.GenerationOutput`
(``build_generation_output``).
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Callable, Collection, Iterable, Iterator

import torch

from laconic_nemo.bridge.arch import ModelArch
from laconic_nemo.bridge.mapping import iter_hf_tensors
from laconic_nemo.config import Config
from laconic_nemo.grpo.interfaces import GenerationOutput, SamplingParams
from laconic_nemo.rollout.vllm_transfer import TensorGroup, choose_refit, ipc_sender, tensor_group, transfer_names


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            "rollout.engine=vllm needs the `vllm` package and a GPU (pip install laconic-nemo[vllm] in the "
            "container); use rollout.engine=megatron on CPU"
        ) from exc
    return vllm


def stream_policy_weights(model_chunks, arch: ModelArch, sink: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
                          dtype: torch.dtype | None = None) -> int:
    """Export the policy with the bridge and hand (HF name, full tensor) pairs to ``sink`` (vLLM's
    ``model.load_weights``). Collective over the model-parallel ranks: the iterator is drained to its end
    even if ``sink`` stops early, so every rank takes part in every gather/broadcast. ``sink=None`` on
    ranks that own no engine. Returns the number of tensors streamed."""
    count = 0

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal count
        for name, t in iter_hf_tensors(model_chunks, arch):
            count += 1
            yield name, (t.to(dtype) if dtype is not None and t.dtype != dtype else t)

    it = gen()
    if sink is not None:
        sink(it)
    for _ in it:  # drain (keeps the collectives in step)
        pass
    return count


def build_generation_output(prompts: list[list[int]], responses: list[list[int]], finish_reasons: list[str],
                            eos_id: int, max_new_tokens: int, pad_id: int = 0,
                            stop_ids: Collection[int] | None = None) -> GenerationOutput:
    """Assemble a GenerationOutput from per-sample response token ids.

    responses[i]: generated ids; finish_reasons[i]: "stop" (ended on a stop token or string) or "length"
    (cut at max_new_tokens). stop_ids: the token ids that end a response (default: ``eos_id`` only; vLLM also
    stops on the ``eos_token_id`` list of the model's generation_config). A response whose last token is a
    stop id keeps it as its end token, whatever the finish reason (vLLM reports "length" when the
    ``max_tokens``-th token is EOS); a "stop" response without a stop id at the end (stop string) gets one
    ``eos_id`` appended. lengths exclude the end token; a truncated response has lengths = max_new_tokens."""
    stops = {int(eos_id)} if stop_ids is None else {int(i) for i in stop_ids} | {int(eos_id)}
    if not (len(prompts) == len(responses) == len(finish_reasons)):
        raise ValueError(f"prompts, responses, finish_reasons differ in length: "
                         f"{len(prompts)}, {len(responses)}, {len(finish_reasons)}")
    rows, p_len, r_len, lengths, trunc = [], [], [], [], []
    for p, r, fin in zip(prompts, responses, finish_reasons):
        r = list(r)
        if fin not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {fin!r}")
        if len(r) > max_new_tokens:
            raise ValueError(f"response of {len(r)} tokens exceeds max_new_tokens={max_new_tokens}")
        if r and r[-1] in stops:
            truncated = False
            length = len(r) - 1
        elif fin == "length":
            truncated = True
            length = max_new_tokens
        else:
            r.append(eos_id)
            truncated = False
            length = len(r) - 1
        rows.append(list(p) + r)
        p_len.append(len(p))
        r_len.append(len(r))
        lengths.append(length)
        trunc.append(truncated)
    T = max(len(x) for x in rows) if rows else 0
    tokens = torch.full((len(rows), T), pad_id, dtype=torch.long)
    for i, x in enumerate(rows):
        tokens[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    return GenerationOutput(tokens=tokens, prompt_lengths=torch.tensor(p_len, dtype=torch.long),
                            response_lengths=torch.tensor(r_len, dtype=torch.long),
                            lengths=torch.tensor(lengths, dtype=torch.long), truncated=torch.tensor(trunc))


def generation_stop_ids(model_path: str) -> set[int]:
    """The ``eos_token_id`` (int or list) of ``model_path/generation_config.json``, which vLLM adds to every
    request's stop ids (``SamplingParams.update_from_generation_config``); empty when absent."""
    f = Path(model_path) / "generation_config.json"
    try:
        eos = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
    except (OSError, ValueError):
        eos = None
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def release_torch_cache() -> None:
    """Hand PyTorch's cached (free) GPU blocks back to the driver before vLLM maps its memory again."""
    gc.collect()
    torch.cuda.empty_cache()


class VLLMRolloutEngine:
    """Rollouts with vLLM, same interface as the megatron sampler: ``generate(prompts, sampling)``.

    model_path: HF checkpoint directory of the initial policy (config + tokenizer; vLLM loads it once);
    arch: its :class:`ModelArch`; tensor_parallel_size, gpu_memory_utilization, max_model_len, dtype: vLLM
    settings; colocate: must be True (on the training GPUs, asleep between rollouts); refit: ``rollout.vllm.refit``
    (auto | rpc | ipc, the module docstring); owns_engine: whether this rank starts a vLLM engine (None: every rank
    with the hand-written refit, the tensor-parallel group's rank 0 with vLLM's transfer); group: the
    tensor-parallel group (:func:`laconic_nemo.rollout.vllm_transfer.tensor_group` when None; collective).
    """

    def __init__(self, model_path: str, arch: ModelArch, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None, dtype: str = "bfloat16",
                 colocate: bool = True, owns_engine: bool | None = None, seed: int = 0, pad_id: int = 0,
                 refit: str = "auto", group: TensorGroup | None = None):
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if not colocate:
            raise ValueError("rollout.vllm.colocate = false is not supported: vLLM on separate GPUs needs a weight "
                             "channel across GPUs and a placement of its own; use colocate = true")
        self.arch = arch
        self.colocate = colocate
        self.pad_id = pad_id
        self.llm = None
        self._torch_dtype = getattr(torch, dtype)
        self.stop_ids = generation_stop_ids(model_path)
        self.transfer = choose_refit(refit)  # None: the hand-written refit
        self.group = group if group is not None else (tensor_group() if self.transfer is not None else TensorGroup())
        if owns_engine is None:
            owns_engine = self.transfer is None or self.group.rank == 0
        self._weights_loaded = False  # vLLM's copy matches the policy (False after a level-2 sleep), on every rank
        self._sender = None  # the trainer engine of vLLM's transfer, built at the first refit
        if owns_engine:
            vllm = _import_vllm()
            kwargs = dict(model=model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                          gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                          enable_sleep_mode=colocate)
            if self.transfer is None:
                # the refit hands vLLM's worker a Python iterator: the engine core must run in this process
                os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
                kwargs["distributed_executor_backend"] = "external_launcher"
            else:
                # vLLM's own engine process(es) on this group's GPUs; weights by CUDA IPC. The IPC handles (tuples of
                # types, dtypes and bytes) reach the engine process through collective_rpc, whose msgpack encoder
                # takes them only with pickle allowed (vllm/v1/serial_utils.py:220-233 to encode, :476-480 to decode,
                # in 0.33.0); both ends are this job's own processes.
                os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
                kwargs["weight_transfer_config"] = self.transfer.WeightTransferConfig(backend="ipc")
                kwargs["device_ids"] = list(self.group.gpu_uuids)
            self.llm = vllm.LLM(**kwargs)
            self._vllm = vllm
            self.llm.sleep(level=2)  # training runs first; weights come from the first refit
        self._asleep = colocate
        self._refit_version: int | None = None  # the policy version (optimiser steps) of the last refit

    @property
    def needs_refit(self) -> bool:
        """True when vLLM holds no valid policy weights (never refitted, or discarded by a level-2 sleep); the same on
        every rank of a group with vLLM's transfer, whose refit is collective over all ranks."""
        takes_part = self.llm is not None or self.transfer is not None
        return takes_part and not self._weights_loaded

    # -------------------------------------------------------------------------------------------- refit
    def refit(self, model_chunks) -> int:
        """Copy the current megatron policy into vLLM, in memory (collective over the training ranks)."""
        if self.llm is not None and self._asleep:
            release_torch_cache()
            self.llm.wake_up(tags=["weights"])
        if self.transfer is not None:
            return self._send(model_chunks)
        sink = None
        if self.llm is not None:
            def sink(weights):
                def load(worker):
                    worker.model_runner.model.load_weights(weights=weights)

                return self.llm.collective_rpc(load)

        n = stream_policy_weights(model_chunks, self.arch, sink, dtype=self._torch_dtype)
        self._weights_loaded = self.llm is not None
        return n

    def _send(self, model_chunks) -> int:
        """vLLM's transfer: one trainer engine per rank for these model chunks, ``send_weights`` every refit (every
        rank: the IPC handles are all-gathered over the default process group)."""
        if self._sender is None or self._sender[0] is not model_chunks:
            rank = 0 if self.llm is not None else max(1, torch.distributed.get_rank())
            self._sender = (model_chunks, ipc_sender(self.transfer, self.llm, model_chunks, self.arch,
                                                     self._torch_dtype, rank))
        self._sender[1].send_weights()
        self._weights_loaded = True
        return len(transfer_names(self.arch))

    def sleep(self) -> None:
        """Release vLLM's GPU memory (weights and KV cache) while the policy trains (colocated)."""
        if self.colocate and not self._asleep:
            if self.llm is not None:
                self.llm.sleep(level=2)  # discards the weights: the next generate needs a refit
            self._asleep = True
            self._weights_loaded = False

    # ----------------------------------------------------------------------------------------- generate
    def generate_from(self, model_chunks, version: int, prompts: list[list[int]],
                      sampling: SamplingParams) -> GenerationOutput:
        """A rollout of the policy ``model_chunks`` at ``version`` (its optimiser steps so far): refitted into vLLM
        when the version changed since the last refit or vLLM discarded its weights (a colocated engine asleep),
        then :meth:`generate`, then asleep again (colocated: the memory goes back to training)."""
        if self._refit_version != version or self.needs_refit:
            self.refit(model_chunks)
            self._refit_version = version
        out = self.generate(prompts, sampling)
        self.sleep()
        return out

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """One response per prompt (token ids), sampled with ``sampling``; CPU tensors. With vLLM's transfer the
        group's rank 0 samples and every rank of the group returns its rollout (the group shares its prompts)."""
        if self.llm is None and self.transfer is None:
            raise RuntimeError("this rank owns no vLLM engine (owns_engine=False)")
        if self.needs_refit:
            raise RuntimeError("vLLM holds no valid policy weights (a level-2 sleep discarded them): call refit() "
                               "before generate()")
        result = self._sample(prompts, sampling) if self.llm is not None else None
        if self.transfer is not None:
            result = self.group.share(result)
        self._asleep = False  # awake on every rank (the engine of the group is), so that sleep() records it
        if self.colocate:
            self.sleep()
        return result

    def _sample(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        if self._asleep:
            release_torch_cache()
            self.llm.wake_up(tags=["kv_cache"])
        from vllm.inputs import TokensPrompt

        params = [self._vllm.SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                            max_tokens=sampling.max_new_tokens, seed=sampling.seed + i,
                                            stop_token_ids=sorted(self.stop_ids | set(sampling.stops())),
                                            ignore_eos=False)
                  for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        responses = [list(o.outputs[0].token_ids) for o in outs]
        reasons = ["length" if o.outputs[0].finish_reason == "length" else "stop" for o in outs]
        return build_generation_output(prompts, responses, reasons, sampling.eos_id, sampling.max_new_tokens,
                                       self.pad_id, stop_ids=self.stop_ids | set(sampling.stops()))

    @classmethod
    def from_recipe(cls, cfg: Config, model_path: str, arch: ModelArch, **kwargs) -> "VLLMRolloutEngine":
        """Build from a recipe: the ``rollout.vllm`` keys, TP and the run's seed."""
        v = cfg.rollout.vllm
        return cls(model_path, arch, tensor_parallel_size=cfg.parallel.tensor_model_parallel_size,
                   gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=v.max_model_len, dtype=v.dtype,
                   colocate=v.colocate, seed=cfg.run.seed, refit=v.refit, **kwargs)


def sampling_from_recipe(cfg: Config, eos_id: int, seed: int = 0) -> SamplingParams:
    """SamplingParams from the recipe's ``rollout`` section (temperature, top_p, max_new_tokens)."""
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, eos_id=eos_id,
                          seed=seed)
