"""The per-row state of the decode loop and what a step does to it: the static buffers of every row (:class:`Slots`),
the sampling settings a captured step bakes in (:class:`Sig`), the two samplers (``device``: counter-based uniforms
on the device; ``exact``: host float64 draws from each sample's own generator, as
:func:`laconic_nemo.rollout.megatron_sampler.sample`), the EOS / length bookkeeping and the compaction of the live
rows into a smaller bucket.

:class:`laconic_nemo.rollout.engine.DecodeEngine` composes :class:`Slots` with its
:class:`~laconic_nemo.rollout.stage.Stage` and KV cache; what a method needs of them it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from laconic_nemo.rollout.kv_cache import StaticKVCache
from laconic_nemo.rollout.megatron_sampler import counter_uniforms, draw, draw_on_device, filtered_probs
from laconic_nemo.rollout.megatron_sampler import stop_hit as any_stop_hit


@dataclass(frozen=True)
class Sig:
    """The sampling settings a captured step bakes in (part of its graph key)."""

    sampler: str
    temperature: float
    top_p: float
    eos: int
    pad: int
    max_new: int
    logprobs: bool
    stops: tuple[int, ...] = ()  # every id that ends a response (SamplingParams.stops); empty: eos alone


def stop_hit(tokens: torch.Tensor, sig: Sig) -> torch.Tensor:
    """Bool [b]: which of the tokens [b] just sampled end their row (counted in ``response_lengths``, flagged in
    ``hit_eos``): any of ``sig.stops`` (EOS and the chat template's end token), or the EOS id alone where none
    are given. The one stop function of the engine's eager, captured and fused decode steps."""
    return any_stop_hit(tokens, sig.stops or (sig.eos,))


class Slots:
    """Static per-row buffers of the decode loop on ``device``: capacity ``R`` rows, ``S`` positions, ``V``
    vocabulary (``logits`` [R, V] only where ``last``: the last pipeline stage), hidden states [R, hidden] of
    ``hidden_dtype`` handed between pipeline stages; and what a step does to them: sampling, advancing, compaction."""

    def __init__(self, R: int, S: int, V: int, hidden: int, hidden_dtype: torch.dtype, device, last: bool):
        long = dict(dtype=torch.long, device=device)
        self.R = R
        self.device = device
        self.tokens = torch.zeros(R, **long)        # input token of the next step
        self.pos = torch.zeros(R, **long)           # its position
        self.seeds = torch.zeros(R, **long)         # device sampler: per-sample seed
        self.generated = torch.zeros(R, **long)     # tokens generated so far (EOS included)
        self.done = torch.ones(R, dtype=torch.bool, device=device)
        self.hit_eos = torch.zeros(R, dtype=torch.bool, device=device)
        self.sample_id = torch.full((R,), R, **long)  # output row of each slot; R = the scratch row
        self.rows = torch.arange(R, **long)
        self.sampled = torch.zeros(R, **long)
        self.sampled_lp = torch.zeros(R, dtype=torch.float32, device=device)
        self.logits = torch.zeros(R, V, dtype=torch.float32, device=device) if last else None
        self.hidden_in = torch.zeros(R, hidden, dtype=hidden_dtype, device=device)
        self.hidden_out = torch.zeros(R, hidden, dtype=hidden_dtype, device=device)
        self.out_tokens = torch.zeros(R + 1, S + 1, **long)
        self.out_lp = torch.zeros(R + 1, S + 1, dtype=torch.float32, device=device)
        self.res_generated = torch.zeros(R + 1, **long)
        self.res_eos = torch.zeros(R + 1, dtype=torch.bool, device=device)
        self.arange = torch.arange(S, **long)

    def state(self, b: int) -> list[torch.Tensor]:
        """What a decode step advances (restored after a graph's warm-up)."""
        return [self.tokens[:b], self.pos[:b], self.generated[:b], self.done[:b], self.hit_eos[:b]]

    def drawn(self, sig: Sig) -> list[torch.Tensor]:
        """The buffers a sampling rank fills for the others: ``sampled`` [R], and ``sampled_lp`` [R] when
        ``sig.logprobs`` (what the TP / PP broadcasts send)."""
        return [self.sampled, self.sampled_lp] if sig.logprobs else [self.sampled]

    def start(self, prompts: list[list[int]], seeds: list[int], pad: int) -> None:
        """A pass: rows [0, n) take the n ``prompts`` (their last position the next step's input) with the device
        sampler's per-sample ``seeds``; the other rows are empty; the results and output rows are reset."""
        n, dev = len(prompts), self.device
        self.clear(0, self.R, pad)
        self.done[:n] = False
        self.sample_id[:n] = torch.arange(n, device=dev)
        self.seeds[:n] = torch.tensor(seeds, dtype=torch.long, device=dev)
        self.pos[:n] = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev) - 1
        self.res_generated.zero_()
        self.res_eos.zero_()
        self.out_lp[: n + 1].zero_()
        head = torch.full((n, self.out_tokens.shape[1]), pad, dtype=torch.long)
        for i, p in enumerate(prompts):
            head[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        self.out_tokens[:n].copy_(head.to(dev))

    def retire(self, b: int) -> None:
        """Copy the counters of slots [0, b) to their samples' result rows."""
        ids = self.sample_id[:b]
        self.res_generated.index_copy_(0, ids, self.generated[:b].clone())
        self.res_eos.index_copy_(0, ids, self.hit_eos[:b].clone())

    def clear(self, a: int, b: int, pad: int) -> None:
        """Slots [a, b) hold no sample: finished, writing into the scratch row."""
        self.done[a:b] = True
        self.sample_id[a:b] = self.R
        self.pos[a:b] = 0
        self.tokens[a:b] = pad
        self.generated[a:b] = 0
        self.seeds[a:b] = 0
        self.hit_eos[a:b] = False

    # ------------------------------------------------------------------ sampling and bookkeeping
    def sample_device(self, logits: torch.Tensor, b: int, sig: Sig) -> None:
        """Device sampler on logits [b, V]: tokens (and their log-probs) into ``sampled`` / ``sampled_lp``."""
        u = counter_uniforms(self.seeds[:b], self.generated[:b])
        tok = draw_on_device(logits, u, sig.temperature, sig.top_p)
        self.sampled[:b].copy_(tok)
        if sig.logprobs:
            lp = torch.log_softmax(logits / sig.temperature, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            self.sampled_lp[:b].copy_(lp)

    def sample_exact(self, b: int, sig: Sig, gens: list[torch.Generator], slot_ids: list[int]) -> None:
        """Exact sampler (on the rank that draws: TP rank 0 of the last stage): draws on the host from
        ``logits[:b]`` with each live slot's generator ``gens[slot_ids[j]]`` (one float64 uniform per generated
        token), as ``megatron_sampler.sample``; tokens (and log-probs) into ``sampled`` / ``sampled_lp``."""
        logits = self.logits[:b].cpu()
        active = (~self.done[:b]).cpu()
        probs = filtered_probs(logits, sig.temperature, sig.top_p)
        u = torch.zeros(b, dtype=torch.float64)
        for j in torch.nonzero(active).flatten().tolist():
            u[j] = torch.rand((), generator=gens[slot_ids[j]], dtype=torch.float64)
        tok = draw(probs, u)
        self.sampled[:b].copy_(tok.to(self.device))
        if sig.logprobs:
            lp = torch.log_softmax(logits / sig.temperature, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            self.sampled_lp[:b].copy_(lp.to(self.device))

    def advance(self, b: int, sig: Sig) -> None:
        """Take the sampled tokens of slots [0, b): write them after each row's position, count them, flag a stop
        token (:func:`stop_hit`) and the length limit, move each live row to its new token. Finished rows are fed
        ``pad``."""
        active = ~self.done[:b]
        step = active.long()
        nxt = torch.where(active, self.sampled[:b], sig.pad)
        pos, ids = self.pos[:b], self.sample_id[:b]
        self.out_tokens.index_put_((ids, pos + 1), nxt)
        if sig.logprobs:
            self.out_lp.index_put_((ids, pos), torch.where(active, self.sampled_lp[:b], 0.0))
        gen = self.generated[:b].add_(step)
        new_eos = active & stop_hit(nxt, sig)
        self.hit_eos[:b] |= new_eos
        self.done[:b] |= new_eos | (active & (gen >= sig.max_new))
        pos.add_(step)
        self.tokens[:b].copy_(nxt)

    def compact(self, alive: list[int], b: int, nb: int, upto: int, pad: int, cache: StaticKVCache) -> None:
        """Move the live slots ``alive`` (increasing) of the bucket ``b`` to [0, len(alive)) - state and the
        ``cache``'s KV rows (positions [0, upto)) - and clear the rest of the new bucket ``nb``."""
        n = len(alive)
        self.retire(b)
        idx = torch.tensor(alive, dtype=torch.long, device=self.device)
        for t in (self.tokens, self.pos, self.seeds, self.generated, self.done, self.hit_eos, self.sample_id):
            t[:n] = t[idx]
        self.clear(n, nb, pad)
        cache.move_rows(alive, upto)
