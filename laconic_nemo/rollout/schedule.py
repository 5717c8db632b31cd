"""The decode engine's window schedule: at which batch bucket and KV length each window of ``rollout.sync_every``
decode steps runs, and when the live rows move down into a smaller bucket. A pure function of the rows' prompt
lengths and of when they finish, shared by the engine (:meth:`~laconic_nemo.rollout.engine.DecodeEngine.generate`
asks :class:`WindowPlan` before every window and after every host synchronisation) and by the estimates that do not
run a model: :func:`simulate` replays a rollout whose response lengths are known (the benchmark's DeepSeek-shaped
draw, ``laconic-nemo plan``), counting the CUDA graphs it captures and the key / value positions its attention reads.

Why the number of captures is bounded: a graph is captured once per (bucket, KV length) key. Within a pass the
bucket never grows (rows only leave) and the KV length never shrinks (:class:`WindowPlan` keeps it monotone), so the
keys of a pass form a staircase: at most ``buckets visited + KV lengths visited - 1`` distinct keys, i.e. at most
:func:`captures_per_pass`. Across rollouts the graphs are kept, so a run captures at most :func:`captures_in_all`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from laconic_nemo.rollout.graphs import bucket_for, kv_length


def fine_buckets(top: int = 512, step: int = 16, first: int = 8) -> tuple[int, ...]:
    """``first``, then every multiple of ``step`` up to ``top``: (8, 16, 32, 48, ..., 512) by default, so that a batch
    of 48 rows runs as 48 and at most ``step - 1`` rows of a bucket are padding."""
    if not 1 <= first <= step <= top:
        raise ValueError(f"need 1 <= first ({first}) <= step ({step}) <= top ({top})")
    return tuple(sorted({first, *range(step, top + 1, step)}))


def buckets_up_to(rows: int, buckets: Sequence[int]) -> list[int]:
    """The bucket sizes a pass of ``rows`` rows can run at: the buckets below ``rows`` and the one it starts in."""
    start = bucket_for(rows, buckets, rows)
    return [b for b in buckets if b < start] + [start]


def captures_per_pass(rows: int, positions: int, buckets: Sequence[int], kv_block: int) -> int:
    """Most CUDA graphs one pass of ``rows`` rows over a cache of ``positions`` positions captures (module
    docstring): buckets it can visit + KV lengths it can visit - 1."""
    kv_lengths = -(-positions // kv_block)
    return len(buckets_up_to(rows, buckets)) + kv_lengths - 1


def captures_in_all(rows: int, positions: int, buckets: Sequence[int], kv_block: int) -> int:
    """Most CUDA graphs an engine keeps for one set of sampling settings: every (bucket, KV length) pair."""
    return len(buckets_up_to(rows, buckets)) * -(-positions // kv_block)


@dataclass(frozen=True)
class Move:
    """A compaction: the live slots ``alive`` (increasing) go to slots ``[0, len(alive))``, the pass continues in
    bucket ``new``; key / value positions ``[0, upto)`` of the moved rows are copied."""

    alive: list[int]
    old: int
    new: int
    upto: int


class WindowPlan:
    """The schedule of one pass (see the module docstring).

    prompt_lens: the prompt length of each sample of the pass; rows: the cache's rows (the largest bucket);
    positions: the cache's positions; max_new: L_max (the first token comes from the prefill, so a pass has at
    most ``max_new - 1`` decode steps)."""

    def __init__(self, prompt_lens: Sequence[int], rows: int, positions: int, max_new: int, buckets: Sequence[int],
                 kv_block: int, sync_every: int, compact: bool):
        self.P = [int(p) for p in prompt_lens]
        n = len(self.P)
        self.positions, self.max_new = int(positions), int(max_new)
        self.buckets, self.rows, self.kv_block = tuple(buckets), int(rows), int(kv_block)
        self.sync_every, self.compact = int(sync_every), bool(compact)
        self.b = bucket_for(n, self.buckets, self.rows)
        self.slot_ids = list(range(n)) + [-1] * (self.b - n)  # sample of each slot; -1: empty
        self.t = 0  # decode steps done; every live row has generated t + 1 tokens
        self.kv = 0

    def window(self) -> tuple[int, int, int] | None:
        """(bucket, KV length, steps) of the next window, or None when the pass has run ``max_new - 1`` steps."""
        if self.t >= self.max_new - 1:
            return None
        steps = min(self.sync_every, self.max_new - 1 - self.t)
        reach = max(self.P[i] for i in self.slot_ids if i >= 0) + self.t + steps
        self.kv = max(self.kv, kv_length(reach, self.kv_block, self.positions))  # monotone: bounds the captures
        return self.b, self.kv, steps

    def ran(self, steps: int) -> None:
        self.t += int(steps)

    def sync(self, alive: list[int]) -> Move | None:
        """After a host synchronisation: ``alive`` the live slots (increasing, not empty). The compaction to run,
        if the live rows fit a smaller bucket (and ``compact``); the plan then continues in that bucket."""
        if not self.compact:
            return None
        nb = bucket_for(len(alive), self.buckets, self.rows)
        if nb >= self.b:
            return None
        upto = min(max(self.P[self.slot_ids[j]] for j in alive) + self.t + 1, self.positions)
        move = Move(list(alive), self.b, nb, upto)
        self.slot_ids = [self.slot_ids[j] for j in alive] + [-1] * (nb - len(alive))
        self.b = nb
        return move


@dataclass
class Simulated:
    """What :func:`simulate` counted over a rollout (positions: key / value positions of one row and layer)."""

    windows: list = field(default_factory=list)  # (bucket, KV length, steps), as EngineStats.windows
    passes: int = 0
    compactions: int = 0
    decode_steps: int = 0
    captures: int = 0                 # distinct (bucket, KV length) keys: graphs captured from an empty engine
    pass_keys: list = field(default_factory=list)  # distinct keys of each pass
    row_steps: int = 0                # sum of the bucket over the decode steps (rows computed)
    live_row_steps: int = 0           # of which rows still generating
    kv_read: int = 0                  # positions attention reads: bucket x KV length per step
    kv_needed: int = 0                # positions the live rows hold (what per-row lengths, seqused_k, would read)
    moved: int = 0                    # positions copied by compactions (rows x upto)


def simulate(prompt_lens: Sequence[int], response_lens: Sequence[int], rows: int | None, positions: int,
             max_new: int, buckets: Sequence[int], kv_block: int, sync_every: int, compact: bool = True) -> Simulated:
    """Replay the engine's schedule (``device`` sampler: the host learns who finished at each synchronisation) for
    samples whose response lengths are known (tokens generated, EOS included, 1..max_new).

    rows: the cache's rows (None: every sample in one pass). A sample of response length r generates its first
    token in the prefill and is live in decode steps 1..r-1, in step k holding ``prompt + k`` positions."""
    n = len(prompt_lens)
    if len(response_lens) != n or not n:
        raise ValueError("prompt_lens and response_lens must be non-empty and of the same length")
    R = n if rows is None else min(int(rows), n)
    out, keys = Simulated(), set()
    for a in range(0, n, R):
        P, r = list(prompt_lens[a : a + R]), [int(x) for x in response_lens[a : a + R]]
        plan = WindowPlan(P, R, positions, max_new, buckets, kv_block, sync_every, compact)
        out.passes += 1
        mine: set = set()
        live = [i for i in range(len(P)) if r[i] > 1]
        while live:
            w = plan.window()
            if w is None:
                break
            b, kv, steps = w
            mine.add((b, kv))
            out.windows.append(w)
            for k in range(plan.t + 1, plan.t + steps + 1):  # decode step k of the pass
                now = [i for i in range(len(P)) if k < r[i]]
                out.row_steps += b
                out.live_row_steps += len(now)
                out.kv_read += b * kv
                out.kv_needed += sum(P[i] + k for i in now)
            out.decode_steps += steps
            plan.ran(steps)
            live = {i for i in range(len(P)) if plan.t + 1 < r[i]}
            if not live:
                break
            alive = [j for j, i in enumerate(plan.slot_ids) if i in live]
            move = plan.sync(alive)
            if move is not None:
                out.compactions += 1
                out.moved += sum(move.upto for j, src in enumerate(move.alive) if src != j)
        out.pass_keys.append(len(mine))
        keys |= mine
    out.captures = len(keys)
    return out
