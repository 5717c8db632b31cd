"""GRPO policy actor on NeMo-Aligner (the cluster path for ``.nemo`` checkpoints).

Targets nemo-aligner 0.7.0 with nemo-toolkit 2.2.1 and megatron-core 0.11 (the NGC container
``nvcr.io/nvidia/nemo:25.02.01``; ``nemo:25.02`` ships NeMo 2.2.0, identical in every file used here). It implements :class:`laconic_nemo.grpo.interfaces.PolicyActor` so
that the same :class:`laconic_nemo.grpo.trainer.GRPOTrainer` drives it as the megatron-core actor;
NeMo-Aligner's own ``ReinforceTrainer`` is not used.

Seams of NeMo-Aligner reused (names and signatures as in 0.7.0):

* the model: a subclass of ``MegatronGPTReinforceActorModel`` (``NLPAdapterModelMixin``,
  ``MegatronGPTModel``, ``AlignableGenerativeInterface``) built by
  ``nemo_aligner.utils.utils.load_from_nemo`` from a ``.nemo`` file or a NeMo 2.0 checkpoint folder;
  only ``get_actor_forward_output_and_loss_func`` is replaced, so the policy loss is the shared
  :func:`laconic_nemo.grpo.loss.make_grpo_loss_fn` (clipped ratio, k3 KL, GLOBAL token/sequence
  normalisation) evaluated on tensor-parallel log-probs from
  ``nemo_aligner.utils.distributed.from_parallel_logits_to_logprobs`` (vocab-parallel logits are
  never gathered);
* generation, ``rollout.engine: megatron`` (the default): the project's decode engine
  (:mod:`laconic_nemo.rollout.engine`) on the megatron-core ``GPTModel`` inside the ``MegatronGPTModel``,
  between NeMo-Aligner's ``prepare_for_inference`` and ``finish_inference`` (eval mode, sequence parallelism
  and activation recompute off, Adam states offloaded to CPU); the same sampler as the megatron-core actor,
  over the tokenizer's vocabulary as NeMo's sampler (``text_generation_utils.py:995-996``);
* generation, ``rollout.engine: nemo``: ``prepare_for_inference`` / ``infer`` / ``finish_inference`` (NeMo's
  ``MegatronGPTModel.generate`` with ``TrackLengthGPTModelTextGenerationStrategy``, or TRT-LLM when
  ``trainer.reinforce.trt_llm.enable``);
* log-probs: ``get_inference_log_probs`` (pipeline schedule, broadcast from the last PP stage) and,
  for the reference policy, ``get_init_policy_logprobs`` (CPU weight swap of
  ``init_policy_state_dict`` from ``retrieve_model_state_dict_in_cpu``, or LoRA adapters off);
* training: ``prepare_for_training`` / ``prepare_for_training_step`` / ``get_loss_and_metrics`` /
  ``finish_training_step`` / ``finish_training`` and ``nemo_aligner.utils.train_utils.clip_gradients``,
  exactly the sequence of ``ReinforceTrainer.run_training``;
* checkpoints: PyTorch Lightning's ``trainer.save_checkpoint`` (NeMo's distributed checkpoint of
  model + optimiser + scheduler, collective over all ranks) into a folder that also receives an
  atomically written sidecar ``laconic_state.json`` (step, lambda-controller state); the
  ``on_save_checkpoint`` / ``on_load_checkpoint`` hooks carry the same state inside the Lightning
  checkpoint. Resume restores the NeMo checkpoint in ``init_using_ptl`` (before the first step) and
  the trainer restores lambda from its own ``trainer_state.json``.

Differences from NeMo-Aligner's REINFORCE, on purpose: every DP rank generates and trains on its own
share of prompts (the trainer hands each rank whole groups of G responses), where
``ReinforceRolloutBatch.chunk`` gives every DP rank the full global batch; advantages come from the
trainer (Lagrangian reward, group normalisation), not from the RLOO baseline.

Gradient scaling: Megatron's pipeline schedule divides each micro-batch loss by the number of
micro-batches and the DDP / distributed optimiser AVERAGES gradients over DP, while the shared loss
is already normalised by the global minibatch and expects gradients SUMMED; the loss is therefore
multiplied by ``num_microbatches * dp_size`` (:func:`loss_scale`).

Everything that needs NeMo is imported lazily (:func:`actor_model_class`), so the pure helpers here
import and are tested on CPU without NeMo.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import torch

from laconic_nemo.grpo.interfaces import GenerationOutput, LossFn, SamplingParams, TrainBatch

TARGET_VERSIONS = {"nemo_aligner": "0.7.0", "nemo_toolkit": "2.2.1", "megatron_core": "0.11"}
_DISTRIBUTIONS = {"nemo_aligner": "nemo-aligner", "nemo_toolkit": "nemo-toolkit", "megatron_core": "megatron-core"}
SIDECAR = "laconic_state.json"
# The NeMo checkpoint inside a step folder: save_checkpoint("<folder>/model.ckpt") writes the distributed
# checkpoint to ckpt_to_dir(...) = "<folder>/model" (NLPDDPStrategy.save_checkpoint), which is also the
# path its load_checkpoint needs.
NEMO_CKPT = "model"
CHECKPOINT_KEY = "laconic_state"
# Additive metric shares returned by laconic_nemo.grpo.loss.make_grpo_loss_fn.
LOSS_METRICS = ("loss", "pg_loss", "kl", "clip_fraction", "ratio_mean")


# ---------------------------------------------------------------------------------------------- pure helpers
def installed_versions() -> dict[str, str | None]:
    """The versions this process runs of the packages in :data:`TARGET_VERSIONS` (None: not installed), as recorded
    in each checkpoint (the container's NeMo may differ from the target: ``nemo:25.02`` ships 2.2.0)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for key, dist in _DISTRIBUTIONS.items():
        try:
            out[key] = version(dist)
        except PackageNotFoundError:
            out[key] = None
    return out


def loss_scale(num_microbatches: int, dp_size: int) -> float:
    """Factor that turns Megatron's mean over micro-batches and DP ranks into the SUM the shared loss expects."""
    if num_microbatches < 1 or dp_size < 1:
        raise ValueError(f"num_microbatches ({num_microbatches}) and dp_size ({dp_size}) must be >= 1")
    return float(num_microbatches * dp_size)


def pad_prompts(prompts: list[list[int]], pad_id: int, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to the width NeMo's sampler writes into: (tokens LongTensor
    [n, max_len + max_new_tokens], lengths LongTensor [n]) as ``infer`` takes them in
    ``{"text": tokens, "length": lengths}``.

    NeMo's ``sample_sequence_batch`` generates INTO the prompt tensor, up to column
    ``max(lengths) + max_new_tokens - 1`` (``tokens[:, context_length] = new_tokens``), so the tensor must
    already hold that many columns; NeMo-Aligner's own collate pads the same way
    (``batch_pad_to_fixed_len(texts, batch_max_length + response_token_length, eos_id)``)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    tokens = torch.full((len(prompts), int(lengths.max()) + int(max_new_tokens)), int(pad_id), dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return tokens, lengths


def nemo_rollout_to_generation_output(response_tokens: torch.Tensor, response_lengths: torch.Tensor,
                                      prompt_lengths: torch.Tensor, is_end: torch.Tensor,
                                      max_new_tokens: int, pad_id: int | None = None) -> GenerationOutput:
    """Convert the rollout of ``MegatronGPTReinforceActorModel.infer`` to the interface's layout.

    response_tokens: [n, T] prompt + response (NeMo pads with EOS).
    response_lengths: [n] NeMo's TOTAL length: prompt + generated tokens, the ending token included.
    prompt_lengths: [n].
    is_end: [n] bool, True when the sample ended on EOS / an end string (and produced valid tokens).
    Returns tokens, prompt_lengths, response_lengths = generated tokens (EOS counted), lengths L
    (EOS excluded; a sample that did not end counts every generated token) and truncated (no end
    within ``max_new_tokens``).

    NeMo's batch sampler runs every row until ``max(prompt_lengths) + max_new_tokens``, so a row with a
    shorter prompt can generate more than ``max_new_tokens`` tokens (NeMo-Aligner notes this in
    ``megatron_gpt_reinforce_actor.py``). Such a row is cut at ``max_new_tokens``: it counts as truncated
    (L = max_new_tokens, even if it ended later); the response mask and the decoded text stop at the cut,
    and the tokens after it are overwritten with ``pad_id`` when one is given.
    """
    response_tokens = torch.as_tensor(response_tokens).long().cpu().clone()
    total = torch.as_tensor(response_lengths).long().cpu()
    prompt = torch.as_tensor(prompt_lengths).long().cpu()
    ended = torch.as_tensor(is_end).bool().cpu()
    if not (total.shape == prompt.shape == ended.shape == (response_tokens.shape[0],)):
        raise ValueError("response_lengths, prompt_lengths and is_end must be [n] with n = response_tokens rows")
    generated = total - prompt
    if bool((generated < 0).any()) or bool((total > response_tokens.shape[1]).any()):
        raise ValueError("response_lengths must lie between prompt_lengths and the token width")
    cap = int(max_new_tokens)
    over = generated > cap
    ended = ended & ~over
    generated = torch.where(over, torch.full_like(generated, cap), generated)
    if pad_id is not None:
        for i in torch.nonzero(over).flatten().tolist():
            response_tokens[i, int(prompt[i]) + cap :] = int(pad_id)
    lengths = generated - ended.long()
    truncated = (~ended) & (generated >= cap)
    return GenerationOutput(tokens=response_tokens, prompt_lengths=prompt, response_lengths=generated,
                            lengths=lengths.clamp(min=0), truncated=truncated)


def train_batch_to_nemo(batch: TrainBatch) -> dict[str, torch.Tensor]:
    """A TrainBatch as the tensor dict NeMo's ``get_loss_and_metrics`` splits into micro-batches
    (``response_tokens`` is the key NeMo builds attention masks and position ids from)."""
    if batch.advantages is None or batch.old_logprobs is None:
        raise ValueError("the batch needs advantages and old_logprobs for the policy update")
    out = {
        "response_tokens": batch.tokens.long(),
        "prompt_lengths": batch.prompt_lengths.long(),
        "response_lengths": batch.response_lengths.long(),
        "response_mask": batch.response_mask.float(),
        "advantages": batch.advantages.float(),
        "old_logprobs": batch.old_logprobs.float(),
    }
    if batch.ref_logprobs is not None:
        out["ref_logprobs"] = batch.ref_logprobs.float()
    return out


def nemo_to_train_batch(d: dict[str, torch.Tensor | None]) -> TrainBatch:
    """Inverse of :func:`train_batch_to_nemo` for one micro-batch (keys absent on a PP stage may be None)."""
    return TrainBatch(tokens=d["response_tokens"], prompt_lengths=d.get("prompt_lengths"),
                      response_lengths=d.get("response_lengths"), response_mask=d.get("response_mask"),
                      advantages=d.get("advantages"), old_logprobs=d.get("old_logprobs"),
                      ref_logprobs=d.get("ref_logprobs"))


def largest_divisor_at_most(n: int, k: int) -> int:
    """The largest divisor of n that is <= k (micro-batch size for ``get_inference_log_probs``, which
    needs the batch divisible by it)."""
    if n < 1 or k < 1:
        raise ValueError(f"n ({n}) and k ({k}) must be >= 1")
    return max(d for d in range(1, min(n, k) + 1) if n % d == 0)


def write_sidecar(folder: str | Path, state: dict[str, Any]) -> Path:
    """Atomically write ``state`` (JSON) to ``folder/laconic_state.json``: a crash leaves the old file or
    the new one, never half of one."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / SIDECAR
    tmp = folder / f".{SIDECAR}.tmp{os.getpid()}"
    with tmp.open("w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def read_sidecar(folder: str | Path) -> dict[str, Any] | None:
    p = Path(folder) / SIDECAR
    return json.loads(p.read_text()) if p.is_file() else None


# ---------------------------------------------------------------------------------------------- NeMo model
def _stub_trt_llm_if_missing() -> None:
    """``nemo_aligner.utils.trt_llm`` imports tensorrt_llm outside a try block; without TRT-LLM (CPU, or a
    container without it) the actor module would not import. Replace it with a stub that fails only
    when TRT-LLM generation is actually requested."""
    try:
        import tensorrt_llm  # noqa: F401
        return
    except Exception:
        pass
    name = "nemo_aligner.utils.trt_llm"
    if name in sys.modules:
        return
    stub = types.ModuleType(name)

    class GPTGenerateTRTLLM:  # noqa: N801 - the upstream name
        def __init__(self, *args, **kwargs):
            raise ImportError("trainer.reinforce.trt_llm.enable needs tensorrt_llm (not installed)")

    stub.GPTGenerateTRTLLM = GPTGenerateTRTLLM
    sys.modules[name] = stub


_MODEL_CLASS = None


def gpt_model(model):
    """The megatron-core ``GPTModel`` inside the model chunk megatron's schedule hands a forward step (NeMo wraps it in
    megatron's ``Float16Module`` with ``megatron_amp_O2``)."""
    from laconic_nemo.rollout.engine import unwrap_gpt_model

    return unwrap_gpt_model(model)


def actor_model_class():
    """``LaconicGRPOActorModel``: NeMo-Aligner's REINFORCE actor with the shared GRPO loss and the
    laconic checkpoint hooks. Built on first use (imports NeMo)."""
    global _MODEL_CLASS
    if _MODEL_CLASS is not None:
        return _MODEL_CLASS
    _stub_trt_llm_if_missing()
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor import MegatronGPTReinforceActorModel
    from nemo_aligner.utils import parallel_state

    class LaconicGRPOActorModel(MegatronGPTReinforceActorModel):
        """``MegatronGPTReinforceActorModel`` whose training loss is a :data:`LossFn` set per optimiser step."""

        laconic_loss_fn: LossFn | None = None
        laconic_state: dict[str, Any] | None = None           # written into checkpoints
        restored_laconic_state: dict[str, Any] | None = None  # read back by on_load_checkpoint
        laconic_logprob_temperature: float = 1.0              # get_inference_log_probs at this temperature
        laconic_logprob_chunk: int = 1024                     # tokens of one log-prob chunk (grpo.logprob_chunk_size)

        def laconic_token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                                   temperature: float = 1.0) -> torch.Tensor:
            """[b, s-1] float32 log p(tokens[:, 1:]) at ``temperature`` from this rank's vocab shard of the GPTModel's
            logits [b, s, V/TP]: the megatron-core actor's chunked log-probs
            (:func:`laconic_nemo.actors.megatron_logprobs.chunked_token_logprobs`, chunks of
            ``laconic_logprob_chunk`` tokens), never a float32 copy of the whole logits nor NeMo-Aligner's
            ``[b, s, V]`` float32 log-softmax, its clone and the one-hot tensors of its backward (``nemo_aligner/utils/distributed.py:265-283, 305-309, 329-338``). Every column
            of the model's (padded) vocabulary is scored, as ``from_parallel_logits_to_logprobs`` did."""
            from laconic_nemo.actors.megatron_logprobs import chunked_token_logprobs
            from laconic_nemo.actors.memory import logprob_chunk_positions

            labels = torch.roll(tokens, shifts=-1, dims=1)
            vocab = logits.shape[-1] * parallel_state.get_tensor_model_parallel_world_size()
            chunk = logprob_chunk_positions(self.laconic_logprob_chunk, logits.shape[0])
            return chunked_token_logprobs(logits, labels, chunk, vocab, parallel_state.get_tensor_model_parallel_rank(),
                                          temperature)[:, :-1]

        def get_logprob_output_only_func(self, inference_only=True):
            """Replaces NeMo-Aligner's log-prob forward (``megatron_gpt_reinforce_actor.py:210-229``: the float32
            logits of megatron's ``Float16Module``, ``megatron/core/transformer/module.py:175-181``, through
            ``from_parallel_logits_to_logprobs``): the GPTModel inside the wrapper, called as the training forward
            calls it (the ``[b, 1, s, s]`` causal mask of ``get_inference_log_probs``, as NeMo-Aligner's training
            step passes it), its 16-bit logits through :meth:`laconic_token_logprobs` at
            ``laconic_logprob_temperature`` (the rollout temperature: old and reference log-probs of the
            distribution that was sampled)."""
            temperature = float(self.laconic_logprob_temperature)

            def log_prob_output_only_func(dataloader_iter, model):
                batch = next(dataloader_iter)
                if isinstance(batch, tuple):
                    batch = batch[0]
                tokens, attention_mask, position_ids = (x.cuda() for x in batch)
                output = gpt_model(model)(tokens, position_ids, attention_mask)

                def id_func(output_tensor, non_loss_data=True):
                    return self.laconic_token_logprobs(output_tensor, tokens, temperature)

                return output, id_func

            return log_prob_output_only_func

        def reset_laconic_metrics(self):
            self._laconic_metric_sums = torch.zeros(len(LOSS_METRICS), dtype=torch.float64)

        def get_actor_forward_output_and_loss_func(self):
            def fwd_output_and_loss_func(data_iterator, model):
                batch = next(data_iterator)
                if parallel_state.get_pipeline_model_parallel_world_size() == 1:
                    required = set(batch.keys())
                else:
                    required = {"attention_mask"}
                    if parallel_state.is_pipeline_first_stage():
                        required.update(("response_tokens", "position_ids"))
                    if parallel_state.is_pipeline_last_stage():
                        required.update(k for k in batch if k not in ("attention_mask", "position_ids"))
                batch = {k: (v.cuda(non_blocking=True) if k in required else None) for k, v in batch.items()}
                # the GPTModel inside megatron's Float16Module: its 16-bit logits, without the wrapper's float32 copy
                parallel_logits = gpt_model(model)(batch["response_tokens"], batch["position_ids"],
                                                   batch["attention_mask"], labels=None)

                def loss_func(parallel_logits):
                    if self.laconic_loss_fn is None:
                        raise RuntimeError("set laconic_loss_fn before get_loss_and_metrics")
                    # [b, s, V/TP] -> [b, s-1] log-probs of the next tokens at the loss's temperature
                    # (the rollout temperature, grpo/loss.py), chunked, reduced over TP
                    temperature = float(getattr(self.laconic_loss_fn, "temperature", 1.0))
                    logprobs = self.laconic_token_logprobs(parallel_logits, batch["response_tokens"], temperature)
                    loss, metrics = self.laconic_loss_fn(logprobs, nemo_to_train_batch(batch))
                    self._laconic_metric_sums += torch.tensor([float(metrics.get(k, 0.0)) for k in LOSS_METRICS],
                                                              dtype=torch.float64)
                    scale = loss_scale(get_num_microbatches(), parallel_state.get_data_parallel_world_size())
                    scaled = loss * scale
                    # mean over micro-batches and DP (NeMo's reduction) of `scaled` = the global loss
                    reduced = scaled.detach().clone()
                    torch.distributed.all_reduce(reduced, group=parallel_state.get_data_parallel_group())
                    return scaled, {"loss": reduced / parallel_state.get_data_parallel_world_size()}

                return parallel_logits, loss_func

            return fwd_output_and_loss_func

        def on_save_checkpoint(self, checkpoint: dict) -> None:
            super().on_save_checkpoint(checkpoint)
            if self.laconic_state is not None:
                checkpoint[CHECKPOINT_KEY] = self.laconic_state

        def on_load_checkpoint(self, checkpoint: dict) -> None:
            super().on_load_checkpoint(checkpoint)
            self.restored_laconic_state = checkpoint.get(CHECKPOINT_KEY)

    _MODEL_CLASS = LaconicGRPOActorModel
    return _MODEL_CLASS


# ---------------------------------------------------------------------------------------------- the actor
class NemoAlignerActor:
    """:class:`~laconic_nemo.grpo.interfaces.PolicyActor` over a ``LaconicGRPOActorModel`` set up by
    ``laconic_nemo.nemo_entry`` (``load_from_nemo`` -> ``init_distributed`` -> ``init_using_ptl``).

    model: the LaconicGRPOActorModel (its PTL trainer attached).
    optimizer, scheduler: from ``extract_optimizer_scheduler_from_ptl_model``.
    grad_clip: global gradient-norm clip (0 disables).
    pad_id: padding token for prompts.
    restored_from: the NeMo checkpoint folder restored at start-up (None for a fresh run).
    rollout_engine: ``megatron`` (the decode engine) or ``nemo`` (NeMo-Aligner's generation).
    engine_settings: the decode engine's :class:`~laconic_nemo.rollout.engine.EngineSettings` (None: defaults).
    vocab_size: the vocabulary the engine samples from (default: the tokenizer's, as NeMo's sampler).
    logprob_chunk_size: tokens of one log-prob chunk (``grpo.logprob_chunk_size``).
    recompute_layers: layers per pipeline stage recomputed in backward (``grpo.recompute_layers``); None: chosen by
        memory at every step on GPU (:meth:`plan_memory`), none on CPU.
    engine_memory: ``rollout.engine_memory``: resident (the decode engine kept between rollouts, budgeted in
        :meth:`plan_memory`) or release (freed after every rollout).
    """

    def __init__(self, model, optimizer, scheduler, grad_clip: float, pad_id: int,
                 restored_from: str | None = None, rollout_engine: str = "megatron", engine_settings=None,
                 vocab_size: int | None = None, logprob_chunk_size: int = 1024, recompute_layers: int | None = None,
                 engine_memory: str = "resident"):
        from nemo_aligner.utils import parallel_state

        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.grad_clip, self.pad_id = float(grad_clip), int(pad_id)
        self.restored_from = restored_from
        self._ps = parallel_state
        from megatron.core import parallel_state as mps

        self.dp_rank = mps.get_data_parallel_rank()
        self.dp_size = mps.get_data_parallel_world_size()
        self.dp_group = mps.get_data_parallel_group()
        self.tp_rank = mps.get_tensor_model_parallel_rank()
        self.pp_rank = mps.get_pipeline_model_parallel_rank()
        self.model_parallel_group = mps.get_model_parallel_group()
        self._last_saved: str | None = None
        if rollout_engine not in ("megatron", "nemo"):
            raise ValueError(f"rollout.engine = {rollout_engine!r}: the NeMo-Aligner actor generates with megatron "
                             "(the decode engine) or nemo")
        self.rollout_engine = rollout_engine
        self.engine_settings = engine_settings
        self.vocab_size = vocab_size
        self._decode_engine = None
        from laconic_nemo.rollout.engine import check_engine_memory

        self.engine_memory = check_engine_memory(engine_memory)
        self.logprob_chunk_size = int(logprob_chunk_size)
        model.laconic_logprob_chunk = self.logprob_chunk_size
        self.recompute_setting = None if recompute_layers is None else int(recompute_layers)
        self.recompute_layers = 0  # layers per stage recomputed by the last train_step
        self.memory_plan = None    # laconic_nemo.actors.memory.MemoryPlan of the last train_step's micro-batches
        self._last_shape: tuple[int, int, int] | None = None  # (rows, width, micro-batches) of the last train_step
        self._optimizer_steps = 0  # train_step calls of this process (fault points count them)

    # ------------------------------------------------------------------ rollout
    def decode_engine(self):
        """The decode engine on the megatron-core GPTModel inside the NeMo model (built on first use)."""
        from laconic_nemo.rollout.engine import DecodeEngine

        if self._decode_engine is None:
            vocab = self.vocab_size if self.vocab_size is not None else int(self.model.tokenizer.vocab_size)
            self._decode_engine = DecodeEngine(self.model, vocab, self.engine_settings)
        return self._decode_engine

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        if self.rollout_engine == "megatron":
            return self._generate_with_decode_engine(prompts, sampling)
        return self._generate_with_nemo(prompts, sampling)

    def _generate_with_decode_engine(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        m = self.model
        m.prepare_for_inference()  # eval, sequence parallelism and recompute off, Adam states to CPU
        try:
            return self.decode_engine().generate(prompts, sampling, stream=self.dp_rank, pad_id=self.pad_id)
        finally:
            if self.engine_memory == "release":  # the training step gets the cache's memory (graphs captured again)
                self.decode_engine().free()
            m.finish_inference()

    def _generate_with_nemo(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        m = self.model
        m._sampling_params.update(temperature=float(sampling.temperature), top_p=float(sampling.top_p), top_k=0,
                                  use_greedy=False)
        m._length_params.update(max_length=int(sampling.max_new_tokens))
        # identical seed on every TP/PP rank of this DP group (depends on the DP rank only)
        torch.manual_seed(int(sampling.seed))
        if torch.cuda.is_available():
            torch.cuda.manual_seed(int(sampling.seed))
        chunk = int(m.cfg.reinforce.get("rollout_micro_batch_size", len(prompts)))
        outs = []
        m.prepare_for_inference()
        try:
            for start in range(0, len(prompts), chunk):
                tokens, lengths = pad_prompts(prompts[start : start + chunk], self.pad_id,
                                              int(sampling.max_new_tokens))
                r = m.infer({"text": tokens, "length": lengths})
                outs.append(nemo_rollout_to_generation_output(r["response_tokens"], r["response_lengths"],
                                                              r["prompt_lengths"], r["is_end"],
                                                              int(sampling.max_new_tokens), self.pad_id))
        finally:
            m.finish_inference()
        width = max(o.tokens.shape[1] for o in outs)
        tokens = torch.cat([torch.nn.functional.pad(o.tokens, (0, width - o.tokens.shape[1]), value=self.pad_id)
                            for o in outs])
        return GenerationOutput(tokens=tokens, **{k: torch.cat([getattr(o, k) for o in outs]) for k in
                                                  ("prompt_lengths", "response_lengths", "lengths", "truncated")})

    # ------------------------------------------------------------------ log-probs
    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, reference: bool = False, temperature: float = 1.0) -> torch.Tensor:
        """Log-probs [N, T-1] at ``temperature`` (log_softmax(logits / temperature))."""
        from nemo_aligner.utils.train_utils import set_eval, set_train

        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        m = self.model
        tokens = batch.tokens.long().cuda()
        saved = m.forward_micro_batch_size
        m.forward_micro_batch_size = largest_divisor_at_most(tokens.shape[0], int(saved))
        m.laconic_logprob_temperature = float(temperature)
        set_eval(m)
        try:
            if reference:
                out = m.get_init_policy_logprobs(tokens)
            else:
                out = m.get_inference_log_probs(tokens)
        finally:
            m.forward_micro_batch_size = saved
            m.laconic_logprob_temperature = 1.0
            set_train(m)
        return out.float().cpu()

    # ------------------------------------------------------------------ memory
    def plan_memory(self, rows: int, width: int, num_micro_batches: int, device_gib: float | None = None):
        """:func:`laconic_nemo.actors.memory.nemo_actor_plan` for this rank: the GPTModel's sizes, parameters,
        dtype and core attention, micro-batches of ``rows`` x ``width`` tokens, the decode engine's memory while it
        stays resident, the device's memory (or ``device_gib``)."""
        from laconic_nemo.actors import memory
        from laconic_nemo.runtime.megatron_compat import glu_keeps_offset_sum

        gpt = gpt_model(self.model)
        c = gpt.config
        if device_gib is None:
            device_gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / memory.GIB
        shape = memory.layer_shape_of(c, gpt.vocab_size)
        # megatron's unfused DotProductAttention (the local spec) keeps the [np, s, s] scores; TransformerEngine's
        # flash / fused kernels do not
        core = type(gpt.decoder.layers[0].self_attention.core_attention).__name__
        kernel = "local" if core == "DotProductAttention" else "flash"
        weight = next(gpt.parameters())
        return memory.nemo_actor_plan(
            shape, rows, width, device_gib, tp=c.tensor_model_parallel_size, pp=c.pipeline_model_parallel_size,
            dp=self.dp_size, dtype_bytes=weight.element_size(), kernel=kernel,
            params=sum(p.numel() for p in gpt.parameters()), num_micro_batches=num_micro_batches,
            logprob_chunk=self.logprob_chunk_size, fused_swiglu=bool(c.bias_activation_fusion),
            glu_offset_sum=glu_keeps_offset_sum(c), resident_bytes=memory.live_engine_bytes(self._decode_engine))

    def _choose_recompute(self, rows: int, width: int, num_micro_batches: int) -> int:
        """Layers per pipeline stage to recompute (``recompute_setting``; None: by memory on GPU, none on CPU), set
        on the GPTModel's TransformerConfig, which its TransformerBlock reads at every forward
        (``transformer_block.py:358-391``). NeMo's ``prepare_for_inference`` / ``finish_inference``
        (``megatron_gpt_model.py:2108-2153``) reset and restore it from ``cfg.activations_checkpoint_*`` around every
        rollout, so it is set again at every step."""
        from laconic_nemo.actors.megatron_step import set_recompute
        from laconic_nemo.actors.memory import choose_recompute

        gpt = gpt_model(self.model)
        per_stage = len(gpt.decoder.layers)
        n, plan = choose_recompute(self.recompute_setting, per_stage, torch.cuda.is_available(),
                                   lambda: self.plan_memory(rows, width, num_micro_batches))
        if plan is not None:
            self.memory_plan = plan
        self.recompute_layers = set_recompute(gpt.decoder.config, n, per_stage)
        return self.recompute_layers

    def memory_prediction(self, device_gib: float | None = None) -> str | None:
        """The memory model's prediction for the last training step's micro-batches (None before the first):
        the plan the recompute was chosen by, or (a fixed setting, CPU) the plan for the device's memory
        (:func:`laconic_nemo.actors.memory.memory_prediction`)."""
        from laconic_nemo.actors import memory

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.memory_plan, line = memory.memory_prediction(self.memory_plan, self._last_shape, self.plan_memory,
                                                          device, device_gib)
        return line

    # ------------------------------------------------------------------ policy update
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        from nemo_aligner.utils.train_utils import clip_gradients
        from nemo_aligner.utils.utils import configure_batch_sizes

        m = self.model
        n = len(batch)
        if n % micro_batch_size:
            raise ValueError(f"minibatch rows on this rank ({n}) must be divisible by micro_batch_size "
                             f"({micro_batch_size})")
        m.cfg.micro_batch_size = int(micro_batch_size)  # read by get_loss_and_metrics
        # NeMo-Aligner's micro-batches: micro_batch_size rows at the minibatch's full width
        # (megatron_gpt_reinforce_actor.py:165-184)
        self._last_shape = (int(micro_batch_size), int(batch.tokens.shape[1]), n // int(micro_batch_size))
        self.memory_plan = None
        self._choose_recompute(*self._last_shape)
        m.prepare_for_training()                         # onloads Adam states
        configure_batch_sizes(mbs=int(micro_batch_size), gbs=n * self.dp_size, dp=self.dp_size)
        self.optimizer.zero_grad()
        m.prepare_for_training_step()
        m.laconic_loss_fn = loss_fn
        m.reset_laconic_metrics()
        try:
            loss, _ = m.get_loss_and_metrics(batch=train_batch_to_nemo(batch), forward_only=False)
        finally:
            m.laconic_loss_fn = None
        from laconic_nemo.runtime.faults import fault_point

        fault_point("train_step", self._optimizer_steps + 1)
        self._optimizer_steps += 1
        m.finish_training_step()
        grad_norm = clip_gradients(m, self.grad_clip)
        grad_norm = float(grad_norm.item() if torch.is_tensor(grad_norm) else (grad_norm or 0.0))
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        m.finish_training()
        self.optimizer.zero_grad()
        metrics = self._global_loss_metrics()
        metrics.update(loss=float(loss), grad_norm=grad_norm, lr=lr)
        return metrics

    def _global_loss_metrics(self) -> dict[str, float]:
        """Sum the loss metric shares over micro-batches (done) and DP ranks, then take them from the last
        pipeline stage (the only one that evaluates the loss)."""
        sums = self.model._laconic_metric_sums.to(torch.cuda.current_device())
        torch.distributed.all_reduce(sums, group=self.dp_group)
        from nemo.collections.nlp.parts.utils_funcs import get_last_rank

        torch.distributed.broadcast(sums, get_last_rank())
        return {k: float(v) for k, v in zip(LOSS_METRICS, sums.cpu().tolist())}

    # ------------------------------------------------------------------ checkpoints
    def save_sharded_checkpoint(self, folder: str | Path, laconic_state: dict[str, Any]) -> str:
        """Collective (every rank): NeMo distributed checkpoint of model + optimiser + scheduler into
        ``folder/model`` plus the sidecar ``folder/laconic_state.json``; returns the folder.

        Written into ``<folder>.tmp`` (cleared first) and renamed when complete, replacing an older
        ``folder``: megatron-core refuses to save into a non-empty checkpoint directory
        (``dist_checkpointing.save``: "Checkpoint destination directory ... is not empty"), which an
        interrupted save of the same step would otherwise leave behind."""
        folder = Path(folder)
        tmp = folder.with_name(folder.name + ".tmp")
        rank = torch.distributed.get_rank()
        self.model.laconic_state = dict(laconic_state)
        self.model.prepare_for_training()  # Adam states back on the GPU before they are written
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        torch.distributed.barrier()
        self.model.trainer.save_checkpoint(str(tmp / f"{NEMO_CKPT}.ckpt"))
        torch.distributed.barrier()
        if rank == 0:
            write_sidecar(tmp, laconic_state)
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        torch.distributed.barrier()
        self.model.finish_training()
        self._last_saved = str(folder)
        return str(folder)

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """Only a reference: the weights live in the NeMo checkpoint written by ``save_sharded_checkpoint``
        (NeMo's distributed optimiser state is sharded over DP, so no single rank can hold it)."""
        if self._last_saved is None:
            raise RuntimeError("save_sharded_checkpoint must run (on every rank) before the trainer's checkpoint")
        return {"nemo_checkpoint": self._last_saved, "versions": installed_versions()}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """The NeMo checkpoint was restored by ``init_using_ptl`` before the trainer existed; check it is
        the one this trainer checkpoint refers to."""
        wanted = state.get("nemo_checkpoint")
        if wanted is None:
            raise ValueError("this checkpoint was not written by the NeMo-Aligner actor (no nemo_checkpoint)")
        if self.restored_from is None or Path(self.restored_from).resolve() != Path(wanted).resolve():
            raise RuntimeError(f"trainer checkpoint refers to {wanted} but the model was restored from "
                               f"{self.restored_from}; start through laconic_nemo.nemo_entry")


class NemoCheckpointHook:
    """The NeMo-Aligner actor's distributed checkpoint beside the trainer's step folders
    (:class:`laconic_nemo.grpo.checkpoint.CheckpointHook`): ``<root>/nemo/step_XXXXXX``, written (collective)
    before the step folder that refers to it, removed when that step folder is pruned."""

    def __init__(self, actor: NemoAlignerActor):
        self.actor = actor

    def save(self, root: Path, step: int, trainer_state: dict[str, Any]) -> None:
        self.actor.save_sharded_checkpoint(Path(root) / "nemo" / f"step_{step:06d}",
                                           {"step": step, "shaper": trainer_state["shaper"]})

    def prune(self, root: Path, kept: set[str]) -> None:
        for d in (Path(root) / "nemo").glob("step_*"):
            if d.name not in kept:
                shutil.rmtree(d, ignore_errors=True)
