"""Autoregressive sampling loop for the megatron-core actor (engine-agnostic part).

The loop is written against a ``step`` callable supplied by the actor, so the sampling logic (prompt
forcing, temperature, top-p, EOS, per-sample random streams) is independent of how the logits are
produced (KV-cached megatron forward, TP/PP schedule, or a plain torch model in tests).

Layout: prompts of different lengths sit right-aligned-free in one buffer ``[B, P_max + L_max]``
(each prompt starts at position 0, so RoPE positions are the true positions). The prefill covers the
shortest prompt; afterwards one position is decoded per step, and rows whose prompt is longer than the
current position are fed their own prompt token instead of a sample (the classic Megatron loop). A
row finishes on EOS (kept in ``tokens``, counted in ``response_lengths``, not in ``lengths``) or after
``max_new_tokens`` generated tokens (``truncated``).

Two loops share this layout:

* :func:`sample` (``rollout.sampler: exact``, the CPU default): float64 softmax / nucleus / inverse CDF on
  the host; sample ``i`` draws from its own ``torch.Generator`` seeded by ``(seed, stream, i)`` (stream =
  the data-parallel rank), one uniform per generated token.
* :func:`sample_on_device` (``rollout.sampler: device``, the GPU default): everything stays on the
  logits' device in float32; the uniform of the ``t``-th generated token of sample ``i`` is a counter-based
  hash of ``(seed, stream, i, t)`` (no generator state, nothing to keep in step across ranks); the host
  synchronises only every ``sync_every`` decode steps, and rows that finished are then dropped from the
  batch and from the KV cache (``compact``), so a rollout stops paying for them.

In both, a sample's tokens do not depend on the other prompts in the batch nor on how the batch is split.
"""

from __future__ import annotations

from typing import Callable

import torch

from laconic_nemo.grpo.interfaces import GenerationOutput, SamplingParams

# step(tokens [B, s] long, start: int) -> logits [B, V] float of the LAST position of the chunk (full real
# vocabulary, identical on every rank that returns them) or None on ranks that do not sample.
StepFn = Callable[[torch.Tensor, int], "torch.Tensor | None"]
# broadcast(tokens [B] long or None) -> the deciding rank's tokens on every model-parallel rank.
BroadcastFn = Callable[["torch.Tensor | None", int], torch.Tensor]
# compact(keep [b'] long, indices into the rows of the current batch) -> None: drop every other row from the
# step's state (KV cache); later step calls receive only the kept rows, in this order.
CompactFn = Callable[[torch.Tensor], None]


def check_sampling(sampling: SamplingParams) -> None:
    """Raise ValueError naming the bad field of ``sampling``."""
    if not sampling.temperature > 0:
        raise ValueError(f"sampling.temperature must be > 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"sampling.top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"sampling.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")


def sample_seed(seed: int, stream: int, index: int) -> int:
    """Seed of sample ``index`` of random stream ``stream`` (a 63-bit mix of the three integers)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(stream) * 0xBF58476D1CE4E5B9 + int(index) * 0x94D049BB133111EB) & (
        (1 << 64) - 1
    )
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & ((1 << 64) - 1)
    x ^= x >> 32
    return x & ((1 << 63) - 1)


def filtered_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution [B, V] (float64) from logits [B, V]: softmax(logits / temperature), then the
    nucleus: the smallest set of most probable tokens whose mass reaches top_p (ties broken by token id),
    renormalised."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = mass_before < top_p  # always keeps the most probable token
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [B, V] float64, uniforms [B] in [0, 1) -> token ids [B]."""
    cdf = torch.cumsum(probs, dim=-1)
    u = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    # never land on a zero-probability token (u at the top of the cdf, float round-off)
    idx = idx.clamp(max=probs.shape[-1] - 1)
    last_nonzero = (probs > 0).to(torch.int64).cumsum(-1).argmax(-1)
    return torch.minimum(idx, last_nonzero)


def stop_hit(tokens: torch.Tensor, stops: tuple[int, ...]) -> torch.Tensor:
    """[B] bool: which of ``tokens`` [B] end a response, any of ``stops`` (EOS and the chat template's end token:
    :meth:`SamplingParams.stops`). One comparison per id against a Python int, so a captured decode step bakes the
    ids into its graph (they are part of its key) and allocates nothing."""
    hit = tokens == int(stops[0])
    for s in stops[1:]:
        hit = hit | (tokens == int(s))
    return hit


