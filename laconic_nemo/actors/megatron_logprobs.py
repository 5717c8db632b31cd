"""Log-probs of the megatron-core actor: per-token log p from the TP-sharded logits through megatron's schedule,
over packed or padded micro-batches, and the reference policy pi_ref they are also taken under.

* Log-probs come from the TP-sharded logits through ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``
  (the full vocabulary is never gathered), with the vocabulary-padding columns masked out, so they are the exact
  log-softmax over the real vocabulary; in sequence chunks of ``logprob_chunk_size`` positions.
* Micro-batches are packed (``micro_batch_tokens`` > 0): rows concatenated into ``[1, S]`` sequences without
  padding, document-causal attention, positions restarting in every row (:mod:`laconic_nemo.actors.packing`), the
  log-probs cut back into rows; ``micro_batch_tokens = 0``: micro-batches of ``micro_batch_size`` right-padded rows.
* Reference policy (``grpo.kl_beta > 0``): a frozen copy of the initial weights where ``grpo.reference_on`` puts it,
  swapped into the model for reference log-probs.

:class:`LogprobsMixin` is a part of :class:`laconic_nemo.actors.megatron_core.MegatronCoreActor`; it reads the
actor's ``model``, ``info``, ``device``, ``vocab_size`` and settings.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from laconic_nemo.actors.packing import Pack, build_packs, cut_positions
from laconic_nemo.grpo.interfaces import TrainBatch
from laconic_nemo.runtime.kernels import packed_seq_params


def chunked_token_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk: int, vocab_size: int, tp_rank: int,
                           temperature: float = 1.0) -> torch.Tensor:
    """log p(labels) [b, s] float32 at ``temperature`` (softmax of logits / temperature) from this rank's vocab shard
    of the logits [b, s, V/tp] (any float dtype; vocab-parallel cross entropy, columns at or past ``vocab_size``, the
    padding, excluded), without a float32 copy of the whole [b, s, V/tp] tensor.

    Computed in sequence chunks of ``chunk`` positions (``b x chunk`` tokens), so at most one chunk's float32 copy
    of the logits exists at a time; with autograd on, each chunk is recomputed in backward (activation
    checkpointing) instead of keeping its float32 softmax. Both actors take their log-probs here: the megatron-core
    actor over its GPTModel's logits, the NeMo-Aligner actor over the same GPTModel's (inside NeMo's
    ``MegatronGPTModel``)."""
    s = logits.shape[1]
    if s <= chunk:
        return _chunk_logprobs(logits, labels, temperature, vocab_size, tp_rank)
    parts = []
    for a in range(0, s, chunk):
        lg, lb = logits[:, a : a + chunk], labels[:, a : a + chunk]
        if torch.is_grad_enabled() and lg.requires_grad:
            parts.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, lg, lb, temperature, vocab_size, tp_rank,
                                                           use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(lg, lb, temperature, vocab_size, tp_rank))
    return torch.cat(parts, dim=1)


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
        # exp IN PLACE on its input (megatron/core/tensor_parallel/cross_entropy.py:44, 65-66, megatron-core 0.11),
        # which would overwrite the model's logits (and the input a checkpointed chunk is recomputed from)
        logits32 = logits32.clone()
    return -tensor_parallel.vocab_parallel_cross_entropy(logits32, labels)


class LogprobsMixin:
    """Per-token log-probs (:meth:`logprobs`), the micro-batches and megatron schedule they run through, and the
    reference policy."""

    def token_logprobs(self, logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log p(labels) [b, s] float32 at ``temperature`` from this rank's vocab shard of the logits [b, s, V/tp]:
        :func:`chunked_token_logprobs` in chunks of ``logprob_chunk_size`` positions."""
        return chunked_token_logprobs(logits, labels, self.logprob_chunk_size, self.vocab_size, self.tp_rank,
                                      temperature)

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
        pos = pack.position_ids.to(self.device)  # restart in every row: RoPE's per-token positions
        params = packed_seq_params(pack.cu_seqlens.to(self.device), pack.max_seqlen, position_ids=pos)
        return model(tok, pos, None, packed_seq_params=params)

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
