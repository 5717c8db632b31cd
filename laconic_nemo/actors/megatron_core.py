"""Policy actor on bare megatron-core: GPTModel with tensor, pipeline and data parallelism.

The same code runs on GPU over NCCL and on CPU over gloo (after :func:`laconic_nemo.runtime.megatron_env.
apply_cpu_patches`). Every method is SPMD: call it on every rank.

* Forward and backward go through megatron's ``get_forward_backward_func()`` schedule over
  micro-batches, so pipeline parallelism works with the 1F1B schedule.
* Micro-batches are packed (``micro_batch_tokens`` > 0, the default): rows concatenated into ``[1, S]``
  sequences of at most ``micro_batch_tokens`` tokens, no padding between rows, document-causal attention and
  positions restarting in every row (:mod:`laconic_nemo.actors.packing`); the log-probs are cut back into rows
  before the loss, so the loss, its global normalisation and the gradient are those of the unpacked path.
  ``micro_batch_tokens = 0``: micro-batches of ``micro_batch_size`` right-padded rows.
* Activation recompute (``recompute_layers``): megatron's full recompute of the first N layers of every
  pipeline stage; None picks, at every ``train_step`` on a GPU, the fewest layers that let the largest
  micro-batch fit the device by :mod:`laconic_nemo.actors.memory` (none where everything fits; none on CPU).
* Log-probs come from the TP-sharded logits through
  ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (the full vocabulary is never
  gathered), with the vocabulary-padding columns masked out, so they are the exact log-softmax over the
  real vocabulary.
* Gradients are SUMMED over micro-batches and data-parallel ranks: ``TransformerConfig.
  calculate_per_token_loss=True`` makes megatron's DDP reduce with a scaling factor of 1, the schedule
  does not divide by the number of micro-batches, and ``finalize_model_grads`` is called without a token
  count. A loss normalised by global counts (see :mod:`laconic_nemo.grpo.loss`) thus yields the global
  objective's gradient.
* Optimiser: megatron-core's plain (non-distributed) optimizer, Adam, global grad-norm clipping over
  the model-parallel group; a constant learning rate with linear warmup.
* Reference policy (``grpo.kl_beta > 0``): a frozen CPU copy of the initial weights, swapped into the
  model for reference log-probs.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch
import torch.distributed as dist

from laconic_nemo.actors import memory
from laconic_nemo.actors.packing import Pack, build_packs, cut_positions
from laconic_nemo.grpo.interfaces import GenerationOutput, LossFn, SamplingParams, TrainBatch
from laconic_nemo.rollout import megatron_sampler
from laconic_nemo.rollout.engine import DecodeEngine, engine_settings_from_config
from laconic_nemo.runtime.kernels import (
    REFERENCE_CHOICES,
    SAMPLER_CHOICES,
    fusion_flags,
    packed_seq_params,
    resolve_attention,
    with_core_attention,
)
from laconic_nemo.runtime.megatron_env import ParallelInfo, parallel_info

ModelProvider = Callable[[bool, bool], torch.nn.Module]

_LAYER_PREFIX = "decoder.layers."



def resolve_choice(key: str, value: str, choices: tuple[str, ...], auto: str) -> str:
    """``value`` checked against ``choices`` (ValueError naming ``key``), with ``auto`` replaced by ``auto``."""
    if value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
    return auto if value == "auto" else value


def gather_last_dim(t: torch.Tensor, group) -> torch.Tensor:
    """The TP shards of ``t`` side by side: [b, n] on each of the tp ranks of ``group`` -> [b, tp * n] (rank r's
    shard in columns r*n..(r+1)*n, as megatron's ``gather_from_tensor_model_parallel_region``), through torch's
    ``all_gather_single`` (torch >= 2.13 deprecates the ``all_gather_into_tensor`` that megatron-core 0.11 calls;
    older torch has only that). A copy of bytes: the result is bit for bit megatron's."""
    world = dist.get_world_size(group)
    if world == 1:
        return t
    t = t.contiguous()
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)
    return torch.cat(out.chunk(world, dim=0), dim=-1).contiguous()


