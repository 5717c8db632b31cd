"""Log-probs of the megatron-core actor: per-token log p from the TP-sharded logits through megatron's schedule,
over packed or padded micro-batches, under the policy or the reference policy pi_ref.

* Log-probs come from the TP-sharded logits through ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``
  (the full vocabulary is never gathered), with the vocabulary-padding columns masked out, so they are the exact
  log-softmax over the real vocabulary; in sequence chunks of ``logprob_chunk_size`` positions
  (:func:`chunked_token_logprobs`, which the NeMo-Aligner actor uses too).
* Micro-batches (:mod:`laconic_nemo.actors.megatron_batches`) are packed (``micro_batch_tokens`` > 0): rows
  concatenated into ``[1, S]`` sequences without padding, document-causal attention, positions restarting in every
  row (:mod:`laconic_nemo.actors.packing`), the log-probs cut back into rows; ``micro_batch_tokens = 0``:
  micro-batches of ``micro_batch_size`` right-padded rows.
* Reference log-probs: the reference weights swapped into the model for the pass
  (:mod:`laconic_nemo.actors.megatron_reference`).

:class:`Logprobs` is the log-probs part of :class:`laconic_nemo.actors.megatron_core.MegatronCoreActor`, given the
micro-batching, schedule and reference parts it runs with; the training step takes its :meth:`Logprobs.
token_logprobs` for the loss.
"""

from __future__ import annotations

from typing import Any

import torch

from laconic_nemo.actors.megatron_batches import MicroBatches
from laconic_nemo.actors.megatron_reference import ReferencePolicy
from laconic_nemo.actors.megatron_schedule import ScheduleRunner
from laconic_nemo.grpo.interfaces import TrainBatch


def chunked_token_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk: int, vocab_size: int, tp_rank: int,
                           temperature: float = 1.0) -> torch.Tensor:
    """log p(labels) [b, s] float32 at ``temperature`` (softmax of logits / temperature) from this rank's vocab shard
    of the logits [b, s, V/tp] (any float dtype; vocab-parallel cross entropy, columns at or past ``vocab_size``, the
    padding, excluded), without a float32 copy of the whole [b, s, V/tp] tensor.

    Computed in sequence chunks of ``chunk`` positions (``b x chunk`` tokens), so at most one chunk's float32 copy
    of the logits exists at a time; with autograd on, each chunk is recomputed in backward (activation
    checkpointing) instead of keeping its float32 softmax, and its gradient [b, chunk, V/tp] is written into one
    gradient of the logits' size (:class:`ChunkedLogprobs`), not added into it through a zero-filled tensor of the
    whole logits per chunk (the backward of a slice ``logits[:, a:a + chunk]``). Both actors take their log-probs
    here: the megatron-core actor over its GPTModel's logits, the NeMo-Aligner actor over the same GPTModel's
    (inside NeMo's ``MegatronGPTModel``)."""
    if logits.shape[1] <= chunk:
        return _chunk_logprobs(logits, labels, temperature, vocab_size, tp_rank)
    if torch.is_grad_enabled() and logits.requires_grad:
        return ChunkedLogprobs.apply(logits, labels, chunk, temperature, vocab_size, tp_rank)
    return _chunks_forward(logits, labels, chunk, temperature, vocab_size, tp_rank)


def _chunks_forward(logits: torch.Tensor, labels: torch.Tensor, chunk: int, temperature: float, vocab_size: int,
                    tp_rank: int) -> torch.Tensor:
    """log p(labels) [b, s] float32 chunk by chunk (``chunk`` positions at a time), without autograd's record."""
    out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
    for a in range(0, logits.shape[1], chunk):
        out[:, a : a + chunk] = _chunk_logprobs(logits[:, a : a + chunk], labels[:, a : a + chunk], temperature,
                                                vocab_size, tp_rank)
    return out


class ChunkedLogprobs(torch.autograd.Function):
    """The log-probs of :func:`chunked_token_logprobs` with autograd: forward chunk by chunk without keeping
    anything but the logits [b, s, V/tp] and labels [b, s]; backward recomputes one chunk at a time and writes its
    gradient into the logits' gradient (one tensor of the logits' shape and dtype, allocated once). The gradient is
    the one of the per-chunk checkpointed computation, element for element."""

    @staticmethod
    def forward(ctx, logits, labels, chunk, temperature, vocab_size, tp_rank):
        ctx.save_for_backward(logits, labels)
        ctx.settings = (int(chunk), float(temperature), int(vocab_size), int(tp_rank))
        return _chunks_forward(logits, labels, *ctx.settings)

    @staticmethod
    def backward(ctx, grad_out):
        logits, labels = ctx.saved_tensors
        chunk, temperature, vocab_size, tp_rank = ctx.settings
        grad = torch.empty_like(logits)
        for a in range(0, logits.shape[1], chunk):
            with torch.enable_grad():
                piece = logits[:, a : a + chunk].detach().requires_grad_(True)
                logp = _chunk_logprobs(piece, labels[:, a : a + chunk], temperature, vocab_size, tp_rank)
            (g,) = torch.autograd.grad(logp, piece, grad_out[:, a : a + chunk])
            grad[:, a : a + chunk] = g
            del g, logp, piece
        return grad, None, None, None, None, None


