"""Packed micro-batches for the megatron-core actor: rows concatenated up to a token budget, no padding between them.

A rollout batch has rows of very different lengths (prompt ~200 tokens, responses 300..4096 in the paper's
runs). Padding rows to a common width wastes the padded positions' compute; packing puts several rows one
after another into a single ``[1, S]`` sequence and keeps them apart inside the model:

* attention is document-causal (a position sees the earlier positions of its own row only), through
  megatron-core's ``PackedSeqParams`` (``qkv_format="thd"``, ``cu_seqlens`` = row boundaries) and the core
  attention of :mod:`laconic_nemo.runtime.kernels`;
* positions restart at 0 in every row (RoPE is applied per row by megatron from ``cu_seqlens``; the per-row
  position ids are passed too, for position embeddings that read them);
* the log-probs of a pack are cut back into rows (:meth:`Pack.unpack`), so the loss sees the same
  ``[n, T-1]`` layout and global normalisation as the unpacked path.

Packing: first-fit decreasing (rows by length, longest first; each into the first pack it fits in). A row longer
than the budget forms a pack of its own. With pipeline parallelism every micro-batch of one schedule must have
the same shape (megatron's p2p buffers are sized once per schedule), so there every pack is padded at its tail
to the longest pack of the call; the padded tail is a row of its own in ``cu_seqlens`` (it attends only to
itself) and is never scored.

Shapes: a batch of n rows of padded width T; a pack of k rows and S positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laconic_nemo.grpo.interfaces import TrainBatch


def cut_positions(batch: TrainBatch, T: int) -> TrainBatch:
    """``batch`` restricted to its first ``T`` positions (tokens ``[n, T]``, per-token fields ``[n, T-1]``)."""
    batch.tokens = batch.tokens[:, :T]
    for name in ("response_mask", "old_logprobs", "ref_logprobs"):
        t = getattr(batch, name)
        if t is not None:
            setattr(batch, name, t[:, : T - 1])
    return batch


def row_lengths(batch: TrainBatch) -> torch.Tensor:
    """Tokens of each row that the model reads: prompt + response, clamped to [2, T] ([n] int64)."""
    return (batch.prompt_lengths + batch.response_lengths).clamp(min=2, max=batch.tokens.shape[1]).long()


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices of each pack: rows by decreasing length (ties by index), each into the first pack whose
    total stays <= ``budget``; a row longer than ``budget`` gets a pack of its own. Rows inside a pack keep the
    order they were placed in. Deterministic."""
    if budget < 1:
        raise ValueError(f"grpo.micro_batch_tokens must be >= 1 to pack, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    used: list[int] = []
    for i in order:
        n = lengths[i]
        for j, u in enumerate(used):
            if u + n <= budget:
                packs[j].append(i)
                used[j] += n
                break
        else:
            packs.append([i])
            used.append(n)
    return packs


@dataclass
class Pack:
    """One packed micro-batch.

    rows: [k] indices of its rows in the batch (pack order); lengths: [k] tokens of each row in the pack;
    tokens: [1, S] the rows back to back (then the padded tail, if any); position_ids: [1, S] restarting at 0
    in every row; cu_seqlens: [k + 1] (or [k + 2] with a padded tail) int32 boundaries; max_seqlen: the longest
    segment; batch: the pack's rows of the batch cut to their longest row (what the loss sees).
    """

    rows: torch.Tensor
    lengths: torch.Tensor
    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    batch: TrainBatch

    @property
    def size(self) -> int:
        """S: positions of the packed micro-batch (tail padding included)."""
        return int(self.tokens.shape[1])

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values of the pack [S] (position p scores the token at p + 1) -> per-row values
        [k, W-1] (W = longest row of the pack; position j of row r scores its token j + 1), 0 from each row's
        end on. Differentiable (a gather)."""
        if values.dim() != 1 or values.shape[0] != self.size:
            raise ValueError(f"unpack expects [{self.size}] values, got {tuple(values.shape)}")
        W = int(self.lengths.max())
        lengths = self.lengths.to(values.device)
        offsets = (torch.cumsum(lengths, 0) - lengths).unsqueeze(1)  # [k, 1]
        j = torch.arange(W - 1, device=values.device).unsqueeze(0)  # [1, W-1]
        valid = j < (lengths.unsqueeze(1) - 1)  # position j of the row scores a token of the same row
        idx = torch.where(valid, offsets + j, torch.zeros_like(j))
        return torch.where(valid, values[idx], torch.zeros((), dtype=values.dtype, device=values.device))


def build_packs(batch: TrainBatch, budget: int, pad_to_longest: bool = False, pad_id: int = 0) -> list[Pack]:
    """Pack the rows of ``batch`` into micro-batches of at most ``budget`` tokens (a longer row: alone).

    pad_to_longest: pad every pack at its tail to the longest pack (fixed shapes for pipeline parallelism);
    the tail is filled with ``pad_id`` and is a segment of its own. Returns the packs in packing order."""
    lengths = row_lengths(batch)
    groups = first_fit_decreasing(lengths.tolist(), budget)
    size = max(int(lengths[g].sum()) for g in groups) if pad_to_longest else 0
    packs = []
    for g in groups:
        rows = torch.tensor(g, dtype=torch.long)
        lens = lengths[rows]
        parts = [batch.tokens[r, : int(n)] for r, n in zip(g, lens.tolist())]
        pos = [torch.arange(int(n)) for n in lens.tolist()]
        segs = lens.tolist()
        tail = size - int(lens.sum())
        if tail > 0:
            parts.append(torch.full((tail,), int(pad_id), dtype=batch.tokens.dtype))
            pos.append(torch.arange(tail))
            segs.append(tail)
        cu = torch.zeros(len(segs) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(segs), 0)
        packs.append(Pack(
            rows=rows, lengths=lens, tokens=torch.cat(parts).unsqueeze(0), position_ids=torch.cat(pos).unsqueeze(0),
            cu_seqlens=cu, max_seqlen=max(segs), batch=cut_positions(batch.select(rows), int(lens.max())),
        ))
    return packs

