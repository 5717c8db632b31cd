"""Policy actor on bare megatron-core: GPTModel with tensor, pipeline and data parallelism.

The same code runs on GPU over NCCL and on CPU over gloo (after :func:`laconic_nemo.runtime.megatron_env.
apply_cpu_patches`). Every method is SPMD: call it on every rank. The actor is put together from its parts, one
module each:

* model building (:mod:`laconic_nemo.actors.megatron_build`): the recipe's GPTModel (synthetic, or a Hugging Face
  checkpoint through the bridge) in megatron's DDP with gradients SUMMED over micro-batches and DP ranks, Adam;
* log-probs and the reference policy (:mod:`laconic_nemo.actors.megatron_logprobs`): vocab-parallel log-probs over
  packed or padded micro-batches through megatron's schedule;
* the training step (:mod:`laconic_nemo.actors.megatron_step`): one optimiser step per minibatch, the grad-norm
  clip, the learning-rate schedule, activation recompute by memory;
* checkpoint shards (:mod:`laconic_nemo.actors.megatron_shards`): this rank's state and the unsharded weights;
* generation: the decode engine on the actor's GPTModel (:mod:`laconic_nemo.rollout.engine`), or an attached
  engine (vLLM, :mod:`laconic_nemo.rollout.vllm`) that refits the weights itself.
"""

from __future__ import annotations

from typing import Any

import torch

from laconic_nemo.actors import memory
from laconic_nemo.actors.megatron_build import (
    ModelProvider,
    build_optimizer,
    model_parts,
    resolve_choice,
    wrap_model,
)
from laconic_nemo.actors.megatron_logprobs import LogprobsMixin
from laconic_nemo.actors.megatron_shards import ShardsMixin
from laconic_nemo.actors.megatron_step import TrainStepMixin
from laconic_nemo.config import Config
from laconic_nemo.grpo.interfaces import GenerationOutput, SamplingParams
from laconic_nemo.rollout.engine import DecodeEngine, engine_settings_from_config, resolve_sampler
from laconic_nemo.runtime.megatron_env import ParallelInfo, parallel_info


