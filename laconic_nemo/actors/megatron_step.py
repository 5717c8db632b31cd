"""The training step of the megatron-core actor: one optimiser step over a DP rank's minibatch.

* Forward and backward go through megatron's ``get_forward_backward_func()`` schedule over micro-batches (1F1B
  with PP > 1), packed or padded as for the log-probs (:mod:`laconic_nemo.actors.megatron_batches`); the loss sees
  the unpacked rows.
* Gradients are SUMMED over micro-batches and data-parallel ranks (:func:`laconic_nemo.actors.megatron_build.
  wrap_model`), so a loss normalised by global counts (:mod:`laconic_nemo.grpo.loss`) yields the global
  objective's gradient.
* Optimiser: megatron-core's Adam, a global grad-norm clip over the model-parallel group done here, a constant
  learning rate after a linear warmup.
* Activation recompute (``recompute_layers``): megatron's full recompute of the first N layers of every pipeline
  stage; None picks, at every step on a GPU, the fewest layers that let the largest micro-batch fit the device by
  :mod:`laconic_nemo.actors.memory` (none where everything fits; none on CPU).

:class:`TrainStep` is the training part of :class:`laconic_nemo.actors.megatron_core.MegatronCoreActor`: it owns
the optimiser, the step count and learning-rate schedule, the grad clip, the recompute setting and the memory plan,
and is given the weights, micro-batching, schedule, log-probs and reference parts it runs with.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist

from laconic_nemo.actors import memory
from laconic_nemo.actors.megatron_batches import MicroBatches
from laconic_nemo.actors.megatron_logprobs import Logprobs
from laconic_nemo.actors.megatron_reference import ReferencePolicy
from laconic_nemo.actors.megatron_schedule import ScheduleRunner
from laconic_nemo.actors.megatron_shards import ModelWeights, host_copy
from laconic_nemo.grpo.interfaces import LossFn, TrainBatch
from laconic_nemo.runtime.faults import fault_point
from laconic_nemo.runtime.megatron_compat import glu_keeps_offset_sum


class TrainStep:
    """:meth:`train_step`, its learning-rate schedule and optimiser control, and the activation recompute chosen for
    it.

    optimizer: megatron-core's optimizer over the model chunks; weights: the weights part (the module, its layout,
    config and vocabulary); batches, schedule, logprobs, reference: the micro-batching, schedule, log-probs and
    reference parts; resident_engine: returns the decode engine kept between rollouts (None: none built), whose
    memory the memory model counts; lr, warmup_steps, grad_clip: ``optim.*``; recompute_setting:
    ``grpo.recompute_layers`` (None: by memory).
    """

    def __init__(self, optimizer: Any, weights: ModelWeights, batches: MicroBatches, schedule: ScheduleRunner,
                 logprobs: Logprobs, reference: ReferencePolicy, resident_engine: Callable[[], Any], lr: float,
                 warmup_steps: int, grad_clip: float, recompute_setting: int | None):
        self.optimizer, self.weights, self.batches, self.schedule = optimizer, weights, batches, schedule
        self.logprobs, self.reference, self.resident_engine = logprobs, reference, resident_engine
        self.info, self.config, self.device = weights.info, weights.config, weights.info.device
        self.lr, self.warmup_steps, self.grad_clip = float(lr), int(warmup_steps), float(grad_clip)
        self.recompute_setting = None if recompute_setting is None else int(recompute_setting)
        self.recompute_layers = 0  # layers per stage recomputed by the last train_step
        self.memory_plan: memory.MemoryPlan | None = None  # the plan behind the last choice by memory (GPU)
        self.last_shape: tuple[int, int, int] | None = None  # (tokens, longest sequence, micro-batches), last step
        self.step_count = 0

    def layer_shape(self) -> memory.LayerShape:
        """The model's sizes for :mod:`laconic_nemo.actors.memory`."""
        return memory.layer_shape_of(self.config, self.weights.padded_vocab_size)

    def plan_memory(self, tokens: int, seq: int, num_micro_batches: int,
                    device_gib: float | None = None) -> memory.MemoryPlan:
        """:func:`laconic_nemo.actors.memory.plan_memory` for this rank: its parameters, dtype, core attention
        and reference placement, micro-batches of ``tokens`` tokens (longest sequence ``seq``; padded: ``tokens /
        seq`` rows of ``seq``), their log-prob chunks (:func:`laconic_nemo.actors.memory.logprob_chunk_tokens`), the
        device's memory (or ``device_gib``)."""
        if device_gib is None:
            device_gib = torch.cuda.get_device_properties(self.device).total_memory / memory.GIB
        module = self.weights.module
        core = type(module.decoder.layers[0].self_attention.core_attention).__name__
        kernel = "local" if core == "LocalAttention" else ("dense" if self.device.type != "cuda" else "flash")
        rows, width = (1, tokens) if self.batches.packed else (max(1, tokens // max(1, seq)), seq)
        return memory.plan_memory(
            self.layer_shape(), tokens, device_gib, tp=self.info.tp_size, pp=self.info.pp_size,
            dtype_bytes=torch.finfo(self.config.params_dtype).bits // 8, kernel=kernel,
            params=sum(p.numel() for p in module.parameters()),
            reference_on_device=self.reference.on_device,
            num_micro_batches=num_micro_batches,
            logprob_chunk=memory.logprob_chunk_tokens(self.logprobs.logprob_chunk_size, rows, width), seq=seq,
            fused_swiglu=bool(self.config.bias_activation_fusion), glu_offset_sum=glu_keeps_offset_sum(self.config),
            resident_bytes=memory.live_engine_bytes(self.resident_engine()))  # the engine kept between rollouts

    def _choose_recompute(self, tokens: int, seq: int, num_micro_batches: int) -> int:
        """Layers per pipeline stage to recompute for micro-batches of ``tokens`` tokens (``recompute_setting``;
        None: by memory on GPU, none on CPU)."""
        self.last_shape = (int(tokens), int(seq), int(num_micro_batches))
        layers, self.memory_plan = memory.choose_recompute(
            self.recompute_setting, self.config.num_layers // self.info.pp_size, self.device.type == "cuda",
            lambda: self.plan_memory(tokens, seq, num_micro_batches))
        return layers

    def memory_prediction(self, device_gib: float | None = None) -> str | None:
        """The memory model's prediction for the last training step's micro-batches (None before the first): the
        plan the recompute was chosen by, or (a fixed setting, CPU) the plan for the device's memory
        (:func:`laconic_nemo.actors.memory.memory_prediction`)."""
        self.memory_plan, line = memory.memory_prediction(self.memory_plan, self.last_shape, self.plan_memory,
                                                          self.device, device_gib)
        return line

    def set_recompute(self, layers: int) -> None:
        """Full activation recompute of the first ``layers`` layers of every pipeline stage (:func:`set_recompute`)."""
        self.recompute_layers = set_recompute(self.config, layers, self.config.num_layers // self.info.pp_size)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimiser step ``step`` (0-based): linear warmup over warmup_steps, then constant."""
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        return self.lr

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

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_entries(self) -> dict[str, Any]:
        """A checkpoint's ``"optimizer"`` (host copies, no copy of a tensor made on the device: the optimiser state
        is 12 bytes a parameter, ~20 GB at 1.5B on one rank) and ``"scheduler"`` entries."""
        return {"optimizer": host_copy(self.optimizer.state_dict()),
                "scheduler": {"step_count": self.step_count, "lr": self.lr, "warmup_steps": self.warmup_steps}}

    def load_checkpoint_entries(self, state: dict[str, Any]) -> None:
        """Restore the optimiser state and the step count of :meth:`checkpoint_entries`."""
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.step_count = int(state["scheduler"]["step_count"])

    # ------------------------------------------------------------------ training
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int | None = None) -> dict[str, float]:
        """One optimiser step on this DP rank's minibatch ``batch`` (tokens [n, T]); see the module docstring.

        Micro-batches: packs of ``micro_batch_tokens`` tokens, whose log-probs [k, W-1] and rows reach
        ``loss_fn`` as a padded micro-batch would (``micro_batch_size`` applies only without packing). Activation
        recompute for this step: :meth:`_choose_recompute`.
        Returns the loss metrics summed over micro-batches and DP ranks (loss functions report shares of
        global means), plus ``grad_norm`` (before clipping) and ``lr``; identical on every rank.
        """
        n, T = batch.tokens.shape
        mbs = self.batches.rows_per_micro_batch(n, micro_batch_size)
        if mbs < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        temperature = float(getattr(loss_fn, "temperature", 1.0))  # log-probs at the loss's temperature
        token_logprobs = self.logprobs.token_logprobs
        for chunk in self.schedule.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

        if self.batches.packed:
            packs = self.batches.packs(batch)
            self.set_recompute(self._choose_recompute(max(p.size for p in packs),
                                                      max(p.max_seqlen for p in packs), len(packs)))

            def forward_step(data_iterator, model):
                pack = next(data_iterator)
                labels = torch.roll(pack.tokens.to(self.device), shifts=-1, dims=1)
                out = self.schedule.pack_forward(model, pack)

                def loss_func(output):
                    # the pack's log-probs cut back into its rows [k, W-1]: the loss sees the unpacked layout
                    logp = pack.unpack(token_logprobs(output, labels, temperature)[0])
                    loss, metrics = loss_fn(logp, pack.batch)
                    return loss, torch.tensor(1, dtype=torch.int), metrics

                return out, loss_func

            store = self.schedule.run(forward_step, packs, max(p.size for p in packs), 1, forward_only=False)
        else:
            micro, _ = self.batches.micro_batches(batch, mbs)
            widest = max(mb.tokens.shape[1] for mb in micro)
            self.set_recompute(self._choose_recompute(mbs * widest, widest, len(micro)))

            def forward_step(data_iterator, model):
                mb = next(data_iterator)
                tok = mb.tokens.to(self.device)
                labels = torch.roll(tok, shifts=-1, dims=1)
                out = model(tok, self.batches.position_ids(*tok.shape), None)

                def loss_func(output):
                    logp = token_logprobs(output, labels, temperature)[:, :-1]
                    loss, metrics = loss_fn(logp, mb)
                    return loss, torch.tensor(1, dtype=torch.int), metrics

                return out, loss_func

            store = self.schedule.run(forward_step, micro, T, mbs, forward_only=False)
        fault_point("train_step", self.step_count + 1)
        lr = self.lr_at(self.step_count)
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
        if self.info.is_last_stage:
            keys = sorted(store[0].keys()) if store else []
            values = torch.tensor(
                [sum(float(d[k]) for d in store) for k in keys], dtype=torch.float64, device=self.device
            )
            if self.info.dp_size > 1 and keys:
                dist.all_reduce(values, group=self.info.dp_group)
            payload = [dict(zip(keys, values.tolist()))]
        if self.info.pp_size > 1:
            dist.broadcast_object_list(
                payload,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        return dict(payload[0])


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
