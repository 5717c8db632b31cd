"""What a piece of eager PyTorch allocates on the host: every CPU allocation and free in order, from the profiler's
memory events (``torch.profiler.profile(profile_memory=True)``: one ``[memory]`` event per allocation, positive
``nbytes``, and per free, negative), so the peak and the large allocations of a CPU computation are counted
exactly, independent of the machine's speed or load (torch has no peak counter for its CPU allocator).

    with host_allocations() as trace:
        loss.backward()
    trace.peak_bytes, trace.count_at_least(logits.nbytes)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator


@dataclass
class AllocationTrace:
    """The host allocations of a traced block, in order: ``changes`` holds each allocation's size (> 0) and each
    free's (< 0), in bytes; a block freed inside counts in ``peak_bytes`` while it lived."""

    changes: list[int] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """The most bytes the block held at once beyond what was allocated before it (>= 0)."""
        live = peak = 0
        for n in self.changes:
            live += n
            peak = max(peak, live)
        return peak

    def count_at_least(self, nbytes: int) -> int:
        """Allocations of at least ``nbytes`` bytes."""
        return sum(1 for n in self.changes if n >= nbytes)


@contextlib.contextmanager
def host_allocations() -> Iterator[AllocationTrace]:
    """Trace the CPU allocations and frees made inside the block (on every thread of this process); the
    :class:`AllocationTrace` is filled when the block ends."""
    from torch.profiler import ProfilerActivity, profile

    trace = AllocationTrace()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield trace
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type().name == "CPU"]
    events.sort(key=lambda e: e.start_ns())
    trace.changes.extend(int(e.nbytes()) for e in events)
