"""megatron's schedule for the megatron-core actor: the model chunks and ``get_forward_backward_func()`` (1F1B with
PP > 1), eval mode for passes without backward, the broadcast of a result from the last pipeline stage, and the
model's forward on one packed micro-batch.

:class:`ScheduleRunner` is the schedule part of :class:`laconic_nemo.actors.megatron_core.MegatronCoreActor`; the
log-probs, the training step and the generation run the model through it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from laconic_nemo.actors.packing import Pack
from laconic_nemo.runtime.kernels import packed_seq_params


class ScheduleRunner:
    """Runs megatron's forward(-backward) schedule over this rank's model chunks.

    model: the list of model chunks (megatron DDP-wrapped GPTModels of this pipeline stage); info: this rank's
    layout (:class:`laconic_nemo.runtime.megatron_env.ParallelInfo`; its ``device``).
    """

    def __init__(self, model: list[Any], info: Any):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.model, self.info, self.device = model, info, info.device
        self.forward_backward = get_forward_backward_func()

    def run(self, forward_step: Callable, micro_batches: list, seq_length: int, micro_batch_size: int,
            forward_only: bool) -> list:
        """megatron's forward(-backward) schedule (1F1B with PP > 1) of ``forward_step`` over ``micro_batches``
        (each ``[micro_batch_size, <= seq_length]``); returns the loss functions' metric dicts (last stage)."""
        return self.forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    @contextlib.contextmanager
    def eval_mode(self):
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

    def pp_broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast ``tensor`` (any shape) from the last pipeline stage to every stage (in place)."""
        from megatron.core import parallel_state

        if self.info.pp_size > 1:
            dist.broadcast(
                tensor,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        return tensor

    def pack_forward(self, model: Any, pack: Pack) -> torch.Tensor:
        """``model`` (one chunk, as megatron's schedule hands it) on one packed micro-batch ``[1, S]``: logits
        [1, S, V/tp] on the last stage (hidden states before)."""
        tok = pack.tokens.to(self.device)
        pos = pack.position_ids.to(self.device)  # restart in every row: RoPE's per-token positions
        params = packed_seq_params(pack.cu_seqlens.to(self.device), pack.max_seqlen, position_ids=pos)
        return model(tok, pos, None, packed_seq_params=params)
