"""The training sections of ``gpu_step.py``: one GRPO optimiser step at the paper's shapes (packed and padded
micro-batches), the activation memory the memory model predicts per micro-batch, the padding share and the
reference-policy placements (``gpu_step.py``'s docstring says what each measures)."""

from __future__ import annotations

import time

import torch
from gpu_common import sync


def train_batch(arch, n: int, prompt_len: int, max_resp: int, seed: int = 0):
    """A GRPO minibatch: n rows, prompts of ``prompt_len`` tokens, responses of 300..max_resp tokens (uniform),
    right-padded to the longest; random tokens, advantages and old log-probs."""
    from laconic_nemo.grpo.interfaces import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lo = min(300, max_resp // 6)
    resp = torch.randint(lo, max_resp + 1, (n,), generator=g)
    resp[0] = max_resp
    T = prompt_len + max_resp
    tokens = torch.randint(0, arch.vocab_size, (n, T), generator=g)
    mask = torch.zeros(n, T - 1)
    for i in range(n):
        mask[i, prompt_len - 1 : prompt_len - 1 + int(resp[i])] = 1.0
        tokens[i, prompt_len + int(resp[i]) :] = 0
    old = -5.0 * mask
    return TrainBatch(tokens, torch.full((n,), prompt_len), resp, mask, advantages=torch.randn(n, generator=g),
                      old_logprobs=old)


def time_train(actor, batch, device, steps: int) -> dict:
    from laconic_nemo.grpo.loss import make_grpo_loss_fn

    fn = make_grpo_loss_fn(0.2, 0.28, 0.0, "token_mean", float(batch.response_mask.sum()), float(len(batch)))
    actor.train_step(batch, fn)  # warm-up (allocations, kernels)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        actor.train_step(batch, fn)
    sync(device)
    dt = (time.perf_counter() - t) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"s_per_step": dt, "peak_gib": peak}


def reference_placements(actor, arch, prompt_len: int, max_resp: int, device, add) -> None:
    """Reference log-probs (``grpo.kl_beta > 0``) with pi_ref's weights on the device (swapped by pointer),
    in pinned host memory (async copies) and in pageable host memory: seconds per pass over 8 rows, and the
    largest difference to the device placement (0: the same weights, the same computation)."""
    batch = train_batch(arch, 8, prompt_len, max_resp // 2, seed=3)
    placements = ("device", "pinned", "cpu") if device.type == "cuda" else ("device", "cpu")
    first = None
    for where in placements:
        actor.reference_on = where
        actor.reset_reference()
        actor.logprobs(batch, reference=True)  # warm-up
        sync(device)
        t = time.perf_counter()
        lp = actor.logprobs(batch, reference=True)
        sync(device)
        dt = time.perf_counter() - t
        first = lp if first is None else first
        add("reference", f"pi_ref weights on {where}", f"{dt:.2f} s per pass (8 rows)",
            f"max |diff| to {placements[0]} {float((lp - first).abs().max()):.1e}", "-")
    actor.reference.state = None


def packed_padding_share(actor, batch) -> float:
    """Share of the processed positions that are padding with the actor's packed micro-batches (tails padded
    to one size under pipeline parallelism only)."""
    packs = actor.batches.packs(batch)
    return 1.0 - sum(p.real_tokens for p in packs) / sum(p.size for p in packs)


def micro_batch_memory(actor, batch, packed: bool, device) -> tuple[str, list[float]]:
    """The memory model's line for the largest micro-batch of ``batch`` (activations, static, the recompute that
    fits the device; on CPU an H100 80 GB) and its predicted peaks by number of recomputed layers."""
    from laconic_nemo.actors import memory

    if packed:
        packs = actor.batches.packs(batch)
        tokens, seq, n = max(p.size for p in packs), max(p.max_seqlen for p in packs), len(packs)
    else:
        micro, _ = actor.batches.micro_batches(batch, min(actor.micro_batch_size, len(batch)))
        seq = max(mb.tokens.shape[1] for mb in micro)
        tokens, n = seq * min(actor.micro_batch_size, len(batch)), len(micro)
    gib = None if device.type == "cuda" else memory.H100_GIB
    mp = actor.plan_memory(tokens, seq, n, device_gib=gib)
    where = "" if device.type == "cuda" else " [for an H100 80 GB]"
    return mp.describe() + where, mp.peaks_gib


def padding_share(batch, mbs: int, sort: bool) -> float:
    """Share of the processed token positions that are padding, for micro-batches of ``mbs`` rows."""
    ends = (batch.prompt_lengths + batch.response_lengths).tolist()
    order = sorted(range(len(ends)), key=lambda i: -ends[i]) if sort else list(range(len(ends)))
    processed = 0
    for i in range(0, len(order), mbs):
        rows = order[i : i + mbs]
        width = max(ends[r] for r in rows) if sort else batch.tokens.shape[1]
        processed += width * len(rows)
    return 1.0 - sum(ends) / processed
