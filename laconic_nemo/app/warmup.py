"""Supervised warm-up: fit the initial policy on worked solutions before RL (tiny CPU demo).

The same actor, parallel layout and ``train_step`` as RL, with a masked next-token NLL on the
response tokens (EOS included) instead of the GRPO loss.
"""

from __future__ import annotations

import random
import time
from typing import Callable

import torch

from laconic_nemo.faults import fault_point, heartbeat
from laconic_nemo.grpo.interfaces import PolicyActor, TrainBatch, response_mask
from laconic_nemo.grpo.loss import make_sft_loss_fn
from laconic_nemo.grpo.trainer import allreduce_sum


def pack(examples: list[tuple[list[int], list[int]]], pad_id: int) -> TrainBatch:
    """(prompt ids, response ids incl. EOS) pairs -> right-padded TrainBatch with its response mask."""
    seqs = [p + r for p, r in examples]
    T = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    pl = torch.tensor([len(p) for p, _ in examples])
    rl = torch.tensor([len(r) for _, r in examples])
    return TrainBatch(tokens=tokens, prompt_lengths=pl, response_lengths=rl, response_mask=response_mask(pl, rl, T))


def supervised_warmup(
    actor: PolicyActor,
    make_example: Callable[[random.Random], tuple[list[int], list[int]]],
    num_steps: int,
    batch_size: int,
    micro_batch_size: int,
    seed: int,
    pad_id: int,
    log: Callable[[str], None] = print,
    log_every: int = 50,
    start_step: int = 0,
    should_stop: Callable[[], bool] | None = None,
) -> list[float]:
    """``num_steps`` optimiser steps on fresh examples; ``batch_size`` is global (split over DP).

    Every DP rank draws the same global batch from ``Random(seed + step)`` and keeps its slice, so
    the data do not depend on the layout. Returns the loss of each step."""
    if batch_size % actor.dp_size:
        raise ValueError(f"warmup.batch_size = {batch_size} must be divisible by DP = {actor.dp_size}")
    per = batch_size // actor.dp_size
    losses = []
    t0 = time.perf_counter()
    for step in range(start_step, num_steps):
        if should_stop is not None and should_stop():
            break
        heartbeat("warmup", step + 1)
        fault_point("warmup_step", step + 1)
        rng = random.Random(seed * 7919 + step)
        examples = [make_example(rng) for _ in range(batch_size)]
        mine = pack(examples[actor.dp_rank * per : (actor.dp_rank + 1) * per], pad_id)
        n_tok = float(allreduce_sum([float(mine.response_mask.sum())], group=actor.dp_group)[0])
        out = actor.train_step(mine, make_sft_loss_fn(global_num_tokens=n_tok), micro_batch_size)
        losses.append(float(out.get("loss", float("nan"))))
        if (step + 1) % log_every == 0 or step + 1 == num_steps:
            log(f"warmup {step + 1:>5}/{num_steps} | nll/token {losses[-1]:.4f} | {time.perf_counter() - t0:.1f}s")
    return losses
