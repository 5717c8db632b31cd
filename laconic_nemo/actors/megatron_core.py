"""Policy actor on bare megatron-core: GPTModel with tensor, pipeline and data parallelism.

The same code runs on GPU over NCCL and on CPU over gloo (after :func:`laconic_nemo.runtime.megatron_env.
apply_cpu_patches`). Every method is SPMD: call it on every rank. :class:`MegatronCoreActor` is composed of parts
that each own their state and are given the parts they use when built (one module each):

* ``weights`` (:class:`~laconic_nemo.actors.megatron_shards.ModelWeights`): the bare GPTModel of this rank, its
  layout, config and vocabulary sizes; this rank's state and the unsharded weights / gradients;
* ``batches`` (:class:`~laconic_nemo.actors.megatron_batches.MicroBatches`): padded or packed micro-batches;
* ``schedule`` (:class:`~laconic_nemo.actors.megatron_schedule.ScheduleRunner`): the model chunks (megatron's DDP
  with gradients SUMMED over micro-batches and DP ranks, :mod:`laconic_nemo.actors.megatron_build`) and megatron's
  forward(-backward) schedule;
* ``reference`` (:class:`~laconic_nemo.actors.megatron_reference.ReferencePolicy`, given ``weights``): pi_ref;
* ``log_probs`` (:class:`~laconic_nemo.actors.megatron_logprobs.Logprobs`, given ``batches``, ``schedule``,
  ``reference``): vocab-parallel log-probs;
* ``generation`` (:class:`~laconic_nemo.actors.megatron_generate.Generation`, given ``schedule``): the decode
  engine (:mod:`laconic_nemo.rollout.engine`) or an attached engine (vLLM);
* ``stepper`` (:class:`~laconic_nemo.actors.megatron_step.TrainStep`, given all of the above but generation, and
  the generation's resident engine for the memory model): the optimiser step, its schedule, clip and recompute.

The actor's settings live in the part that uses them; the actor reads and writes them there
(:class:`~laconic_nemo.rollout.parts.PartAttribute`).
"""

from __future__ import annotations

from typing import Any

import torch

from laconic_nemo.actors.megatron_batches import MicroBatches
from laconic_nemo.actors.megatron_build import ModelProvider, build_optimizer, model_parts, wrap_model
from laconic_nemo.actors.megatron_generate import Generation
from laconic_nemo.actors.megatron_logprobs import Logprobs
from laconic_nemo.actors.megatron_reference import ReferencePolicy, resolve_reference_on
from laconic_nemo.actors.megatron_schedule import ScheduleRunner
from laconic_nemo.actors.megatron_shards import ModelWeights
from laconic_nemo.actors.megatron_step import TrainStep
from laconic_nemo.config import Config
from laconic_nemo.grpo.interfaces import GenerationOutput, LossFn, SamplingParams, TrainBatch
from laconic_nemo.rollout.engine import DecodeEngine, engine_settings_from_config, resolve_sampler
from laconic_nemo.rollout.parts import PartAttribute
from laconic_nemo.runtime.megatron_env import ParallelInfo, parallel_info


