"""Prompt order and data-parallel sharding with groups kept whole.

Each step takes ``prompts_per_step`` prompt indices (GLOBAL, identical on every rank: the order is
a function of the seed and the step alone); the data-parallel rank ``r`` of ``D`` takes the
contiguous slice ``r*P/D .. (r+1)*P/D`` and samples all G responses of each of its prompts, so a
group never straddles ranks and no rank trains on another rank's samples.
"""

from __future__ import annotations

import torch


class PromptSampler:
    """Epoch-wise shuffled order over ``num_prompts`` items, resumable from a step number.

    The order of epoch e is ``randperm(num_prompts)`` under seed ``seed + e`` (or the identity
    when ``shuffle`` is False). Batches run across epoch boundaries, so no prompt repeats within an
    epoch and every batch has exactly ``prompts_per_step`` items.
    """

    def __init__(self, num_prompts: int, prompts_per_step: int, seed: int, shuffle: bool = True):
        if num_prompts < 1:
            raise ValueError("the prompt dataset is empty")
        if prompts_per_step < 1:
            raise ValueError(f"grpo.num_prompts_per_step = {prompts_per_step}: allowed >= 1")
        self.num_prompts, self.prompts_per_step = num_prompts, prompts_per_step
        self.seed, self.shuffle = seed, shuffle
        self._cache: dict[int, list[int]] = {}

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._cache:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._cache = {epoch: torch.randperm(self.num_prompts, generator=g).tolist()}
            else:
                self._cache = {epoch: list(range(self.num_prompts))}
        return self._cache[epoch]

    def batch(self, step: int) -> list[int]:
        """The global prompt indices of ``step`` (0-based)."""
        start = step * self.prompts_per_step
        out = []
        for pos in range(start, start + self.prompts_per_step):
            epoch, i = divmod(pos, self.num_prompts)
            out.append(self._epoch_order(epoch)[i])
        return out

    def epoch_of(self, step: int) -> int:
        return (step * self.prompts_per_step) // self.num_prompts


def shard_prompts(indices: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """This DP rank's contiguous share of the step's prompts (groups are formed after this)."""
    if len(indices) % dp_size:
        raise ValueError(
            f"grpo.num_prompts_per_step = {len(indices)} must be divisible by the data-parallel size {dp_size}"
        )
    per = len(indices) // dp_size
    return indices[dp_rank * per : (dp_rank + 1) * per]