class MegatronCoreActor(LogprobsMixin, TrainStepMixin, ShardsMixin):
    """A megatron-core GPT policy implementing :class:`laconic_nemo.grpo.interfaces.PolicyActor`.

    Use :meth:`from_config`. Attributes: ``model`` (list of model chunks, megatron DDP-wrapped),
    ``optimizer`` (megatron optimizer), ``info`` (:class:`ParallelInfo`), ``vocab_size`` (real),
    ``padded_vocab_size`` (multiple of TP), ``pad_id`` (fills rows after their end in generated tokens;
    None = the EOS id), ``micro_batch_tokens`` (token budget of a packed micro-batch; 0 = rows of
    ``micro_batch_size``, padded). The keyword arguments are the recipe keys of the same names (``optim.*``,
    ``grpo.*``, ``rollout.sampler`` / ``sync_every`` / ``compact`` / ``engine_memory``), checked where the recipe was
    loaded.
    """

    def __init__(
        self,
        info: ParallelInfo,
        transformer_config: Any,
        model_provider: ModelProvider,
        vocab_size: int,
        padded_vocab_size: int,
        lr: float,
        weight_decay: float = 0.0,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_eps: float = 1e-8,
        warmup_steps: int = 0,
        grad_clip: float = 1.0,
        kl_beta: float = 0.0,
        micro_batch_size: int = 4,
        pad_id: int | None = None,
        sampler: str = "auto",
        sync_every: int = 8,
        compact_rows: bool = True,
        logprob_chunk_size: int = 1024,
        reference_on: str = "auto",
        sort_by_length: bool = True,
        engine_settings: Any = None,
        micro_batch_tokens: int = 16384,
        recompute_layers: int | None = None,
        engine_memory: str = "resident",
    ):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.info = info
        self.config = transformer_config
        self.vocab_size, self.padded_vocab_size = int(vocab_size), int(padded_vocab_size)
        self.lr, self.warmup_steps, self.grad_clip = float(lr), int(warmup_steps), float(grad_clip)
        self.kl_beta, self.micro_batch_size = float(kl_beta), int(micro_batch_size)
        self.pad_id = None if pad_id is None else int(pad_id)
        self.device = info.device
        on_gpu = self.device.type == "cuda"
        self.sampler = resolve_sampler(sampler, on_gpu)
        self.sync_every, self.compact_rows = int(sync_every), bool(compact_rows)
        self.logprob_chunk_size, self.sort_by_length = int(logprob_chunk_size), bool(sort_by_length)
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.recompute_setting = None if recompute_layers is None else int(recompute_layers)
        self.recompute_layers = 0  # layers per stage recomputed by the last train_step
        self.memory_plan: memory.MemoryPlan | None = None  # the plan behind the last choice by memory (GPU)
        self._last_shape: tuple[int, int, int] | None = None  # (tokens, longest sequence, micro-batches), last step
        self.reference_on = resolve_choice(reference_on, "device")
        if self.reference_on == "pinned" and not on_gpu:
            raise ValueError("grpo.reference_on=pinned needs a GPU (pinned host memory); use device, cpu or auto")
        self.step_count = 0

        self.model = wrap_model(model_provider, transformer_config, self.device)
        self.optimizer = build_optimizer(self.model, transformer_config, self.lr, float(weight_decay),
                                         float(adam_beta1), float(adam_beta2), float(adam_eps))
        self._forward_backward = get_forward_backward_func()
        self._ref_state: dict[str, torch.Tensor] | None = None
        self._scratch: dict[str, torch.Tensor] | None = None  # pinned host buffer for reference_on=pinned
        self.rollout_engine = None
        # the decode engine's settings (rollout.*; laconic_nemo.rollout.engine.EngineSettings), None: its defaults
        self.engine_settings = engine_settings
        self._decode_engine = None
        if engine_memory not in ("resident", "release"):
            raise ValueError(f"rollout.engine_memory = {engine_memory!r} is invalid: allowed resident or release")
        self.engine_memory = engine_memory  # release: the engine's cache and graphs freed after every rollout
        if self.kl_beta > 0:
            self.reset_reference()

    @classmethod
    def from_config(cls, cfg: Config, model_provider: ModelProvider | None = None) -> "MegatronCoreActor":
        """Build from a recipe (sections model, parallel, optim, grpo, rollout).

        torch.distributed and megatron's parallel state must be initialised with the recipe's TP x PP (the entry
        point calls :func:`laconic_nemo.runtime.megatron_env.init_distributed`); the actor does not initialise them.
        model_provider: optional ``(pre_process, post_process) -> GPTModel`` replacing the synthetic GPT of
        ``cfg.model``. ``cfg.model.vocab_size`` is the real vocabulary of the synthetic GPT (padding is internal).
        """
        optim, grpo, rollout = cfg.optim, cfg.grpo, cfg.rollout
        info = parallel_info(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size)
        parts = model_parts(cfg.model, info, model_provider)
        actor = cls(
            info, parts.transformer_config, parts.model_provider, parts.vocab_size, parts.padded_vocab_size,
            lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps, warmup_steps=optim.warmup_steps, grad_clip=optim.grad_clip, kl_beta=grpo.kl_beta,
            micro_batch_size=grpo.micro_batch_size,
            pad_id=None,  # not a recipe key: responses are padded with the EOS id
            sampler=rollout.sampler, sync_every=rollout.sync_every, compact_rows=rollout.compact,
            logprob_chunk_size=grpo.logprob_chunk_size, reference_on=grpo.reference_on,
            sort_by_length=grpo.sort_by_length,
            engine_settings=engine_settings_from_config(cfg, info.dp_size, info.device.type == "cuda"),
            micro_batch_tokens=grpo.micro_batch_tokens, recompute_layers=grpo.recompute_layers,
            engine_memory=rollout.engine_memory,
        )
        if parts.hf_path is not None:
            from laconic_nemo.bridge import load_hf_checkpoint

            load_hf_checkpoint(actor.model, parts.hf_path, parts.hf_arch)
            # mixed-precision optimizers keep fp32 master copies: refresh them from the loaded weights
            if hasattr(actor.optimizer, "reload_model_params"):
                actor.optimizer.reload_model_params()
            actor.snapshot_reference()
        return actor

    # ------------------------------------------------------------------ properties
    @property
    def dp_rank(self) -> int:
        return self.info.dp_rank

    @property
    def dp_size(self) -> int:
        return self.info.dp_size

    @property
    def dp_group(self):
        return self.info.dp_group

    @property
    def tp_rank(self) -> int:
        return self.info.tp_rank

    @property
    def pp_rank(self) -> int:
        return self.info.pp_rank

    @property
    def is_last_stage(self) -> bool:
        return self.info.is_last_stage

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def model_parallel_group(self):
        """The TP x PP group of this rank (ranks holding the same data and sampled tokens)."""
        from megatron.core import parallel_state

        return parallel_state.get_model_parallel_group()

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel of this rank (unwrapped from DDP)."""
        return self.model[0].module

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample one response per prompt with the decode engine (:mod:`laconic_nemo.rollout.engine`: static KV
        cache, CUDA-graphed steps on GPU, ``rollout.sampler`` exact or device), or the attached rollout engine
        (vLLM, given this policy's weights when they changed). Returns CPU tensors, identical on every TP/PP rank."""
        if self.rollout_engine is not None:
            return self.rollout_engine.generate_from(self.model, self.step_count, prompts, sampling)
        with self._eval_mode():
            try:
                return self.decode_engine().generate(prompts, sampling, stream=self.dp_rank, pad_id=self.pad_id)
            finally:
                if self.engine_memory == "release":  # the training step gets the cache's memory
                    self._decode_engine.free()

    def decode_engine(self) -> DecodeEngine:
        """The decode engine on this rank's GPTModel (built on first use; ``sampler``, ``sync_every`` and
        ``compact_rows`` are read from the actor at every call)."""
        if self._decode_engine is None:
            self._decode_engine = DecodeEngine(self.model, self.vocab_size, self.engine_settings)
        s = self._decode_engine.settings
        s.sampler, s.sync_every, s.compact = self.sampler, self.sync_every, self.compact_rows
        return self._decode_engine

    def attach_rollout_engine(self, engine) -> None:
        """Generate with ``engine`` (e.g. :class:`laconic_nemo.rollout.vllm.VLLMRolloutEngine`) instead of
        the decode engine; it refits the policy weights into itself whenever they changed."""
        self.rollout_engine = engine
