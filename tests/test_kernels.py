"""SDPAttention (laconic_nemo.runtime.kernels) against megatron's own DotProductAttention and a float64 reference, the
on-device sampler's pieces (counter-based uniforms, inverse CDF, compaction) and the per-device choices."""

from __future__ import annotations

import math

import pytest
import torch

from laconic_nemo.grpo.interfaces import SamplingParams
from laconic_nemo.rollout.megatron_sampler import counter_uniforms, draw_on_device, sample_on_device, sample_seed
from laconic_nemo.runtime.kernels import SDPAttention, fusion_flags, resolve_attention


@pytest.fixture(scope="module")
def mp_state():
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    init_distributed(1, 1, backend="gloo", seed=0)
    yield
    destroy_distributed()


def _config(heads: int, groups: int, head_dim: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim, use_cpu_initialization=True,
                             attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float64,
                             **fusion_flags(on_gpu=False))


def _reference(q, k, v, causal_offset: int | None):
    """float64 attention: q [sq, b, np, hn], k/v [sk, b, ng, hn]; query i sits at position causal_offset + i
    (None: no mask). Returns [sq, b, np * hn]."""
    sq, b, np_, hn = q.shape
    sk, ng = k.shape[0], k.shape[2]
    k = k.repeat_interleave(np_ // ng, dim=2)
    v = v.repeat_interleave(np_ // ng, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(hn)
    if causal_offset is not None:
        allowed = torch.arange(sk)[None, :] <= (causal_offset + torch.arange(sq))[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("bhqk,kbhd->qbhd", torch.softmax(scores, dim=-1), v)
    return out.reshape(sq, b, np_ * hn)


@pytest.mark.parametrize("sq,sk", [(6, 6), (1, 9), (3, 8)])  # training / decode step / chunk over a cache
@pytest.mark.parametrize("heads,groups", [(4, 4), (6, 2)])
def test_sdpa_attention_matches_float64_and_megatron(mp_state, sq, sk, heads, groups):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    g = torch.Generator().manual_seed(sq * 100 + sk + heads)
    b, hn = 3, 8
    q = torch.randn(sq, b, heads, hn, generator=g, dtype=torch.float64)
    k = torch.randn(sk, b, groups, hn, generator=g, dtype=torch.float64)
    v = torch.randn(sk, b, groups, hn, generator=g, dtype=torch.float64)
    cfg = _config(heads, groups, hn)
    ours = SDPAttention(cfg, 1, AttnMaskType.causal, "self")(q, k, v, None)
    ref = _reference(q, k, v, causal_offset=None if sq == 1 else sk - sq)
    assert ours.shape == (sq, b, heads * hn) and ours.is_contiguous()
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    if sq == sk or sq == 1:  # cases megatron's unfused attention supports
        theirs = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")(q, k, v, None)
        torch.testing.assert_close(ours, theirs.reshape(ours.shape), rtol=1e-10, atol=1e-10)


def test_sdpa_attention_uses_a_given_mask(mp_state):
    from megatron.core.transformer.enums import AttnMaskType

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 2, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).triu(1)  # megatron: True = masked out (causal)
    out = SDPAttention(_config(2, 2, 8), 1, AttnMaskType.causal, "self")(q, k, v, mask)
    torch.testing.assert_close(out, _reference(q, k, v, causal_offset=0), rtol=1e-12, atol=1e-12)


def test_attention_choice_per_device():
    assert resolve_attention("auto", on_gpu=False) == "local"  # the deterministic CPU main job
    assert resolve_attention("auto", on_gpu=True) in ("te", "sdpa")
    assert resolve_attention("sdpa", on_gpu=False) == "sdpa"
    with pytest.raises(ValueError, match="model.attention"):
        resolve_attention("flash", on_gpu=True)
    assert not any(fusion_flags(on_gpu=False).values())
    assert fusion_flags(on_gpu=True)["bias_activation_fusion"]


def test_counter_uniforms_are_a_pure_function_of_seed_and_counter():
    seeds = torch.tensor([sample_seed(3, 0, i) for i in range(5)])
    counters = torch.tensor([0, 7, 7, 1000, 2**40])
    u = counter_uniforms(seeds, counters)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    # each entry alone (another batch, another order) gives the same value
    for i in range(5):
        assert counter_uniforms(seeds[i : i + 1], counters[i : i + 1]).item() == u[i].item()
    assert counter_uniforms(seeds.flip(0), counters.flip(0)).flip(0).tolist() == u.tolist()
    # roughly uniform over many counters: mean 1/2, variance 1/12
    many = counter_uniforms(torch.full((20000,), seeds[0].item()), torch.arange(20000))
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.005


def test_draw_on_device_inverse_cdf_and_nucleus():
    logits = torch.log(torch.tensor([[0.25, 0.0, 0.5, 0.25]] * 4))
    u = torch.tensor([0.0, 0.2499, 0.25, 0.9999999], dtype=torch.float64)
    assert draw_on_device(logits, u, 1.0, 1.0).tolist() == [0, 0, 2, 3]  # vocabulary order when top_p = 1
    # top_p 0.6 keeps tokens 2 (0.5) and then 0 (0.25, ties broken by id): sorted order [2, 0]
    p = torch.log(torch.tensor([[0.25, 0.05, 0.5, 0.2]] * 3))
    assert draw_on_device(p, torch.tensor([0.0, 0.66, 0.67], dtype=torch.float64), 1.0, 0.6).tolist() == [2, 2, 0]


def _bigram(V=13, seed=0):
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return lambda tokens, start: table[tokens[:, -1]]


def test_device_sampler_compaction_changes_nothing_but_the_work():
    step = _bigram()
    fed = {"rows": 0}

    def counting(tokens, start):
        fed["rows"] += tokens.shape[0] * tokens.shape[1]
        return step(tokens, start)

    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11], [12, 2]]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=40, eos_id=0, seed=5)
    plain = sample_on_device(counting, lambda x, b: x, prompts, sp, sync_every=3)
    work_plain, fed["rows"] = fed["rows"], 0
    packed = sample_on_device(counting, lambda x, b: x, prompts, sp, sync_every=3, compact=lambda keep: None)
    assert all(torch.equal(getattr(plain, k), getattr(packed, k)) for k in
               ("tokens", "prompt_lengths", "response_lengths", "lengths", "truncated"))
    assert (~plain.truncated).any()  # some rows ended early, so compaction had rows to drop
    assert fed["rows"] < work_plain
    # a sample (index i of stream s) does not depend on the rest of its batch: batches of the first i + 1
    # prompts, other sync intervals, without compaction, give row i unchanged
    for i in range(len(prompts)):
        part = sample_on_device(step, lambda x, b: x, prompts[: i + 1], sp, sync_every=1 + i % 4)
        n = int(part.prompt_lengths[i] + part.response_lengths[i])
        assert torch.equal(part.tokens[i, :n], plain.tokens[i, :n])
    with pytest.raises(ValueError, match="sync_every"):
        sample_on_device(step, lambda x, b: x, prompts, sp, sync_every=0)