def pad_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of ``tp`` that is >= vocab_size."""
    return ((vocab_size + tp - 1) // tp) * tp


class MegatronCoreActor:
    """A megatron-core GPT policy implementing :class:`laconic_nemo.grpo.interfaces.PolicyActor`.

    Use :meth:`from_config`. Attributes: ``model`` (list of model chunks, megatron DDP-wrapped),
    ``optimizer`` (megatron optimizer), ``info`` (:class:`ParallelInfo`), ``vocab_size`` (real),
    ``padded_vocab_size`` (multiple of TP), ``pad_id`` (fills rows after their end in generated tokens;
    None = the EOS id), ``micro_batch_tokens`` (token budget of a packed micro-batch; 0 = rows of
    ``micro_batch_size``, padded).
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
    ):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if lr < 0:
            raise ValueError(f"optim.lr must be >= 0, got {lr}")
        if warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {warmup_steps}")
        if grad_clip < 0:
            raise ValueError(f"optim.grad_clip must be >= 0 (0 disables), got {grad_clip}")
        if micro_batch_size < 1:
            raise ValueError(f"grpo.micro_batch_size must be >= 1, got {micro_batch_size}")
        if micro_batch_tokens < 0:
            raise ValueError(f"grpo.micro_batch_tokens must be >= 0 (0: no packing), got {micro_batch_tokens}")
        self.info = info
        self.config = transformer_config
        self.vocab_size = int(vocab_size)
        self.padded_vocab_size = int(padded_vocab_size)
        self.lr = float(lr)
        self.warmup_steps = int(warmup_steps)
        self.grad_clip = float(grad_clip)
        self.kl_beta = float(kl_beta)
        self.micro_batch_size = int(micro_batch_size)
        self.pad_id = None if pad_id is None else int(pad_id)
        self.device = info.device
        on_gpu = self.device.type == "cuda"
        self.sampler = resolve_choice("rollout.sampler", sampler, SAMPLER_CHOICES, "device" if on_gpu else "exact")
        self.sync_every = int(sync_every)
        self.compact_rows = bool(compact_rows)
        if logprob_chunk_size < 1:
            raise ValueError(f"grpo.logprob_chunk_size must be >= 1, got {logprob_chunk_size}")
        self.logprob_chunk_size = int(logprob_chunk_size)
        self.sort_by_length = bool(sort_by_length)
        self.micro_batch_tokens = int(micro_batch_tokens)
        if recompute_layers is not None and recompute_layers < 0:
            raise ValueError(f"grpo.recompute_layers must be null or >= 0, got {recompute_layers}")
        self.recompute_setting = None if recompute_layers is None else int(recompute_layers)
        self.recompute_layers = 0  # layers per stage recomputed by the last train_step
        self.memory_plan: memory.MemoryPlan | None = None  # the plan behind the last choice by memory (GPU)
        self.reference_on = resolve_choice("grpo.reference_on", reference_on, REFERENCE_CHOICES, "device")
        if self.reference_on == "pinned" and not on_gpu:
            raise ValueError("grpo.reference_on=pinned needs a GPU (pinned host memory); use device, cpu or auto")
        self.step_count = 0

        from megatron.core import parallel_state

        pre = parallel_state.is_pipeline_first_stage()
        post = parallel_state.is_pipeline_last_stage()
        module = model_provider(pre, post)
        # every weight in the model's dtype (megatron-LM's Float16Module does the same): the local spec's
        # torch RMSNorm is created in float32, and a bf16 input with a float32 weight misses the fused kernel
        module.to(device=self.device, dtype=transformer_config.params_dtype)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        # Sum (not average) over micro-batches and DP: see the module docstring. Set BEFORE the DDP wrapper:
        # megatron-core fixes its gradient scaling factor (1 or 1/DP) from this flag when DDP is built.
        transformer_config.calculate_per_token_loss = True
        self.model = [DistributedDataParallel(config=transformer_config, ddp_config=ddp_config, module=module)]
        transformer_config.finalize_model_grads_func = lambda chunks, num_tokens=None: finalize_model_grads(
            chunks, None
        )
        transformer_config.no_sync_func = self.model[0].no_sync
        transformer_config.grad_scale_func = None
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=self.lr,
            weight_decay=float(weight_decay),
            adam_beta1=float(adam_beta1),
            adam_beta2=float(adam_beta2),
            adam_eps=float(adam_eps),
            clip_grad=0.0,  # clipped by hand in _clip_and_step (megatron's clip asserts CUDA tensors)
            bf16=bool(transformer_config.bf16),
            fp16=False,
            params_dtype=transformer_config.params_dtype,
            use_distributed_optimizer=False,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.model)
        self._forward_backward = get_forward_backward_func()
        self._ref_state: dict[str, torch.Tensor] | None = None
        self._scratch: dict[str, torch.Tensor] | None = None  # pinned host buffer for reference_on=pinned
        self.rollout_engine = None
        self._engine_weights_step: int | None = None
        # the decode engine's settings (rollout.*; laconic_nemo.rollout.engine.EngineSettings), None: its defaults
        self.engine_settings = engine_settings
        self._decode_engine = None
        if self.kl_beta > 0:
            self.reset_reference()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg: Any, model_provider: ModelProvider | None = None) -> "MegatronCoreActor":
        """Build from the OmegaConf of ``recipes/base.yaml`` (sections model, parallel, optim, grpo, run.seed).

        torch.distributed and megatron's parallel state must be initialised with the recipe's TP x PP (the entry
        point calls :func:`laconic_nemo.runtime.megatron_env.init_distributed`); the actor does not initialise them.
        model_provider: optional ``(pre_process, post_process) -> GPTModel`` (e.g. an architecture loaded
        from a Hugging Face checkpoint); the default builds the synthetic GPT of ``cfg.model``.
        ``cfg.model.vocab_size`` must be set either way (the real vocabulary; padding is internal).
        """
        model_cfg, par, optim, grpo, rollout = cfg.model, cfg.parallel, cfg.optim, cfg.grpo, cfg.rollout
        tp = int(par.tensor_model_parallel_size)
        pp = int(par.pipeline_model_parallel_size)
        info = parallel_info(tp, pp)
        on_gpu = info.device.type == "cuda"
        attention = resolve_attention(str(model_cfg.attention), on_gpu)
        hf_path = None
        if str(model_cfg.source) == "hf":
            # A Hugging Face checkpoint: architecture, shapes and weights from the bridge.
            from laconic_nemo.bridge import arch_from_hf_config
            from laconic_nemo.bridge.megatron import actor_kwargs

            hf_path = str(model_cfg.path)
            arch = arch_from_hf_config(hf_path)
            dtype = torch.bfloat16 if str(model_cfg.precision) == "bf16" else None
            parts = actor_kwargs(arch, tp, pp, cpu=not on_gpu, dtype=dtype, attention=attention)
            tconfig, model_provider = parts["transformer_config"], parts["model_provider"]
            vocab_size, padded = parts["vocab_size"], parts["padded_vocab_size"]
        else:
            tconfig = build_transformer_config(model_cfg, tp, pp, on_gpu=on_gpu)
            vocab_size = int(model_cfg.vocab_size)
            padded = pad_vocab_size(vocab_size, tp)
        if model_provider is None:
            max_pos = int(model_cfg.max_position_embeddings)

            def model_provider(pre_process: bool, post_process: bool):
                return build_gpt_model(tconfig, padded, max_pos, pre_process, post_process, attention)

        actor = cls(
            info,
            tconfig,
            model_provider,
            vocab_size=vocab_size,
            padded_vocab_size=padded,
            lr=float(optim.lr),
            weight_decay=float(optim.weight_decay),
            adam_beta1=float(optim.adam_beta1),
            adam_beta2=float(optim.adam_beta2),
            adam_eps=float(optim.adam_eps),
            warmup_steps=int(optim.warmup_steps),
            grad_clip=float(optim.grad_clip),
            kl_beta=float(grpo.kl_beta),
            micro_batch_size=int(grpo.micro_batch_size),
            pad_id=None,  # not a recipe key: responses are padded with the EOS id
            sampler=str(rollout.sampler),
            sync_every=int(rollout.sync_every),
            compact_rows=bool(rollout.compact),
            logprob_chunk_size=int(grpo.logprob_chunk_size),
            reference_on=str(grpo.reference_on),
            sort_by_length=bool(grpo.sort_by_length),
            engine_settings=engine_settings_from_config(cfg, info.dp_size, on_gpu),
            micro_batch_tokens=int(grpo.micro_batch_tokens),
            recompute_layers=None if grpo.recompute_layers is None else int(grpo.recompute_layers),
        )
        if hf_path is not None:
            from laconic_nemo.bridge import load_hf_checkpoint

            load_hf_checkpoint(actor.model, hf_path, arch)
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

    # ------------------------------------------------------------------ helpers
    def token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log p(labels) [b, s] float32 at ``temperature`` (softmax of logits / temperature) from this rank's vocab
        shard of the logits [b, s, V/tp] (vocab-parallel cross entropy; padded vocabulary columns excluded).

        Computed in sequence chunks of ``logprob_chunk_size`` positions, so at most one chunk's float32
        copy of the logits exists at a time; with autograd on, each chunk is recomputed in backward
        (activation checkpointing) instead of keeping its float32 softmax."""
        s = logits.shape[1]
        if s <= self.logprob_chunk_size:
            return self._chunk_logprobs(logits, labels, temperature)
        parts = []
        for a in range(0, s, self.logprob_chunk_size):
            lg, lb = logits[:, a : a + self.logprob_chunk_size], labels[:, a : a + self.logprob_chunk_size]
            if torch.is_grad_enabled() and lg.requires_grad:
                parts.append(torch.utils.checkpoint.checkpoint(self._chunk_logprobs, lg, lb, temperature,
                                                               use_reentrant=False))
            else:
                parts.append(self._chunk_logprobs(lg, lb, temperature))
        return torch.cat(parts, dim=1)

    def _chunk_logprobs(self, logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
        from megatron.core import tensor_parallel

        logits = logits.float()
        if temperature != 1.0:
            logits = logits / float(temperature)
        part = logits.shape[-1]
        start = self.tp_rank * part
        if start + part > self.vocab_size:
            ids = torch.arange(start, start + part, device=logits.device)
            logits = logits.masked_fill(ids >= self.vocab_size, torch.finfo(logits.dtype).min)
        return -tensor_parallel.vocab_parallel_cross_entropy(logits, labels)

    def _position_ids(self, b: int, s: int, start: int = 0) -> torch.Tensor:
        return torch.arange(start, start + s, device=self.device).unsqueeze(0).expand(b, s)

    def _pad_rows(self, batch: TrainBatch, mbs: int) -> TrainBatch:
        """Pad to a multiple of ``mbs`` rows (copies of row 0 with an empty response mask and zero advantage)
        so every micro-batch has the same shape (pipeline p2p shapes are fixed)."""
        n = len(batch)
        extra = (-n) % mbs
        if extra == 0:
            return batch
        idx = torch.cat([torch.arange(n), torch.zeros(extra, dtype=torch.long)])
        out = batch.select(idx)
        out.response_mask = out.response_mask.clone()
        out.response_mask[n:] = 0
        if out.advantages is not None:
            out.advantages = out.advantages.clone()
            out.advantages[n:] = 0
        return out

    def _micro_batches(self, batch: TrainBatch, mbs: int) -> tuple[list[TrainBatch], torch.Tensor]:
        """Split ``batch`` (padded to a multiple of ``mbs`` rows) into micro-batches of ``mbs`` rows.

        With ``sort_by_length`` and PP = 1, rows are grouped by length (longest first) and each micro-batch
        is cut to its longest row (prompt + response), so short rows are not padded to the batch's longest;
        PP > 1 keeps one shape ``[mbs, T]`` (the pipeline's p2p buffers are sized once). Returns the
        micro-batches and the row order ``[n_padded]`` (micro-batch ``j`` holds rows
        ``order[j*mbs:(j+1)*mbs]``). Per-row results do not depend on the grouping: positions past a row's
        end are masked out of every loss."""
        padded = self._pad_rows(batch, mbs)
        n = len(padded)
        if not self.sort_by_length or self.info.pp_size > 1:
            order = torch.arange(n)
            return [padded.select(slice(i, i + mbs)) for i in range(0, n, mbs)], order
        ends = (padded.prompt_lengths + padded.response_lengths).clamp(min=2, max=padded.tokens.shape[1])
        order = torch.argsort(ends, descending=True, stable=True)
        micro = []
        for i in range(0, n, mbs):
            idx = order[i : i + mbs]
            micro.append(cut_positions(padded.select(idx), int(ends[idx].max())))
        return micro, order

    def _packs(self, batch: TrainBatch) -> list[Pack]:
        """``batch`` packed into micro-batches of at most ``micro_batch_tokens`` tokens (a longer row: alone);
        with PP > 1 every pack is padded at its tail to the longest one (fixed p2p shapes)."""
        return build_packs(batch, self.micro_batch_tokens, pad_to_longest=self.info.pp_size > 1,
                           pad_id=self.pad_id or 0)

    def _pack_forward(self, model, pack: Pack) -> torch.Tensor:
        """The model on one packed micro-batch: logits [1, S, V/tp] on the last stage (hidden states before)."""
        tok = pack.tokens.to(self.device)
        params = packed_seq_params(pack.cu_seqlens.to(self.device), pack.max_seqlen)
        return model(tok, pack.position_ids.to(self.device), None, packed_seq_params=params)

    def layer_shape(self) -> memory.LayerShape:
        """The model's sizes for :mod:`laconic_nemo.actors.memory`."""
        c = self.config
        return memory.LayerShape(hidden=c.hidden_size, heads=c.num_attention_heads,
                                 groups=c.num_query_groups or c.num_attention_heads, head_dim=c.kv_channels,
                                 ffn=c.ffn_hidden_size, layers=c.num_layers, vocab=self.padded_vocab_size,
                                 gated=bool(c.gated_linear_unit))

    def plan_memory(self, tokens: int, seq: int, num_micro_batches: int,
                    device_gib: float | None = None) -> memory.MemoryPlan:
        """:func:`laconic_nemo.actors.memory.plan_memory` for this rank: its parameters, dtype, core attention
        and reference placement, micro-batches of ``tokens`` tokens (longest sequence ``seq``), the device's memory
        (or ``device_gib``)."""
        if device_gib is None:
            device_gib = torch.cuda.get_device_properties(self.device).total_memory / memory.GIB
        core = type(self.module.decoder.layers[0].self_attention.core_attention).__name__
        kernel = "local" if core == "LocalAttention" else ("dense" if self.device.type != "cuda" else "flash")
        return memory.plan_memory(
            self.layer_shape(), tokens, device_gib, tp=self.info.tp_size, pp=self.info.pp_size,
            dtype_bytes=torch.finfo(self.config.params_dtype).bits // 8, kernel=kernel,
            params=sum(p.numel() for p in self.module.parameters()),
            reference_on_device=self._ref_state is not None and self.reference_on == "device",
            num_micro_batches=num_micro_batches, logprob_chunk=self.logprob_chunk_size, seq=seq,
            fused_swiglu=bool(self.config.bias_activation_fusion))

    def _choose_recompute(self, tokens: int, seq: int, num_micro_batches: int) -> int:
        """Layers per pipeline stage to recompute for micro-batches of ``tokens`` tokens (``recompute_setting``;
        None: by memory on GPU, none on CPU)."""
        per_stage = self.config.num_layers // self.info.pp_size
        if self.recompute_setting is not None:
            return min(self.recompute_setting, per_stage)
        if self.device.type != "cuda":
            return 0
        self.memory_plan = self.plan_memory(tokens, seq, num_micro_batches)
        chosen = self.memory_plan.recompute_layers
        return per_stage if chosen is None else chosen

    def set_recompute(self, layers: int) -> None:
        """Full activation recompute of the first ``layers`` layers of every pipeline stage (:func:`set_recompute`)."""
        self.recompute_layers = set_recompute(self.config, layers, self.config.num_layers // self.info.pp_size)

    def _schedule(self, forward_step: Callable, micro_batches: list, seq_length: int, micro_batch_size: int,
                  forward_only: bool) -> list:
        """megatron's forward(-backward) schedule (1F1B with PP > 1) of ``forward_step`` over ``micro_batches``
        (each ``[micro_batch_size, <= seq_length]``); returns the loss functions' metric dicts (last stage)."""
        return self._forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    @contextlib.contextmanager
    def _eval_mode(self):
        """Modules in eval mode for a pass without backward: megatron skips activation recompute (which
        would also drop the KV cache of generation) only when ``module.training`` is False."""
        was = [m.training for m in self.model]
        for m in self.model:
            m.eval()
        try:
            yield
        finally:
            for m, w in zip(self.model, was):
                m.train(w)

    def _pp_broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast ``tensor`` from the last pipeline stage to every stage (in place)."""
        from megatron.core import parallel_state

        if self.info.pp_size > 1:
            dist.broadcast(
                tensor,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        return tensor

    def _lr_at(self, step: int) -> float:
        """Learning rate of optimiser step ``step`` (0-based): linear warmup over warmup_steps, then constant."""
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return self.lr

    # ------------------------------------------------------------------ reference policy
    def _place_reference(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` where ``reference_on`` keeps the reference weights (device, pinned or CPU memory)."""
        if self.reference_on == "device":
            return t.detach().to(self.device, copy=True)
        out = t.detach().to("cpu", copy=True)
        return out.pin_memory() if self.reference_on == "pinned" else out

    def reset_reference(self) -> None:
        """Freeze the current weights as the reference policy pi_ref (placed by ``grpo.reference_on``)."""
        self._ref_state = {k: self._place_reference(v) for k, v in self._param_state().items()}

    def snapshot_reference(self) -> None:
        """PolicyActor contract: the current weights become pi_ref (only kept when kl_beta > 0)."""
        if self.kl_beta > 0:
            self.reset_reference()

    def _exchange_reference(self) -> None:
        """Device-resident reference: swap the storage of every weight with its reference tensor (no copy;
        calling it twice restores both)."""
        ref = self._ref_state
        for k, v in self._param_state().items():
            v.data, ref[k] = ref[k], v.data

    def _save_params(self) -> dict[str, torch.Tensor]:
        """Host copies of the current weights (into a reused pinned buffer when ``reference_on=pinned``)."""
        current = self._param_state()
        if self.reference_on != "pinned":
            return {k: v.detach().to("cpu", copy=True) for k, v in current.items()}
        if self._scratch is None:
            self._scratch = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in current.items()}
        return {k: self._scratch[k].copy_(v.detach(), non_blocking=True) for k, v in current.items()}

    @torch.no_grad()
    def _load_params(self, state: dict[str, torch.Tensor]) -> None:
        non_blocking = self.reference_on == "pinned"
        for k, v in self._param_state().items():
            v.data.copy_(state[k].to(v.device, non_blocking=non_blocking))

    # ------------------------------------------------------------------ optimiser control
    def set_learning_rate(self, lr: float) -> None:
        """Peak learning rate from the next optimiser step on (warmup schedule unchanged)."""
        if not lr >= 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        self.lr = float(lr)

    def reset_optimizer(self, lr: float) -> None:
        """Drop the Adam moments and restart the schedule at step 0 with peak learning rate ``lr``."""
        self.set_learning_rate(lr)
        inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        for opt in inner:
            opt.optimizer.state.clear()
        self.step_count = 0

    def model_state(self) -> dict[str, torch.Tensor]:
        """This rank's weights (CPU copies), e.g. a warmed-up policy to cache."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self._param_state().items()}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights saved by :meth:`model_state` (same layout); the optimiser is untouched."""
        current = self._param_state()
        missing = set(current) - set(state)
        if missing:
            raise ValueError(f"model state lacks tensors: {sorted(missing)[:5]}")
        with torch.no_grad():
            for k, v in current.items():
                v.data.copy_(state[k].to(v.device))

    def _param_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, reference: bool = False, micro_batch_size: int | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probs [N, T-1] of ``batch.tokens`` (float32) at ``temperature``, identical on every
        TP/PP rank. Position ``j`` is log p(token j+1 | tokens <= j); it is 0 from each row's end on (j + 1 >=
        prompt + response length), where nothing is scored. Packed micro-batches of ``micro_batch_tokens``
        (``micro_batch_size`` applies only without packing)."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if reference:
            if self._ref_state is None:
                raise ValueError("reference log-probs need a reference policy (grpo.kl_beta > 0 or reset_reference())")
            if self.reference_on == "device":
                self._exchange_reference()
                try:
                    return self.logprobs(batch, reference=False, micro_batch_size=micro_batch_size,
                                         temperature=temperature)
                finally:
                    self._exchange_reference()
            saved = self._save_params()
            self._load_params(self._ref_state)
            try:
                return self.logprobs(batch, reference=False, micro_batch_size=micro_batch_size,
                                     temperature=temperature)
            finally:
                self._load_params(saved)
        n, T = batch.tokens.shape
        if T < 2:
            raise ValueError(f"tokens must have at least 2 positions, got T={T}")
        if self.micro_batch_tokens > 0:
            result = self._packed_logprobs(batch, temperature)
        else:
            result = self._padded_logprobs(batch, micro_batch_size, temperature)
        ends = (batch.prompt_lengths + batch.response_lengths).unsqueeze(1)  # [N, 1]
        return result.masked_fill(torch.arange(1, T).unsqueeze(0) >= ends, 0.0)

    def _packed_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        """:meth:`logprobs` over packed micro-batches: [N, T-1] float32 CPU, before the past-the-end zeroing."""
        n, T = batch.tokens.shape
        packs = self._packs(batch)

        def forward_step(data_iterator, model):
            pack = next(data_iterator)
            tok = pack.tokens.to(self.device)
            labels = torch.roll(tok, shifts=-1, dims=1)
            out = self._pack_forward(model, pack)

            def loss_func(output):
                logp = pack.unpack(self.token_logprobs(output, labels, temperature)[0])  # [k, W-1]
                return logp.sum() * 0.0, torch.tensor(1, dtype=torch.int), {"logprobs": logp.float()}

            return out, loss_func

        with self._eval_mode():
            store = self._schedule(forward_step, packs, max(p.size for p in packs), 1, forward_only=True)
        result = torch.zeros(n, T - 1, dtype=torch.float32, device=self.device)
        if self.is_last_stage:
            for d, pack in zip(store, packs):
                lp = d["logprobs"]
                result[pack.rows.to(self.device), : lp.shape[1]] = lp
        return self._pp_broadcast(result).cpu()

    def _padded_logprobs(self, batch: TrainBatch, micro_batch_size: int | None, temperature: float) -> torch.Tensor:
        """:meth:`logprobs` over micro-batches of right-padded rows (``micro_batch_tokens = 0``)."""
        n, T = batch.tokens.shape
        mbs = min(micro_batch_size or self.micro_batch_size, n)
        micro, rows = self._micro_batches(batch, mbs)
        chunks = [mb.tokens for mb in micro]

        def forward_step(data_iterator, model):
            tok = next(data_iterator).to(self.device)
            labels = torch.roll(tok, shifts=-1, dims=1)
            out = model(tok, self._position_ids(*tok.shape), None)

            def loss_func(output):
                logp = self.token_logprobs(output, labels, temperature)[:, :-1]
                return logp.sum() * 0.0, torch.tensor(1, dtype=torch.int), {"logprobs": logp.float()}

            return out, loss_func

        with self._eval_mode():
            store = self._schedule(forward_step, chunks, T, mbs, forward_only=True)
        if self.is_last_stage:
            result = torch.zeros(len(rows), T - 1, dtype=torch.float32, device=self.device)
            for d, r in zip(store, rows.split(mbs)):
                lp = d["logprobs"]
                result[r.to(self.device), : lp.shape[1]] = lp
            result = result[:n].contiguous()
        else:
            result = torch.empty(n, T - 1, dtype=torch.float32, device=self.device)
        return self._pp_broadcast(result).cpu()

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int | None = None) -> dict[str, float]:
        """One optimiser step on this DP rank's minibatch ``batch``; see the module docstring.

        Micro-batches: packs of ``micro_batch_tokens`` tokens, whose log-probs [k, W-1] and rows reach
        ``loss_fn`` as a padded micro-batch would (``micro_batch_size`` applies only without packing). Activation
        recompute for this step: :meth:`_choose_recompute`.
        Returns the loss metrics summed over micro-batches and DP ranks (loss functions report shares of
        global means), plus ``grad_norm`` (before clipping) and ``lr``; identical on every rank.
        """
        n, T = batch.tokens.shape
        mbs = min(micro_batch_size or self.micro_batch_size, n)
        if mbs < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        temperature = float(getattr(loss_fn, "temperature", 1.0))  # log-probs at the loss's temperature
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

        if self.micro_batch_tokens > 0:
            packs = self._packs(batch)
            self.set_recompute(self._choose_recompute(max(p.size for p in packs),
                                                      max(p.max_seqlen for p in packs), len(packs)))

            def forward_step(data_iterator, model):
                pack = next(data_iterator)
                labels = torch.roll(pack.tokens.to(self.device), shifts=-1, dims=1)
                out = self._pack_forward(model, pack)

                def loss_func(output):
                    # the pack's log-probs cut back into its rows [k, W-1]: the loss sees the unpacked layout
                    logp = pack.unpack(self.token_logprobs(output, labels, temperature)[0])
                    loss, metrics = loss_fn(logp, pack.batch)
                    return loss, torch.tensor(1, dtype=torch.int), metrics

                return out, loss_func

            store = self._schedule(forward_step, packs, max(p.size for p in packs), 1, forward_only=False)
        else:
            micro, _ = self._micro_batches(batch, mbs)
            widest = max(mb.tokens.shape[1] for mb in micro)
            self.set_recompute(self._choose_recompute(mbs * widest, widest, len(micro)))

            def forward_step(data_iterator, model):
                mb = next(data_iterator)
                tok = mb.tokens.to(self.device)
                labels = torch.roll(tok, shifts=-1, dims=1)
                out = model(tok, self._position_ids(*tok.shape), None)

                def loss_func(output):
                    logp = self.token_logprobs(output, labels, temperature)[:, :-1]
                    loss, metrics = loss_fn(logp, mb)
                    return loss, torch.tensor(1, dtype=torch.int), metrics

                return out, loss_func

            store = self._schedule(forward_step, micro, T, mbs, forward_only=False)
        lr = self._lr_at(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = self._clip_and_step()
        self.step_count += 1
        metrics = self._reduce_metrics(store)
        metrics["grad_norm"] = grad_norm
        metrics["lr"] = lr
        return metrics

    @torch.no_grad()
    def _clip_and_step(self) -> float:
        """Megatron's step, with the global grad-norm clip done here: copy main grads, norm over the
        model-parallel group (TP duplicates counted once), scale by clip / (norm + 1e-6) when below 1, step.
        Returns the norm before clipping."""
        found_inf = self.optimizer.prepare_grads()
        if found_inf:
            raise RuntimeError("non-finite gradients: optimizer step refused")
        grad_norm = float(self.optimizer.get_grad_norm())
        if not torch.isfinite(torch.tensor(grad_norm)):
            raise RuntimeError(f"non-finite gradient norm {grad_norm}: optimizer step refused")
        if self.grad_clip > 0:
            coeff = self.grad_clip / (grad_norm + 1.0e-6)
            if coeff < 1.0:
                for p in self.optimizer.get_parameters():
                    if p.grad is not None:
                        p.grad.mul_(coeff)
        self.optimizer.step_with_ready_grads()
        return grad_norm

    def _reduce_metrics(self, store: list[dict[str, float]]) -> dict[str, float]:
        """Sum metric dicts over micro-batches and DP (on the last stage), then share them over PP."""
        from megatron.core import parallel_state

        payload: list[Any] = [None]
        if self.is_last_stage:
            keys = sorted(store[0].keys()) if store else []
            values = torch.tensor(
                [sum(float(d[k]) for d in store) for k in keys], dtype=torch.float64, device=self.device
            )
            if self.dp_size > 1 and keys:
                dist.all_reduce(values, group=self.dp_group)
            payload = [dict(zip(keys, values.tolist()))]
        if self.info.pp_size > 1:
            dist.broadcast_object_list(
                payload,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        return dict(payload[0])

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample one response per prompt with the decode engine (:mod:`laconic_nemo.rollout.engine`: static KV
        cache, CUDA-graphed steps on GPU, ``rollout.sampler`` exact or device), or the attached rollout engine
        (vLLM). Returns CPU tensors, identical on every TP/PP rank."""
        if self.rollout_engine is not None:
            return self._generate_with_engine(prompts, sampling)
        megatron_sampler.check_sampling(sampling)
        if not 0 <= sampling.eos_id < self.vocab_size:
            raise ValueError(f"sampling.eos_id must be in [0, {self.vocab_size}), got {sampling.eos_id}")
        with self._eval_mode():
            return self.decode_engine().generate(prompts, sampling, stream=self.dp_rank, pad_id=self.pad_id)

    def decode_engine(self):
        """The decode engine on this rank's GPTModel (built on first use; ``sampler``, ``sync_every`` and
        ``compact_rows`` are read from the actor at every call)."""
        if self._decode_engine is None:
            self._decode_engine = DecodeEngine(self.model, self.vocab_size, self.engine_settings)
        s = self._decode_engine.settings
        s.sampler, s.sync_every, s.compact = self.sampler, self.sync_every, self.compact_rows
        return self._decode_engine

    def attach_rollout_engine(self, engine) -> None:
        """Generate with ``engine`` (e.g. :class:`laconic_nemo.rollout.vllm.VLLMRolloutEngine`) instead of
        the in-process sampler; the policy weights are refitted into it whenever they changed."""
        self.rollout_engine = engine
        self._engine_weights_step = None

    def _generate_with_engine(self, prompts, sampling) -> GenerationOutput:
        # a colocated engine discards its weights when it sleeps: refit then too, not only after a step
        if self._engine_weights_step != self.step_count or getattr(self.rollout_engine, "needs_refit", False):
            self.rollout_engine.refit(self.model)
            self._engine_weights_step = self.step_count
        out = self.rollout_engine.generate(prompts, sampling)
        if hasattr(self.rollout_engine, "sleep"):
            self.rollout_engine.sleep()  # colocated: give the memory back to training
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """This rank's model, optimiser and scheduler state (deep copies, ``torch.save``-able)."""
        return {
            "model": {k: v.detach().to("cpu", copy=True) for k, v in self._param_state().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": {"step_count": self.step_count, "lr": self.lr, "warmup_steps": self.warmup_steps},
            "reference": None if self._ref_state is None else {k: v.to("cpu", copy=True) for k, v in self._ref_state.items()},
            "parallel": {"tp": self.info.tp_size, "pp": self.info.pp_size, "tp_rank": self.tp_rank,
                         "pp_rank": self.pp_rank, "num_layers": self.config.num_layers,
                         "vocab_size": self.vocab_size, "tp_split_dims": self.tp_split_dims()},
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict_for_checkpoint` returned (same TP/PP layout)."""
        par = state.get("parallel", {})
        if par and (par.get("tp"), par.get("pp")) != (self.info.tp_size, self.info.pp_size):
            raise ValueError(
                f"checkpoint was written with tp={par.get('tp')}, pp={par.get('pp')}; this run has "
                f"tp={self.info.tp_size}, pp={self.info.pp_size}"
            )
        current = self._param_state()
        missing = set(current) - set(state["model"])
        if missing:
            raise ValueError(f"checkpoint lacks model tensors: {sorted(missing)[:5]}")
        with torch.no_grad():
            for k, v in current.items():
                v.data.copy_(state["model"][k].to(v.device))
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.step_count = int(state["scheduler"]["step_count"])
        ref = state.get("reference")
        self._ref_state = None if ref is None else {k: self._place_reference(v) for k, v in ref.items()}

    # ------------------------------------------------------------------ full (unsharded) tensors
    def _global_name(self, name: str) -> str:
        """Local parameter name -> name in the unsharded single-stage model (global layer index)."""
        return global_param_name(name, self.pp_rank, self.config.num_layers // self.info.pp_size)

    def tp_split_dims(self) -> dict[str, int]:
        """Local parameter name -> the dimension its TP shards are concatenated along (TP-sharded ones only)."""
        return {name: int(p.partition_dim) for name, p in self.module.named_parameters()
                if getattr(p, "tensor_model_parallel", False)}

    def _local_tensors(self, grads: bool) -> dict[str, tuple[torch.Tensor, Any]]:
        out = {}
        for name, p in self.module.named_parameters():
            if grads:
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                t = g
            else:
                t = p
            out[name] = (t.detach(), p)
        return out

    def _gather_full(self, grads: bool) -> dict[str, torch.Tensor]:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
        mine = {}
        for name, (t, p) in self._local_tensors(grads).items():
            if getattr(p, "tensor_model_parallel", False) and self.info.tp_size > 1:
                parts = [torch.empty_like(t) for _ in range(self.info.tp_size)]
                dist.all_gather(parts, t.contiguous(), group=tp_group)
                t = torch.cat(parts, dim=p.partition_dim)
            t = t.float().cpu().clone()
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                t = t[: self.vocab_size]
            mine[self._global_name(name)] = t
        if self.info.pp_size > 1:
            everything: list[Any] = [None] * self.info.pp_size
            dist.all_gather_object(everything, mine, group=parallel_state.get_pipeline_model_parallel_group())
            full = {}
            for d in everything:
                full.update(d)
            return full
        return mine

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded float32 CPU weights (TP shards concatenated, PP stages merged, vocab padding removed),
        named as in a TP=1/PP=1 GPTModel; identical on every rank."""
        return self._gather_full(grads=False)

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients (``main_grad``) of the last backward, same naming as :meth:`full_state_dict`."""
        return self._gather_full(grads=True)

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Load unsharded weights (naming of :meth:`full_state_dict`): pad the vocabulary, take this rank's
        TP shard and PP layers. Padded vocabulary rows are set to zero."""
        for name, p in self.module.named_parameters():
            key = self._global_name(name)
            if key not in full:
                raise KeyError(f"full state dict lacks {key!r}")
            t = full[key].to(torch.float32)
            if name in ("embedding.word_embeddings.weight", "output_layer.weight") and t.shape[0] < self.padded_vocab_size:
                t = torch.cat([t, t.new_zeros(self.padded_vocab_size - t.shape[0], *t.shape[1:])], dim=0)
            if getattr(p, "tensor_model_parallel", False) and self.info.tp_size > 1:
                t = t.chunk(self.info.tp_size, dim=p.partition_dim)[self.tp_rank]
            if t.shape != p.shape:
                raise ValueError(f"{key}: shard shape {tuple(t.shape)} does not match parameter {tuple(p.shape)}")
            p.data.copy_(t.to(p.device, p.dtype))


def set_recompute(config: Any, layers: int, layers_per_stage: int) -> int:
    """Full activation recompute of the first ``layers`` layers of every pipeline stage on megatron's
    TransformerConfig (its TransformerBlock reads these fields at every forward, ``transformer_block.py:358-391``):
    0 = none; all of the stage's layers = the ``uniform`` method, one layer per checkpoint; fewer = the ``block``
    method. Returns the number of layers recomputed per stage."""
    n = max(0, min(int(layers), layers_per_stage))
    if n == 0:
        config.recompute_granularity = config.recompute_method = config.recompute_num_layers = None
    elif n == layers_per_stage:
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "uniform", 1
    else:
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "block", n
    return n


def global_param_name(name: str, pp_rank: int, layers_per_stage: int) -> str:
    """Local parameter name of pipeline stage ``pp_rank`` -> its name in the unsharded single-stage model
    (``decoder.layers.<i>`` renumbered with the global layer index ``i + pp_rank * layers_per_stage``)."""
    if name.startswith(_LAYER_PREFIX):
        idx, tail = name[len(_LAYER_PREFIX):].split(".", 1)
        return f"{_LAYER_PREFIX}{int(idx) + pp_rank * layers_per_stage}.{tail}"
    return name


def merge_rank_states(states: dict[tuple[int, int], dict[str, torch.Tensor]], tp: int, pp: int, num_layers: int,
                      tp_split_dims: dict[str, int], vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Offline counterpart of :meth:`MegatronCoreActor.full_state_dict`: merge the per-rank weights of a
    TP x PP layout into the unsharded single-stage model, without torch.distributed.

    states: ``(tp_rank, pp_rank) -> {local name: tensor}`` for every rank of the layout (what
    :meth:`MegatronCoreActor.state_dict_for_checkpoint` holds under ``"model"``); tp_split_dims: local
    name -> TP concatenation dimension of the TP-sharded parameters (others are replicated, the copy of
    TP rank 0 is taken); vocab_size: when given, the padded vocabulary rows of the embedding and output
    layer are dropped ([Vp, H] -> [V, H]). Tensors keep their dtype; names as in :meth:`full_state_dict`.
    """
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in states]
    if missing:
        raise ValueError(f"rank states missing for (tp_rank, pp_rank) {missing}")
    full: dict[str, torch.Tensor] = {}
    for p in range(pp):
        for name, t in states[(0, p)].items():
            if not isinstance(t, torch.Tensor) or name.endswith("_extra_state"):
                continue
            if name in tp_split_dims and tp > 1:
                t = torch.cat([states[(r, p)][name] for r in range(tp)], dim=tp_split_dims[name])
            if vocab_size is not None and name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                t = t[:vocab_size]
            key = global_param_name(name, p, num_layers // pp)
            if key in full:
                raise ValueError(f"{key} is held by two pipeline stages")
            full[key] = t
    return full


def build_transformer_config(model_cfg: Any, tp: int, pp: int, on_gpu: bool):
    """megatron TransformerConfig for the synthetic GPT (dropout 0; fp32 and fusions off on CPU, the available
    fusions on GPU: :func:`laconic_nemo.runtime.kernels.fusion_flags`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    precision = str(model_cfg.precision)
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"model.precision must be fp32 or bf16, got {precision!r}")
    if precision == "bf16" and not on_gpu:
        raise ValueError("model.precision=bf16 needs a GPU; use fp32 on CPU")
    num_layers = int(model_cfg.num_layers)
    if num_layers % pp != 0:
        raise ValueError(f"model.num_layers={num_layers} must be divisible by pipeline_model_parallel_size={pp}")
    heads = int(model_cfg.num_attention_heads)
    if heads % tp != 0:
        raise ValueError(f"model.num_attention_heads={heads} must be divisible by tensor_model_parallel_size={tp}")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    groups = model_cfg.num_query_groups
    if groups is not None and int(groups) % tp != 0:
        raise ValueError(f"model.num_query_groups={groups} must be divisible by tensor_model_parallel_size={tp}")
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=int(model_cfg.hidden_size),
        num_attention_heads=heads,
        num_query_groups=None if groups is None else int(groups),
        ffn_hidden_size=int(model_cfg.ffn_hidden_size),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=precision == "bf16",
        use_cpu_initialization=not on_gpu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
        **fusion_flags(on_gpu),
    )


def build_gpt_model(tconfig: Any, padded_vocab_size: int, max_position_embeddings: int, pre_process: bool,
                    post_process: bool, attention: str = "local"):
    """megatron-core GPTModel with the local layer spec, core attention ``attention`` (a resolved
    ``model.attention``, see :mod:`laconic_nemo.runtime.kernels`), RoPE, untied output."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel(
        config=tconfig,
        transformer_layer_spec=with_core_attention(get_gpt_layer_local_spec(), attention),
        vocab_size=padded_vocab_size,
        max_sequence_length=max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
