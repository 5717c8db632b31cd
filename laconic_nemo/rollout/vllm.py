"""vLLM rollout engine with in-memory weight refit from a megatron-core policy (GPU only).

Written against the vLLM V1 offline API (vLLM 0.10.x; the calls used exist since 0.8.5):
``vllm.LLM(model, tensor_parallel_size, gpu_memory_utilization, enable_sleep_mode, distributed_executor_backend,
seed, dtype, max_model_len)``, ``LLM.generate(prompts, sampling_params, use_tqdm)``, ``vllm.SamplingParams``,
``vllm.inputs.TokensPrompt``, ``LLM.sleep(level)``, ``LLM.wake_up(tags)`` and ``LLM.collective_rpc(callable)``,
which runs a function on every vLLM worker; the function calls ``worker.model_runner.model.load_weights(iterable)``
with (HF name, full tensor) pairs, the model's own loader shards them for vLLM's tensor parallelism.

Placement: colocated only (``distributed_executor_backend="external_launcher"``): every training rank
(torchrun) hosts the vLLM worker of its own rank; vLLM sleeps (weights and KV cache released) while megatron
trains and wakes up for rollouts. ``tensor_parallel_size`` of vLLM is then the megatron TP size. The weight
iterator is handed to the worker in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here). vLLM on separate
GPUs is refused: vLLM's default ``UniProcExecutor`` puts every rank's engine on ``cuda:0`` and a multi-process
TP engine cannot receive the in-process weight iterator; it would need an NCCL weight channel.

Memory and weights across sleep: ``sleep(level=2)`` DISCARDS the weights (``vllm/entrypoints/llm.py``,
``LLM.sleep``), so the engine records it and refuses to generate until the next :meth:`refit`
(``needs_refit``). Before every ``wake_up`` the engine runs ``gc.collect(); torch.cuda.empty_cache()``: vLLM's
``CuMemAllocator.wake_up`` maps fresh memory, while PyTorch's caching allocator still holds the blocks
of the training step unless they are handed back to the driver first.

What runs on CPU (and is tested): the weight stream (``stream_policy_weights``: the names and shapes vLLM's
``load_weights`` expects are the HF ones) and the conversion of vLLM outputs into a
:class:`~laconic_nemo.grpo.interfaces.GenerationOutput` (``build_generation_output``).
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
    settings; colocate: must be True (inside the training ranks, external launcher, sleep between
    rollouts); owns_engine: False on ranks that only take part in the export.
    """

    def __init__(self, model_path: str, arch: ModelArch, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None, dtype: str = "bfloat16",
                 colocate: bool = True, owns_engine: bool = True, seed: int = 0, pad_id: int = 0):
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if not colocate:
            raise ValueError("rollout.vllm.colocate = false is not supported: vLLM on separate GPUs needs a weight "
                             "channel (every rank's engine would land on cuda:0); use colocate = true")
        self.arch = arch
        self.colocate = colocate
        self.pad_id = pad_id
        self.llm = None
        self._torch_dtype = getattr(torch, dtype)
        self.stop_ids = generation_stop_ids(model_path)
        self._weights_loaded = False  # vLLM's copy matches the policy (False after a level-2 sleep)
        if owns_engine:
            # the refit hands vLLM's worker a Python iterator: the engine core must run in this process
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            vllm = _import_vllm()
            kwargs = dict(model=model_path, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                          gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                          enable_sleep_mode=colocate)
            if colocate:
                kwargs["distributed_executor_backend"] = "external_launcher"
            self.llm = vllm.LLM(**kwargs)
            self._vllm = vllm
            self.llm.sleep(level=2)  # training runs first; weights come from the first refit
        self._asleep = colocate and owns_engine
        self._refit_version: int | None = None  # the policy version (optimiser steps) of the last refit

    @property
    def needs_refit(self) -> bool:
        """True when vLLM holds no valid policy weights (never refitted, or discarded by a level-2 sleep)."""
        return self.llm is not None and not self._weights_loaded

    # -------------------------------------------------------------------------------------------- refit
    def refit(self, model_chunks) -> int:
        """Copy the current megatron policy into vLLM, in memory (collective over the training ranks)."""
        sink = None
        if self.llm is not None:
            if self._asleep:
                release_torch_cache()
                self.llm.wake_up(tags=["weights"])

            def sink(weights):
                def load(worker):
                    worker.model_runner.model.load_weights(weights=weights)

                return self.llm.collective_rpc(load)

        n = stream_policy_weights(model_chunks, self.arch, sink, dtype=self._torch_dtype)
        self._weights_loaded = self.llm is not None
        return n

    def sleep(self) -> None:
        """Release vLLM's GPU memory (weights and KV cache) while the policy trains (colocated)."""
        if self.llm is not None and self.colocate and not self._asleep:
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
        """One response per prompt (token ids), sampled with ``sampling``; CPU tensors."""
        if self.llm is None:
            raise RuntimeError("this rank owns no vLLM engine (owns_engine=False)")
        if self.needs_refit:
            raise RuntimeError("vLLM holds no valid policy weights (a level-2 sleep discarded them): call refit() "
                               "before generate()")
        if self._asleep:
            release_torch_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        from vllm.inputs import TokensPrompt

        params = [self._vllm.SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                            max_tokens=sampling.max_new_tokens, seed=sampling.seed + i,
                                            stop_token_ids=sorted(self.stop_ids | set(sampling.stops())),
                                            ignore_eos=False)
                  for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        responses = [list(o.outputs[0].token_ids) for o in outs]
        reasons = ["length" if o.outputs[0].finish_reason == "length" else "stop" for o in outs]
        result = build_generation_output(prompts, responses, reasons, sampling.eos_id, sampling.max_new_tokens,
                                         self.pad_id, stop_ids=self.stop_ids | set(sampling.stops()))
        if self.colocate:
            self.sleep()
        return result

    @classmethod
    def from_recipe(cls, cfg: Config, model_path: str, arch: ModelArch, **kwargs) -> "VLLMRolloutEngine":
        """Build from a recipe: the ``rollout.vllm`` keys, TP and the run's seed."""
        v = cfg.rollout.vllm
        return cls(model_path, arch, tensor_parallel_size=cfg.parallel.tensor_model_parallel_size,
                   gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=v.max_model_len, dtype=v.dtype,
                   colocate=v.colocate, seed=cfg.run.seed, **kwargs)


def sampling_from_recipe(cfg: Config, eos_id: int, seed: int = 0) -> SamplingParams:
    """SamplingParams from the recipe's ``rollout`` section (temperature, top_p, max_new_tokens)."""
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, eos_id=eos_id,
                          seed=seed)
