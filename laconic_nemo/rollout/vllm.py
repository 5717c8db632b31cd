"""vLLM rollout engine with in-memory weight refit from a megatron-core policy (GPU only).

Written against the vLLM V1 offline API (vLLM 0.10.x; the calls used exist since 0.8.5):
``vllm.LLM(model, tensor_parallel_size, gpu_memory_utilization, enable_sleep_mode, distributed_executor_backend,
seed, dtype, max_model_len)``, ``LLM.generate(prompts, sampling_params, use_tqdm)``, ``vllm.SamplingParams``,
``vllm.inputs.TokensPrompt``, ``LLM.sleep(level)``, ``LLM.wake_up(tags)`` and ``LLM.collective_rpc(callable)``,
which runs a function on every vLLM worker; the function calls ``worker.model_runner.model.load_weights(iterable)``
with (HF name, full tensor) pairs, the model's own loader shards them for vLLM's tensor parallelism.

Placement:
* colocated (``distributed_executor_backend="external_launcher"``): every training rank (torchrun) hosts the
  vLLM worker of its own rank; vLLM sleeps (weights and KV cache released) while megatron trains and wakes
  up for rollouts. ``tensor_parallel_size`` of vLLM is then the megatron TP size.
* separate GPUs: the default executor; only the ranks that own an engine load weights, the others only take
  part in the export collectives. The weight iterator is handed to the worker in-process, so the engine
  core runs in the calling process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here); a vLLM engine with its
  own multi-process workers on other GPUs would need an NCCL weight channel, which is not implemented.

What runs on CPU (and is tested): the weight stream (``stream_policy_weights``: the names and shapes vLLM's
``load_weights`` expects are the HF ones) and the conversion of vLLM outputs into a
:class:`~laconic_nemo.grpo.interfaces.GenerationOutput` (``build_generation_output``).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator

import torch

from laconic_nemo.bridge.arch import ModelArch
from laconic_nemo.bridge.mapping import iter_hf_tensors
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
                            eos_id: int, max_new_tokens: int, pad_id: int = 0) -> GenerationOutput:
    """Assemble a GenerationOutput from per-sample response token ids.

    responses[i]: generated ids (with or without a trailing EOS); finish_reasons[i]: "stop" (ended on EOS)
    or "length" (cut at max_new_tokens). A stopped response gets exactly one trailing EOS; lengths exclude
    it; a truncated response has lengths = max_new_tokens."""
    if not (len(prompts) == len(responses) == len(finish_reasons)):
        raise ValueError(f"prompts, responses, finish_reasons differ in length: "
                         f"{len(prompts)}, {len(responses)}, {len(finish_reasons)}")
    rows, p_len, r_len, lengths, trunc = [], [], [], [], []
    for p, r, fin in zip(prompts, responses, finish_reasons):
        r = list(r)
        if fin == "length":
            if len(r) > max_new_tokens:
                raise ValueError(f"response of {len(r)} tokens exceeds max_new_tokens={max_new_tokens}")
            truncated = True
            length = max_new_tokens
        elif fin == "stop":
            if not r or r[-1] != eos_id:
                r.append(eos_id)
            truncated = False
            length = len(r) - 1
        else:
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {fin!r}")
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


class VLLMRolloutEngine:
    """Rollouts with vLLM, same interface as the megatron sampler: ``generate(prompts, sampling)``.

    model_path: HF checkpoint directory of the initial policy (config + tokenizer; vLLM loads it once);
    arch: its :class:`ModelArch`; tensor_parallel_size, gpu_memory_utilization, max_model_len, dtype: vLLM
    settings; colocate: run inside the training ranks (external launcher, sleep between rollouts);
    owns_engine: False on ranks that only take part in the export (separate-GPU placement).
    """

    def __init__(self, model_path: str, arch: ModelArch, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None, dtype: str = "bfloat16",
                 colocate: bool = True, owns_engine: bool = True, seed: int = 0, pad_id: int = 0):
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.arch = arch
        self.colocate = colocate
        self.pad_id = pad_id
        self.llm = None
        self._torch_dtype = getattr(torch, dtype)
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
            if colocate:
                self.llm.sleep(level=2)  # training runs first; weights come from the first refit
        self._asleep = colocate and owns_engine

    # -------------------------------------------------------------------------------------------- refit
    def refit(self, model_chunks) -> int:
        """Copy the current megatron policy into vLLM, in memory (collective over the training ranks)."""
        sink = None
        if self.llm is not None:
            if self._asleep:
                self.llm.wake_up(tags=["weights"])

            def sink(weights):
                def load(worker):
                    worker.model_runner.model.load_weights(weights=weights)

                return self.llm.collective_rpc(load)

        return stream_policy_weights(model_chunks, self.arch, sink, dtype=self._torch_dtype)

    def sleep(self) -> None:
        """Release vLLM's GPU memory (weights and KV cache) while the policy trains (colocated)."""
        if self.llm is not None and self.colocate and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True

    # ----------------------------------------------------------------------------------------- generate
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """One response per prompt (token ids), sampled with ``sampling``; CPU tensors."""
        if self.llm is None:
            raise RuntimeError("this rank owns no vLLM engine (owns_engine=False)")
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        from vllm.inputs import TokensPrompt

        params = [self._vllm.SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                            max_tokens=sampling.max_new_tokens, seed=sampling.seed + i,
                                            stop_token_ids=[sampling.eos_id], ignore_eos=False)
                  for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        responses = [list(o.outputs[0].token_ids) for o in outs]
        reasons = ["length" if o.outputs[0].finish_reason == "length" else "stop" for o in outs]
        result = build_generation_output(prompts, responses, reasons, sampling.eos_id, sampling.max_new_tokens,
                                         self.pad_id)
        if self.colocate:
            self.sleep()
        return result

    @classmethod
    def from_recipe(cls, cfg, model_path: str, arch: ModelArch, **kwargs) -> "VLLMRolloutEngine":
        """Build from a recipe: ``rollout.vllm.*`` keys (when present) override the defaults."""
        extra = dict(cfg.get("rollout", {}).get("vllm", {}) or {})
        extra.setdefault("tensor_parallel_size", cfg.get("parallel", {}).get("tensor_model_parallel_size", 1))
        extra.setdefault("seed", cfg.get("run", {}).get("seed", 0))
        extra.update(kwargs)
        return cls(model_path, arch, **extra)


def sampling_from_recipe(cfg, eos_id: int, seed: int = 0) -> SamplingParams:
    """SamplingParams from the recipe's ``rollout`` section (temperature, top_p, max_new_tokens)."""
    r = cfg["rollout"]
    return SamplingParams(temperature=float(r["temperature"]), top_p=float(r["top_p"]),
                          max_new_tokens=int(r["max_new_tokens"]), eos_id=eos_id, seed=seed)
