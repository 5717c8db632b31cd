"""The per-row state of the decode loop and what a step does to it: the static buffers of every row (:class:`Slots`),
the sampling settings a captured step bakes in (:class:`Sig`), the two samplers (``device``: counter-based uniforms
on the device; ``exact``: host float64 draws from each sample's own generator, as
:func:`laconic_nemo.rollout.megatron_sampler.sample`), the EOS / length bookkeeping and the compaction of the live
rows into a smaller bucket.

:class:`SlotsMixin` is a part of :class:`laconic_nemo.rollout.engine.DecodeEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """Static per-row buffers of the decode loop: capacity ``R`` rows, ``S`` positions, ``V`` vocabulary."""

    def __init__(self, R: int, S: int, V: int, hidden: int, hidden_dtype: torch.dtype, device, last: bool):
        long = dict(dtype=torch.long, device=device)
        self.R = R
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


class SlotsMixin:
    """Sampling into the slots, advancing them by one token, moving the live ones down a bucket."""

    # ------------------------------------------------------------------ sampling and bookkeeping
    def _sample_device(self, logits: torch.Tensor, b: int, sig: Sig) -> None:
        """Device sampler on logits [b, V]: tokens (and their log-probs) into the static buffers."""
        s = self.slots
        u = counter_uniforms(s.seeds[:b], s.generated[:b])
        tok = draw_on_device(logits, u, sig.temperature, sig.top_p)
        s.sampled[:b].copy_(tok)
        if sig.logprobs:
            lp = torch.log_softmax(logits / sig.temperature, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            s.sampled_lp[:b].copy_(lp)

    def _sample_exact(self, b: int, sig: Sig, gens: list[torch.Generator], slot_ids: list[int]) -> None:
        """Exact sampler: TP rank 0 of the last stage draws on the host from ``logits[:b]`` with each live
        sample's generator (one float64 uniform per generated token), as ``megatron_sampler.sample``."""
        s = self.slots
        if self.last and self.tp_rank == 0:
            logits = s.logits[:b].cpu()
            active = (~s.done[:b]).cpu()
            probs = filtered_probs(logits, sig.temperature, sig.top_p)
            u = torch.zeros(b, dtype=torch.float64)
            for j in torch.nonzero(active).flatten().tolist():
                u[j] = torch.rand((), generator=gens[slot_ids[j]], dtype=torch.float64)
            tok = draw(probs, u)
            s.sampled[:b].copy_(tok.to(self.device))
            if sig.logprobs:
                lp = torch.log_softmax(logits / sig.temperature, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
                s.sampled_lp[:b].copy_(lp.to(self.device))
        if self.last:
            self._tp_broadcast(b, sig)

    def _advance(self, b: int, sig: Sig) -> None:
        """Take the sampled tokens of slots [0, b): write them after each row's position, count them, flag a stop
        token (:func:`stop_hit`) and the length limit, move each live row to its new token. Finished rows are fed
        ``pad``."""
        s = self.slots
        active = ~s.done[:b]
        step = active.long()
        nxt = torch.where(active, s.sampled[:b], sig.pad)
        pos, ids = s.pos[:b], s.sample_id[:b]
        s.out_tokens.index_put_((ids, pos + 1), nxt)
        if sig.logprobs:
            s.out_lp.index_put_((ids, pos), torch.where(active, s.sampled_lp[:b], 0.0))
        gen = s.generated[:b].add_(step)
        new_eos = active & stop_hit(nxt, sig)
        s.hit_eos[:b] |= new_eos
        s.done[:b] |= new_eos | (active & (gen >= sig.max_new))
        pos.add_(step)
        s.tokens[:b].copy_(nxt)

    def _compact(self, alive: list[int], b: int, nb: int, upto: int, pad: int) -> None:
        """Move the live slots ``alive`` (increasing) to [0, len(alive)) - state and KV rows - and clear the
        rest of the new bucket ``nb``."""
        s, n = self.slots, len(alive)
        s.retire(b)
        idx = torch.tensor(alive, dtype=torch.long, device=self.device)
        for t in (s.tokens, s.pos, s.seeds, s.generated, s.done, s.hit_eos, s.sample_id):
            t[:n] = t[idx]
        s.clear(n, nb, pad)
        self.cache.move_rows(alive, upto)
        self.stats.compactions += 1