def _chunk_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_size: int,
                    tp_rank: int) -> torch.Tensor:
    from megatron.core import tensor_parallel

    logits32 = logits.float()
    if temperature != 1.0:
        logits32 = logits32 / float(temperature)
    part = logits32.shape[-1]
    start = tp_rank * part
    if start + part > vocab_size:
        ids = torch.arange(start, start + part, device=logits32.device)
        logits32 = logits32.masked_fill(ids >= vocab_size, torch.finfo(logits32.dtype).min)
    if logits32.data_ptr() == logits.data_ptr():
        # float32 logits at temperature 1, nothing masked: megatron's cross entropy subtracts the max and takes the
        # exp IN PLACE on its input (megatron/core/tensor_parallel/cross_entropy.py:45, 64-65 in megatron-core 0.11.0
        # and 0.16.1, :42, 61-62 in 0.19.2),
        # which would overwrite the model's logits (and the input a checkpointed chunk is recomputed from)
        logits32 = logits32.clone()
    return -tensor_parallel.vocab_parallel_cross_entropy(logits32, labels)


class Logprobs:
    """Per-token log-probs of the policy (:meth:`logprobs`) or of the reference policy, through megatron's schedule.

    logprob_chunk_size: positions per chunk of :func:`chunked_token_logprobs`; vocab_size: the real vocabulary V;
    info: this rank's layout (``tp_rank``, ``is_last_stage``, ``device``); batches: the micro-batching part;
    schedule: the schedule part; reference: the reference policy part.
    """

    def __init__(self, logprob_chunk_size: int, vocab_size: int, info: Any, batches: MicroBatches,
                 schedule: ScheduleRunner, reference: ReferencePolicy):
        self.logprob_chunk_size, self.vocab_size = int(logprob_chunk_size), int(vocab_size)
        self.info, self.tp_rank, self.device = info, info.tp_rank, info.device
        self.batches, self.schedule, self.reference = batches, schedule, reference

    def token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log p(labels) [b, s] float32 at ``temperature`` from this rank's vocab shard of the logits [b, s, V/tp]:
        :func:`chunked_token_logprobs` in chunks of ``logprob_chunk_size`` positions."""
        return chunked_token_logprobs(logits, labels, self.logprob_chunk_size, self.vocab_size, self.tp_rank,
                                      temperature)

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, reference: bool = False, micro_batch_size: int | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probs [N, T-1] of ``batch.tokens`` [N, T] (float32, CPU) at ``temperature``, identical on
        every TP/PP rank; under pi_ref with ``reference``. Position ``j`` is log p(token j+1 | tokens <= j); it is 0
        from each row's end on (j + 1 >= prompt + response length), where nothing is scored. Packed micro-batches
        of ``micro_batch_tokens`` (``micro_batch_size`` applies only without packing)."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if reference:
            with self.reference.swapped_in():
                return self.logprobs(batch, reference=False, micro_batch_size=micro_batch_size,
                                     temperature=temperature)
        n, T = batch.tokens.shape
        if T < 2:
            raise ValueError(f"tokens must have at least 2 positions, got T={T}")
        if self.batches.packed:
            result = self._packed_logprobs(batch, temperature)
        else:
            result = self._padded_logprobs(batch, micro_batch_size, temperature)
        ends = (batch.prompt_lengths + batch.response_lengths).unsqueeze(1)  # [N, 1]
        return result.masked_fill(torch.arange(1, T).unsqueeze(0) >= ends, 0.0)

    def _packed_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        """:meth:`logprobs` over packed micro-batches: [N, T-1] float32 CPU, before the past-the-end zeroing."""
        n, T = batch.tokens.shape
        packs = self.batches.packs(batch)

        def forward_step(data_iterator, model):
            pack = next(data_iterator)
            tok = pack.tokens.to(self.device)
            labels = torch.roll(tok, shifts=-1, dims=1)
            out = self.schedule.pack_forward(model, pack)

            def loss_func(output):
                logp = pack.unpack(self.token_logprobs(output, labels, temperature)[0])  # [k, W-1]
                return logp.sum() * 0.0, torch.tensor(1, dtype=torch.int), {"logprobs": logp.float()}

            return out, loss_func

        with self.schedule.eval_mode():
            store = self.schedule.run(forward_step, packs, max(p.size for p in packs), 1, forward_only=True)
        result = torch.zeros(n, T - 1, dtype=torch.float32, device=self.device)
        if self.info.is_last_stage:
            for d, pack in zip(store, packs):
                lp = d["logprobs"]
                result[pack.rows.to(self.device), : lp.shape[1]] = lp
        return self.schedule.pp_broadcast(result).cpu()

    def _padded_logprobs(self, batch: TrainBatch, micro_batch_size: int | None, temperature: float) -> torch.Tensor:
        """:meth:`logprobs` over micro-batches of right-padded rows (``micro_batch_tokens = 0``)."""
        n, T = batch.tokens.shape
        mbs = self.batches.rows_per_micro_batch(n, micro_batch_size)
        micro, rows = self.batches.micro_batches(batch, mbs)
        chunks = [mb.tokens for mb in micro]

        def forward_step(data_iterator, model):
            tok = next(data_iterator).to(self.device)
            labels = torch.roll(tok, shifts=-1, dims=1)
            out = model(tok, self.batches.position_ids(*tok.shape), None)

            def loss_func(output):
                logp = self.token_logprobs(output, labels, temperature)[:, :-1]
                return logp.sum() * 0.0, torch.tensor(1, dtype=torch.int), {"logprobs": logp.float()}

            return out, loss_func

        with self.schedule.eval_mode():
            store = self.schedule.run(forward_step, chunks, T, mbs, forward_only=True)
        if self.info.is_last_stage:
            result = torch.zeros(len(rows), T - 1, dtype=torch.float32, device=self.device)
            for d, r in zip(store, rows.split(mbs)):
                lp = d["logprobs"]
                result[r.to(self.device), : lp.shape[1]] = lp
            result = result[:n].contiguous()
        else:
            result = torch.empty(n, T - 1, dtype=torch.float32, device=self.device)
        return self.schedule.pp_broadcast(result).cpu()
