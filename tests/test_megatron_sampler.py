"""The sampling loop of laconic_nemo.rollout.megatron_sampler with a plain-torch step function."""

from __future__ import annotations

import pytest
import torch

from laconic_nemo.grpo.interfaces import SamplingParams
from laconic_nemo.rollout.megatron_sampler import draw, filtered_probs, sample


def test_top_p_hand_worked():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # mass before each sorted token: 0, .5, .8, .95 -> top_p .8 keeps the first two, .81 the first three
    torch.testing.assert_close(filtered_probs(logits, 1.0, 0.8), torch.tensor([[0.625, 0.375, 0, 0]], dtype=torch.float64))
    p = filtered_probs(logits, 1.0, 0.81)
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.15, 0]], dtype=torch.float64) / 0.95)
    # temperature 2 flattens: softmax(log p / 2) ~ sqrt(p)
    s = torch.sqrt(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    torch.testing.assert_close(filtered_probs(logits, 2.0, 1.0)[0], s / s.sum())


def test_draw_inverse_cdf():
    probs = torch.tensor([[0.25, 0.0, 0.5, 0.25]] * 4, dtype=torch.float64)
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9999999999])
    assert draw(probs, u).tolist() == [0, 0, 2, 3]
    assert draw(torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64), torch.tensor([1.0 - 1e-17])).item() == 1


class _CountingModel:
    """Logits that depend on the whole prefix (so prompt forcing and positions matter): the next token
    is (sum of the prefix) mod V with probability ~1 at temperature 1 (logit gap 50)."""

    def __init__(self, vocab):
        self.vocab = vocab
        self.seq = None

    def step(self, tokens, start):
        self.seq = tokens.clone() if start == 0 else torch.cat([self.seq, tokens], dim=1)
        assert self.seq.shape[1] == start + tokens.shape[1]
        target = self.seq.sum(dim=1) % self.vocab
        return torch.nn.functional.one_hot(target, self.vocab).double() * 50.0


def test_prompt_forcing_eos_truncation_and_lengths():
    V, eos = 7, 0
    prompts = [[3, 4], [1, 1, 1, 1, 2], [6], [2, 5]]
    # expected deterministic continuations: next = sum(prefix) % 7; stops when that is 0 (EOS)
    expected = []
    for p in prompts:
        seq, resp = list(p), []
        while len(resp) < 6:
            nxt = sum(seq) % V
            resp.append(nxt)
            seq.append(nxt)
            if nxt == eos:
                break
        expected.append(resp)
    m = _CountingModel(V)
    out = sample(m.step, lambda x, b: x, prompts, SamplingParams(max_new_tokens=6, eos_id=eos, seed=0))
    for i, (p, resp) in enumerate(zip(prompts, expected)):
        n = len(resp)
        assert out.tokens[i, : len(p)].tolist() == p
        assert out.tokens[i, len(p) : len(p) + n].tolist() == resp
        assert int(out.response_lengths[i]) == n
        hit = resp[-1] == eos
        assert bool(out.truncated[i]) == (not hit)
        assert int(out.lengths[i]) == (n - 1 if hit else 6)
        assert (out.tokens[i, len(p) + n :] == eos).all()
    assert out.truncated.any() and (~out.truncated).any()


def test_same_seed_same_samples_and_batch_independence():
    V = 11
    torch.manual_seed(0)
    table = torch.randn(V, V, dtype=torch.float64)

    def step(tokens, start):  # a bigram model: only the last token matters
        return table[tokens[:, -1]]

    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=20, eos_id=0, seed=3)
    a = sample(step, lambda x, b: x, prompts, sp)
    b = sample(step, lambda x, b: x, prompts, sp)
    c = sample(step, lambda x, b: x, prompts[:2], sp)
    d = sample(step, lambda x, b: x, prompts, SamplingParams(0.9, 0.95, 20, 0, seed=4))
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(c.tokens, a.tokens[:2, : c.tokens.shape[1]])
    assert not torch.equal(a.tokens, d.tokens)


def test_bad_sampling_params():
    step = _CountingModel(5).step
    with pytest.raises(ValueError, match="temperature"):
        sample(step, lambda x, b: x, [[1]], SamplingParams(temperature=0.0))
    with pytest.raises(ValueError, match="top_p"):
        sample(step, lambda x, b: x, [[1]], SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="max_new_tokens"):
        sample(step, lambda x, b: x, [[1]], SamplingParams(max_new_tokens=0))
    with pytest.raises(ValueError, match="at least one token"):
        sample(step, lambda x, b: x, [[]], SamplingParams())
