"""Micro-batches of the megatron-core actor: how a batch of rows is cut for megatron's schedule.

* Packed (``micro_batch_tokens`` > 0, the default): rows concatenated into ``[1, S]`` sequences of at most
  ``micro_batch_tokens`` tokens without padding (:mod:`laconic_nemo.actors.packing`); with PP > 1 every pack is
  padded at its tail to the longest one (the pipeline's p2p shapes are fixed per schedule).
* Padded (``micro_batch_tokens = 0``): micro-batches of ``micro_batch_size`` right-padded rows, grouped by length
  and cut to their longest row with ``sort_by_length`` (PP = 1 only).

:class:`MicroBatches` is the micro-batching part of :class:`laconic_nemo.actors.megatron_core.MegatronCoreActor`;
the log-probs (:mod:`laconic_nemo.actors.megatron_logprobs`) and the training step
(:mod:`laconic_nemo.actors.megatron_step`) run their schedules over its micro-batches.
"""

from __future__ import annotations

import torch

from laconic_nemo.actors.packing import Pack, build_packs, cut_positions
from laconic_nemo.grpo.interfaces import TrainBatch


def pad_rows(batch: TrainBatch, mbs: int) -> TrainBatch:
    """``batch`` of n rows padded to a multiple of ``mbs`` rows (copies of row 0 with an empty response mask and
    zero advantage) so every micro-batch has the same shape (pipeline p2p shapes are fixed)."""
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


class MicroBatches:
    """The micro-batches of one schedule (see the module docstring).

    micro_batch_size: rows of a padded micro-batch (the default of a call that names none); micro_batch_tokens:
    token budget of a pack (0: padded micro-batches); sort_by_length: padded rows grouped by length; pp_size:
    pipeline stages (> 1: one micro-batch shape per schedule); pad_id: the id filling a pack's padded tail (None:
    0); device: where position ids are built.
    """

    def __init__(self, micro_batch_size: int, micro_batch_tokens: int, sort_by_length: bool, pp_size: int,
                 pad_id: int | None, device: torch.device):
        self.micro_batch_size, self.micro_batch_tokens = int(micro_batch_size), int(micro_batch_tokens)
        self.sort_by_length, self.pp_size = bool(sort_by_length), int(pp_size)
        self.pad_id = None if pad_id is None else int(pad_id)
        self.device = device

    @property
    def packed(self) -> bool:
        """Whether schedules run over packs (``micro_batch_tokens`` > 0) rather than padded rows."""
        return self.micro_batch_tokens > 0

    def rows_per_micro_batch(self, n: int, micro_batch_size: int | None = None) -> int:
        """Rows of a padded micro-batch for a batch of ``n`` rows: ``micro_batch_size`` (None: the default)
        capped at ``n``."""
        return min(micro_batch_size or self.micro_batch_size, n)

    def micro_batches(self, batch: TrainBatch, mbs: int) -> tuple[list[TrainBatch], torch.Tensor]:
        """Split ``batch`` (padded to a multiple of ``mbs`` rows) into micro-batches of ``mbs`` rows.

        With ``sort_by_length`` and PP = 1, rows are grouped by length (longest first) and each micro-batch
        is cut to its longest row (prompt + response), so short rows are not padded to the batch's longest;
        PP > 1 keeps one shape ``[mbs, T]`` (the pipeline's p2p buffers are sized once). Returns the
        micro-batches and the row order ``[n_padded]`` (micro-batch ``j`` holds rows
        ``order[j*mbs:(j+1)*mbs]``). Per-row results do not depend on the grouping: positions past a row's
        end are masked out of every loss."""
        padded = pad_rows(batch, mbs)
        n = len(padded)
        if not self.sort_by_length or self.pp_size > 1:
            order = torch.arange(n)
            return [padded.select(slice(i, i + mbs)) for i in range(0, n, mbs)], order
        ends = (padded.prompt_lengths + padded.response_lengths).clamp(min=2, max=padded.tokens.shape[1])
        order = torch.argsort(ends, descending=True, stable=True)
        micro = []
        for i in range(0, n, mbs):
            idx = order[i : i + mbs]
            micro.append(cut_positions(padded.select(idx), int(ends[idx].max())))
        return micro, order

    def packs(self, batch: TrainBatch) -> list[Pack]:
        """``batch`` packed into micro-batches of at most ``micro_batch_tokens`` tokens (a longer row: alone);
        with PP > 1 every pack is padded at its tail to the longest one (fixed p2p shapes)."""
        return build_packs(batch, self.micro_batch_tokens, pad_to_longest=self.pp_size > 1,
                           pad_id=self.pad_id or 0)

    def position_ids(self, b: int, s: int, start: int = 0) -> torch.Tensor:
        """Positions ``start .. start + s - 1`` of ``b`` padded rows: LongTensor [b, s] on the device."""
        return torch.arange(start, start + s, device=self.device).unsqueeze(0).expand(b, s)
