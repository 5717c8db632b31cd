"""The decode engine's static KV cache: one allocation, written in place, sized before it is allocated.

Layout: one tensor ``[layers, 2, rows, positions, groups, head_dim]`` (``2``: keys, values; ``layers``: the
layers of this rank's pipeline stage; ``groups``: this rank's key-value heads, ``num_query_groups / TP``) in
the model's dtype, zero-filled once (masked positions are multiplied by an attention weight of exactly 0,
which must not meet a NaN of uninitialised memory). A decode step writes its keys and values at
``(row, position)`` pairs with one ``index_put_`` for keys and values together (no ``torch.cat``, no
allocation); attention reads
``[:rows_in_bucket, :kv_length]`` views of it. Finished rows are dropped by moving the live rows down
(:meth:`StaticKVCache.move_rows`), in place.

:class:`KVCacheShape` is the arithmetic (bytes, a printable description) that ``laconic-nemo plan`` and the
engine share; :func:`check_fits` refuses a shape larger than its memory budget, naming the config key,
before anything is allocated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

FRACTION_KEY = "rollout.kv_cache_memory_fraction"


class KVCacheTooLarge(ValueError):
    """The KV cache a rollout needs does not fit its memory budget; the message names the keys that size it."""


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheShape:
    """Shape of one rank's KV cache: keys and values for ``layers`` layers, ``rows`` sequences,
    ``positions`` token positions (prompt + response), ``groups`` key-value heads of ``head_dim``."""

    layers: int
    rows: int
    positions: int
    groups: int
    head_dim: int
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return 2 * self.layers * self.rows * self.positions * self.groups * self.head_dim

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token of one row takes over this rank's layers (keys + values)."""
        return 2 * self.layers * self.groups * self.head_dim * dtype_bytes(self.dtype)

    def covers(self, rows: int, positions: int) -> bool:
        return rows <= self.rows and positions <= self.positions

    def describe(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (f"[{self.layers} layers x 2 x {self.rows} rows x {self.positions} positions x {self.groups} kv heads "
                f"x {self.head_dim}] {dt} = {self.nbytes / 2**30:.2f} GiB")


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device``: the GPU's, or the host's physical RAM for a CPU device."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_fits(shape: KVCacheShape, fraction: float, total_bytes: int, sized_by: str) -> None:
    """Raise :class:`KVCacheTooLarge` when ``shape`` needs more than ``fraction`` of ``total_bytes``.

    sized_by: the keys (and values) that gave the shape, quoted in the message."""
    budget = float(fraction) * float(total_bytes)
    if shape.nbytes > budget:
        raise KVCacheTooLarge(
            f"KV cache {shape.describe()} exceeds {FRACTION_KEY} = {fraction:g} of {total_bytes / 2**30:.1f} GiB "
            f"({budget / 2**30:.2f} GiB); it is sized by {sized_by}: lower them or raise {FRACTION_KEY} "
            "(allowed (0, 1])")


class StaticKVCache:
    """The allocated cache of :class:`KVCacheShape` ``shape`` on ``device`` (see the module docstring)."""

    def __init__(self, shape: KVCacheShape, device: torch.device | str):
        self.shape = shape
        s = shape
        self.data = torch.zeros(s.layers, 2, s.rows, s.positions, s.groups, s.head_dim, dtype=s.dtype,
                                device=device)

    def keys(self, layer: int) -> torch.Tensor:
        """Keys of layer ``layer`` (of this stage): a view ``[rows, positions, groups, head_dim]``."""
        return self.data[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]

    def write(self, layer: int, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys / values ``[n, groups, head_dim]`` of one token per row, row ``rows[i]`` at position ``pos[i]``
        (rows, pos: long ``[n]`` on the cache's device). In place; no host synchronisation."""
        self.data[layer, 0].index_put_((rows, pos), k)
        self.data[layer, 1].index_put_((rows, pos), v)

    def write_kv(self, layer: int, rows: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor) -> None:
        """Keys and values ``kv`` [2, n, groups, head_dim] (any strides) of one token per row, row ``rows[i]`` at
        position ``pos[i]``: one ``index_put_`` for both (the fused decode step)."""
        torch.ops.aten.index_put_(self.data[layer], [None, rows, pos], kv)

    def write_prefix(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys / values ``[n, s, groups, head_dim]`` of positions ``[0, s)`` of rows ``rows`` (long ``[n]``)."""
        s = k.shape[1]
        self.data[layer, 0, :, :s].index_copy_(0, rows, k)
        self.data[layer, 1, :, :s].index_copy_(0, rows, v)

    def move_rows(self, sources: list[int], upto: int) -> None:
        """Row ``sources[j]`` -> row ``j`` for every j (positions ``[0, upto)`` of every layer), in place.

        ``sources`` must be increasing (the live rows in their current order), so ``sources[j] >= j`` and no
        row is overwritten before it has been moved."""
        prev = -1
        for j, src in enumerate(sources):
            if src <= prev or src < j:
                raise ValueError(f"move_rows needs increasing sources, got {sources}")
            prev = src
            if src != j:
                self.data[:, :, j, :upto].copy_(self.data[:, :, src, :upto])