def _prompt_buffer(prompts: list[list[int]], sampling: SamplingParams, pad_id: int | None):
    """Check the inputs; the token buffer [B, P_max + L_max] (prompts from position 0, then ``pad``), the prompt
    lengths [B] and ``pad`` (``pad_id``, default the EOS id)."""
    check_sampling(sampling)
    if len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must contain at least one token")
    pad = sampling.eos_id if pad_id is None else pad_id
    prompt_lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    buf = torch.full((len(prompts), int(prompt_lens.max()) + int(sampling.max_new_tokens)), pad, dtype=torch.long)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return buf, prompt_lens, pad


@torch.no_grad()
def sample(
    step: StepFn,
    broadcast: BroadcastFn,
    prompts: list[list[int]],
    sampling: SamplingParams,
    stream: int = 0,
    pad_id: int | None = None,
) -> GenerationOutput:
    """Sample one response per prompt. Call on every model-parallel rank (SPMD).

    step / broadcast: see ``StepFn`` / ``BroadcastFn``; ``step`` is called with the prefill chunk first
    (start 0) and then with one token per call, in order, so it may keep a KV cache.
    prompts: B lists of token ids (each non-empty). stream: random stream id (data-parallel rank).
    pad_id: id written after the end of each row (default ``sampling.eos_id``).
    Returns CPU tensors as described in :class:`GenerationOutput`.
    """
    buf, prompt_lens, pad = _prompt_buffer(prompts, sampling, pad_id)
    B, L_max, P_min = len(prompts), int(sampling.max_new_tokens), int(prompt_lens.min())
    gens = [torch.Generator().manual_seed(sample_seed(sampling.seed, stream, i)) for i in range(B)]

    generated = torch.zeros(B, dtype=torch.long)  # tokens generated so far (EOS included)
    done = torch.zeros(B, dtype=torch.bool)
    hit_eos = torch.zeros(B, dtype=torch.bool)
    cur = P_min  # positions [0, cur) have been fed
    logits = step(buf[:, :cur], 0)
    while True:
        # choose the token at position ``cur`` for every row
        in_prompt = prompt_lens > cur
        active = ~in_prompt & ~done
        if logits is not None:
            probs = filtered_probs(logits, sampling.temperature, sampling.top_p)
            # one uniform per generated token of each active row: the stream does not depend on the batch
            u = torch.zeros(B, dtype=torch.float64)
            for i in torch.nonzero(active).flatten().tolist():
                u[i] = torch.rand((), generator=gens[i], dtype=torch.float64)
            sampled = draw(probs, u)
        else:
            sampled = None
        sampled = broadcast(sampled, B)
        if logits is None:  # keep the generators in step on ranks that did not sample
            for i in torch.nonzero(active).flatten().tolist():
                torch.rand((), generator=gens[i], dtype=torch.float64)
        nxt = torch.where(active, sampled, buf[:, cur])
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        buf[:, cur] = nxt
        generated += active.long()
        new_eos = active & stop_hit(nxt, sampling.stops())
        hit_eos |= new_eos
        done |= new_eos | (active & (generated >= L_max))
        cur += 1
        if bool(done.all()) or cur >= buf.shape[1]:
            break
        logits = step(buf[:, cur - 1 : cur], cur - 1)

    response_lengths = generated
    lengths = generated - hit_eos.long()
    truncated = ~hit_eos & (generated >= L_max)
    T = int((prompt_lens + response_lengths).max())
    return GenerationOutput(
        tokens=buf[:, :T].clone(),
        prompt_lengths=prompt_lens,
        response_lengths=response_lengths,
        lengths=lengths,
        truncated=truncated,
    )