class MegatronCoreActor:
    """A megatron-core GPT policy implementing :class:`laconic_nemo.grpo.interfaces.PolicyActor`, composed of the
    parts of the module docstring.

    Use :meth:`from_config`. Attributes: ``model`` (list of model chunks, megatron DDP-wrapped),
    ``optimizer`` (megatron optimizer), ``info`` (:class:`ParallelInfo`), ``vocab_size`` (real),
    ``padded_vocab_size`` (multiple of TP), ``pad_id`` (fills rows after their end in generated tokens;
    None = the EOS id), ``micro_batch_tokens`` (token budget of a packed micro-batch; 0 = rows of
    ``micro_batch_size``, padded). The keyword arguments are the recipe keys of the same names (``optim.*``,
    ``grpo.*``, ``rollout.sampler`` / ``sync_every`` / ``compact`` / ``engine_memory``), checked where the recipe was
    loaded.
    """

    # settings and state owned by the parts (readable and, unless read-only, settable on the actor)
    info = PartAttribute("weights", read_only=True)
    config = PartAttribute("weights", read_only=True)
    module = PartAttribute("weights", read_only=True)
    vocab_size = PartAttribute("weights", read_only=True)
    padded_vocab_size = PartAttribute("weights", read_only=True)
    model = PartAttribute("schedule", read_only=True)
    device = PartAttribute("schedule", read_only=True)
    micro_batch_size = PartAttribute("batches")
    micro_batch_tokens = PartAttribute("batches")
    sort_by_length = PartAttribute("batches")
    pad_id = PartAttribute("generation", read_only=True)
    reference_on = PartAttribute("reference")
    kl_beta = PartAttribute("reference", read_only=True)
    logprob_chunk_size = PartAttribute("log_probs")
    optimizer = PartAttribute("stepper", read_only=True)
    lr = PartAttribute("stepper")
    warmup_steps = PartAttribute("stepper")
    grad_clip = PartAttribute("stepper")
    step_count = PartAttribute("stepper")
    recompute_setting = PartAttribute("stepper")
    recompute_layers = PartAttribute("stepper", read_only=True)
    memory_plan = PartAttribute("stepper")
    sampler = PartAttribute("generation")
    sync_every = PartAttribute("generation")
    compact_rows = PartAttribute("generation")
    engine_settings = PartAttribute("generation")
    engine_memory = PartAttribute("generation")
    rollout_engine = PartAttribute("generation")

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
        device = info.device
        sampler = resolve_sampler(sampler, device.type == "cuda")
        reference_on = resolve_reference_on(reference_on, device)
        model = wrap_model(model_provider, transformer_config, device)
        optimizer = build_optimizer(model, transformer_config, float(lr), float(weight_decay), float(adam_beta1),
                                    float(adam_beta2), float(adam_eps))
        self.weights = ModelWeights(model[0].module, info, transformer_config, vocab_size, padded_vocab_size)
        self.batches = MicroBatches(micro_batch_size, micro_batch_tokens, sort_by_length, info.pp_size, pad_id, device)
        self.schedule = ScheduleRunner(model, info)
        self.reference = ReferencePolicy(self.weights, reference_on, kl_beta, device)
        self.log_probs = Logprobs(logprob_chunk_size, vocab_size, info, self.batches, self.schedule, self.reference)
        self.generation = Generation(self.schedule, vocab_size, info.dp_rank, pad_id, sampler, sync_every,
                                     compact_rows, engine_settings, engine_memory)
        self.stepper = TrainStep(optimizer, self.weights, self.batches, self.schedule, self.log_probs, self.reference,
                                 self.generation.resident_engine, lr, warmup_steps, grad_clip, recompute_layers)
        self.reference.snapshot()

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

    # ------------------------------------------------------------------ layout
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

    # ------------------------------------------------------------------ generation (generation)
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample one response per prompt with the decode engine (:mod:`laconic_nemo.rollout.engine`: static KV
        cache, CUDA-graphed steps on GPU, ``rollout.sampler`` exact or device), or the attached rollout engine
        (vLLM, given this policy's weights when they changed). Returns CPU tensors, identical on every TP/PP rank."""
        return self.generation.generate(prompts, sampling, version=self.step_count)

    def decode_engine(self) -> DecodeEngine:
        """The decode engine on this rank's GPTModel (built on first use; ``sampler``, ``sync_every`` and
        ``compact_rows`` are read from the actor at every call)."""
        return self.generation.decode_engine()

    def attach_rollout_engine(self, engine) -> None:
        """Generate with ``engine`` (e.g. :class:`laconic_nemo.rollout.vllm.VLLMRolloutEngine`) instead of
        the decode engine; it refits the policy weights into itself whenever they changed."""
        self.generation.rollout_engine = engine

    # ------------------------------------------------------------------ log-probs (log_probs, reference)
    def token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log p(labels) [b, s] float32 at ``temperature`` from this rank's vocab shard of the logits [b, s, V/tp]
        (:meth:`laconic_nemo.actors.megatron_logprobs.Logprobs.token_logprobs`)."""
        return self.log_probs.token_logprobs(logits, labels, temperature)

    def logprobs(self, batch: TrainBatch, reference: bool = False, micro_batch_size: int | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probs [N, T-1] of ``batch.tokens`` [N, T] (float32) at ``temperature``, identical on every
        TP/PP rank; 0 from each row's end on (:meth:`laconic_nemo.actors.megatron_logprobs.Logprobs.logprobs`)."""
        return self.log_probs.logprobs(batch, reference, micro_batch_size, temperature)

    def reset_reference(self) -> None:
        """Freeze the current weights as the reference policy pi_ref (placed by ``grpo.reference_on``)."""
        self.reference.reset()

    def snapshot_reference(self) -> None:
        """PolicyActor contract: the current weights become pi_ref (only kept when kl_beta > 0)."""
        self.reference.snapshot()

    # ------------------------------------------------------------------ training (stepper)
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int | None = None) -> dict[str, float]:
        """One optimiser step on this DP rank's minibatch (:meth:`laconic_nemo.actors.megatron_step.TrainStep.
        train_step`): the loss metrics summed over micro-batches and DP ranks, ``grad_norm`` and ``lr``."""
        return self.stepper.train_step(batch, loss_fn, micro_batch_size)

    def set_learning_rate(self, lr: float) -> None:
        """Peak learning rate from the next optimiser step on (warmup schedule unchanged)."""
        self.stepper.set_learning_rate(lr)

    def reset_optimizer(self, lr: float) -> None:
        """Drop the Adam moments and restart the schedule at step 0 with peak learning rate ``lr``."""
        self.stepper.reset_optimizer(lr)

    def set_recompute(self, layers: int) -> None:
        """Full activation recompute of the first ``layers`` layers of every pipeline stage."""
        self.stepper.set_recompute(layers)

    def layer_shape(self):
        """The model's sizes for :mod:`laconic_nemo.actors.memory`."""
        return self.stepper.layer_shape()

    def plan_memory(self, tokens: int, seq: int, num_micro_batches: int, device_gib: float | None = None):
        """:meth:`laconic_nemo.actors.megatron_step.TrainStep.plan_memory`: the memory model for micro-batches of
        ``tokens`` tokens (longest sequence ``seq``)."""
        return self.stepper.plan_memory(tokens, seq, num_micro_batches, device_gib)

    def memory_prediction(self, device_gib: float | None = None) -> str | None:
        """The memory model's prediction for the last training step's micro-batches (None before the first)."""
        return self.stepper.memory_prediction(device_gib)

    # ------------------------------------------------------------------ weights and checkpoints (weights)
    def model_state(self) -> dict[str, torch.Tensor]:
        """This rank's weights (CPU copies), e.g. a warmed-up policy to cache."""
        return self.weights.model_state()

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights saved by :meth:`model_state` (same layout); the optimiser is untouched."""
        self.weights.load_model_state(state)

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """This rank's model, optimiser and scheduler state, pi_ref and layout (host copies, ``torch.save``-able):
        no copy of a tensor is made on the device."""
        state = {"model": self.weights.model_state()}
        state.update(self.stepper.checkpoint_entries())
        state["reference"] = self.reference.checkpoint_entry()
        state["parallel"] = self.weights.layout_entry()
        return state

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict_for_checkpoint` returned (same TP/PP layout)."""
        self.weights.load_checkpoint_entries(state)
        self.stepper.load_checkpoint_entries(state)
        self.reference.load_checkpoint_entry(state.get("reference"))

    def tp_split_dims(self) -> dict[str, int]:
        """Local parameter name -> the dimension its TP shards are concatenated along (TP-sharded ones only)."""
        return self.weights.tp_split_dims()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded float32 CPU weights, named as in a TP=1/PP=1 GPTModel; identical on every rank."""
        return self.weights.full_state_dict()

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients (``main_grad``) of the last backward, same naming as :meth:`full_state_dict`."""
        return self.weights.full_grad_dict()

    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Load unsharded weights (naming of :meth:`full_state_dict`) into this rank's shard."""
        self.weights.load_full_state_dict(full)