# ----------------------------------------------------------------------------------------------- device
_M64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """A 64-bit constant as the signed int64 torch stores."""
    c &= _M64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``k`` (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def counter_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) [B] float64 from per-sample seeds [B] int64 and token counters [B] int64: the
    splitmix64 finaliser of ``seed + (counter + 1) * golden``, top 53 bits. A pure function of each pair,
    on any device (int64 arithmetic wraps modulo 2^64 on CPU and CUDA)."""
    x = seeds + (counters + 1) * _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = x ^ _shr(x, 31)
    return _shr(x, 11).to(torch.float64) * (1.0 / (1 << 53))


def draw_on_device(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Token ids [B] from logits [B, V] (any float dtype, on any device) and uniforms [B] in [0, 1).

    float32 softmax(logits / temperature); with top_p < 1 the nucleus (the most probable tokens, by
    probability then token id, whose preceding mass is below top_p); then the inverse CDF of the kept
    mass at ``u * kept mass``. No host synchronisation, no float64 over the vocabulary."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = torch.where(mass_before < top_p, probs, torch.zeros_like(probs))
    else:
        order = None
    cdf = torch.cumsum(probs, dim=-1)
    u = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    # never past the last token with mass (u * total at the top of the cdf, round-off)
    last_nonzero = (probs > 0).to(torch.int64).cumsum(-1).argmax(-1)
    idx = torch.minimum(idx, last_nonzero)
    return idx if order is None else order.gather(-1, idx.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def sample_on_device(
    step: StepFn,
    broadcast: BroadcastFn,
    prompts: list[list[int]],
    sampling: SamplingParams,
    stream: int = 0,
    pad_id: int | None = None,
    device: torch.device | str = "cpu",
    compact: CompactFn | None = None,
    sync_every: int = 8,
) -> GenerationOutput:
    """Sample one response per prompt with all per-token work on ``device``. Call on every model-parallel
    rank (SPMD); same contract as :func:`sample`, except:

    step: receives device tokens [b, s] of the rows still in the batch and returns device logits [b, V]
    (or None on ranks that do not sample); broadcast: device tokens [b] in and out.
    compact: when given, at every synchronisation point the finished rows are dropped (``compact(keep)``
    is called first, so the step can shrink its KV cache); without it they are fed padding until all end.
    sync_every: decode steps between host synchronisations (finished? compact?); a row may be fed up to
    ``sync_every - 1`` padding tokens after its end, which changes nothing in its output.
    Returns CPU tensors as described in :class:`GenerationOutput`.
    """
    if sync_every < 1:
        raise ValueError(f"rollout.sync_every must be >= 1, got {sync_every}")
    device = torch.device(device)
    buf, prompt_lens, pad = _prompt_buffer(prompts, sampling, pad_id)
    B, L_max, P_min = len(prompts), int(sampling.max_new_tokens), int(prompt_lens.min())
    buf, prompt_lens = buf.to(device), prompt_lens.to(device)
    seeds = torch.tensor([sample_seed(sampling.seed, stream, i) for i in range(B)], dtype=torch.long, device=device)

    rows = torch.arange(B, device=device)  # rows still in the batch, in the step's order
    generated = torch.zeros(B, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    hit_eos = torch.zeros(B, dtype=torch.bool, device=device)
    cur = P_min
    logits = step(buf[:, :cur], 0)
    since_sync = 0
    while True:
        r_done = done[rows]
        active = (prompt_lens[rows] <= cur) & ~r_done
        r_gen = generated[rows]
        if logits is not None:
            u = counter_uniforms(seeds[rows], r_gen)
            sampled = draw_on_device(logits, u, sampling.temperature, sampling.top_p)
        else:
            sampled = None
        sampled = broadcast(sampled, len(rows))
        nxt = torch.where(active, sampled, buf[rows, cur])
        nxt = torch.where(r_done, torch.full_like(nxt, pad), nxt)
        buf[rows, cur] = nxt
        r_gen = r_gen + active.long()
        generated[rows] = r_gen
        new_eos = active & stop_hit(nxt, sampling.stops())
        hit_eos[rows] |= new_eos
        done[rows] = r_done | new_eos | (active & (r_gen >= L_max))
        cur += 1
        if cur >= buf.shape[1]:
            break
        since_sync += 1
        if since_sync >= sync_every:
            since_sync = 0
            r_done = done[rows].cpu()
            if bool(r_done.all()):
                break
            if compact is not None and bool(r_done.any()):
                keep = torch.nonzero(~r_done).flatten().to(device)
                compact(keep)
                rows = rows[keep]
        logits = step(buf[rows, cur - 1 : cur], cur - 1)

    response_lengths = generated.cpu()
    hit_eos = hit_eos.cpu()
    prompt_lens = prompt_lens.cpu()
    T = int((prompt_lens + response_lengths).max())
    return GenerationOutput(
        tokens=buf[:, :T].cpu(),
        prompt_lengths=prompt_lens,
        response_lengths=response_lengths,
        lengths=response_lengths - hit_eos.long(),
        truncated=~hit_eos & (response_lengths >= L_max),
    )
