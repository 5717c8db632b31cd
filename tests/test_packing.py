"""Packed micro-batches (laconic_nemo.actors.packing, the packed-attention kernels of laconic_nemo.runtime.kernels) in one
process: the packing by hand, the pack layout and its unpacking, the document-causal kernels against a float64
per-row reference, and megatron-core's own GPTModel in float64 on a packed sequence against the same rows run one
by one (logits and gradients). The actor-level checks at TP 2, PP 2 and DP 2 are in tests/test_megatron_actor.py."""

from __future__ import annotations

import math

import pytest
import torch

from laconic_nemo.actors.packing import build_packs, first_fit_decreasing
from laconic_nemo.grpo.interfaces import TrainBatch
from laconic_nemo.runtime.kernels import document_causal_mask, packed_attention, packed_seq_params


@pytest.fixture(scope="module")
def mp_state():
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    init_distributed(1, 1, backend="gloo", seed=0)
    yield
    destroy_distributed()


def test_first_fit_decreasing_by_hand():
    # rows by length 9, 8, 7, 5, 3, 2: 9 / 8 / 7 open packs, 5 fits none (14, 13, 12 > 10) and opens a fourth,
    # 3 goes to the 7 (10), 2 to the 8 (10)
    assert first_fit_decreasing([5, 9, 3, 7, 2, 8], 10) == [[1], [5, 4], [3, 2], [0]]
    assert first_fit_decreasing([12, 3, 4], 10) == [[0], [2, 1]]  # a row over the budget is alone
    assert first_fit_decreasing([4, 4, 4], 12) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        first_fit_decreasing([3], 0)


def _batch(lengths: list[int], T: int) -> TrainBatch:
    """Rows whose token at position j of row r is 100 r + j + 1 (so every value says where it came from)."""
    n = len(lengths)
    tokens = torch.zeros(n, T, dtype=torch.long)
    for r, L in enumerate(lengths):
        tokens[r, :L] = 100 * r + torch.arange(L) + 1
    prompt = torch.full((n,), 2)
    resp = torch.tensor(lengths) - 2
    mask = torch.zeros(n, T - 1)
    for r, L in enumerate(lengths):
        mask[r, 1 : L - 1] = 1.0
    return TrainBatch(tokens, prompt, resp, mask, advantages=torch.arange(n, dtype=torch.float32),
                      old_logprobs=-mask.clone())


@pytest.mark.parametrize("pad_to_longest", [False, True])
def test_packs_concatenate_rows_and_unpack_back(pad_to_longest):
    lengths, T = [5, 9, 3, 7, 2, 8], 10
    batch = _batch(lengths, T)
    packs = build_packs(batch, 10, pad_to_longest=pad_to_longest, pad_id=0)
    assert [p.rows.tolist() for p in packs] == [[1], [5, 4], [3, 2], [0]]
    assert sorted(r for p in packs for r in p.rows.tolist()) == list(range(6))  # every row exactly once
    sizes = [p.size for p in packs]
    assert sizes == ([10, 10, 10, 10] if pad_to_longest else [9, 10, 10, 5])
    for p in packs:
        expect_tokens = torch.cat([batch.tokens[r, :L] for r, L in zip(p.rows.tolist(), p.lengths.tolist())])
        tail = p.size - int(p.lengths.sum())
        assert torch.equal(p.tokens[0], torch.cat([expect_tokens, torch.zeros(tail, dtype=torch.long)]))
        # positions restart in every row (and in the padded tail, a segment of its own)
        segs = p.lengths.tolist() + ([tail] if tail else [])
        assert p.position_ids[0].tolist() == [j for n in segs for j in range(n)]
        assert p.cu_seqlens.tolist() == [0] + torch.cumsum(torch.tensor(segs), 0).tolist()
        assert p.cu_seqlens.dtype == torch.int32 and p.max_seqlen == max(segs)
        # the loss sees the pack's rows cut to the longest one
        W = int(p.lengths.max())
        assert torch.equal(p.batch.tokens, batch.tokens[p.rows, :W])
        assert torch.equal(p.batch.response_mask, batch.response_mask[p.rows, : W - 1])
        assert torch.equal(p.batch.advantages, batch.advantages[p.rows])
        # unpack: position q of the pack scores the token at q + 1; per row, position j scores its token j + 1
        nxt = torch.roll(p.tokens[0], -1).double()
        rows = p.unpack(nxt)
        want = batch.tokens[p.rows, 1:W].double()
        inside = torch.arange(W - 1).unsqueeze(0) < (p.lengths - 1).unsqueeze(1)
        assert torch.equal(rows, torch.where(inside, want, torch.zeros(())))


def test_unpack_passes_gradients_to_the_scored_positions_only():
    batch = _batch([4, 3], 6)
    (p,) = build_packs(batch, 16)
    v = torch.zeros(p.size, dtype=torch.float64, requires_grad=True)
    p.unpack(v).sum().backward()
    # rows [0 1 2 3][4 5 6]: positions 3 and 6 score the next row's (or no) token, nothing else is cut
    assert v.grad.tolist() == [1, 1, 1, 0, 1, 1, 0]


def test_packed_seq_params_follow_the_thd_contract():
    """What TransformerEngine's THD attention is handed (no TE here, so a contract): megatron-core passes every
    PackedSeqParams field to TE's DotProductAttention as a keyword (megatron/core/extensions/transformer_engine.py
    :715-716 and :760-763, thd with a causal mask becomes padding_causal at :796-801); NeMo-RL builds the same
    object with int32 cu_seqlens, qkv_format "thd" and Python-int max_seqlen (nemo_rl/models/megatron/common.py,
    _pack_sequences_for_megatron), and RoPE's table is max(max_seqlen_q, max_seqlen_kv) long
    (megatron/core/models/common/embeddings/rotary_pos_embedding.py:198-201)."""
    batch = _batch([5, 9, 3, 7], 10)
    for pad in (False, True):
        for p in build_packs(batch, 12, pad_to_longest=pad):
            params = packed_seq_params(p.cu_seqlens.long(), p.max_seqlen)  # int64 in: int32 out
            assert params.qkv_format == "thd"
            assert params.cu_seqlens_q.dtype == params.cu_seqlens_kv.dtype == torch.int32
            assert torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv)
            assert params.cu_seqlens_q[0] == 0 and params.cu_seqlens_q[-1] == p.size  # the tail is a segment too
            assert type(params.max_seqlen_q) is int and params.max_seqlen_q == params.max_seqlen_kv
            assert params.max_seqlen_q == int((params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).max())
            assert params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None


def test_document_causal_mask_by_hand():
    m = document_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 5).int()
    assert m.tolist() == [[1, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0],
                          [0, 0, 1, 0, 0],
                          [0, 0, 1, 1, 0],
                          [0, 0, 1, 1, 1]]


@pytest.mark.parametrize("kernel", ["dense", "flex"])
@pytest.mark.parametrize("heads,groups", [(4, 4), (6, 2)])
def test_packed_attention_equals_each_row_alone(mp_state, kernel, heads, groups):
    """Each row of the pack, attended alone with a causal mask in float64 (GQA: query head i reads group
    i // (heads / groups)), equals its slice of the packed result."""
    g = torch.Generator().manual_seed(heads + groups)
    lens, hn = [3, 6, 1, 5], 8
    t = sum(lens)
    q = torch.randn(t, heads, hn, generator=g, dtype=torch.float64)
    k = torch.randn(t, groups, hn, generator=g, dtype=torch.float64)
    v = torch.randn(t, groups, hn, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist())
    params = packed_seq_params(cu, max(lens))
    with torch.no_grad():  # flex attention has no CPU backward; the dense kernel's is covered by the model test
        out = packed_attention(q, k, v, params, 1 / math.sqrt(hn), kernel=kernel)
    assert out.shape == (t, heads * hn)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qq, kk, vv = q[a:b], k[a:b].repeat_interleave(heads // groups, 1), v[a:b].repeat_interleave(heads // groups, 1)
        s = torch.einsum("qhd,khd->hqk", qq, kk) / math.sqrt(hn)
        s = s.masked_fill(torch.ones(b - a, b - a).triu(1).bool(), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv).reshape(b - a, -1)
        assert (out[a:b] - ref).abs().max() < 1e-12


ARCH = dict(model_type="qwen2", hidden_size=48, num_layers=2, num_attention_heads=6, num_kv_heads=2, head_dim=8,
            ffn_hidden_size=64, vocab_size=50, max_position_embeddings=64, rope_theta=1e4, rms_norm_eps=1e-6,
            tie_word_embeddings=False, qkv_bias=True, qk_norm=False)


@pytest.mark.parametrize("attention,kernel", [("local", "auto"), ("sdpa", "dense"), ("sdpa", "flex")])
def test_megatron_gpt_on_a_pack_equals_each_row_alone_in_float64(mp_state, attention, kernel):
    """megatron-core's GPTModel (the bridge's Qwen2 layer: GQA, QKV bias, RoPE) in float64 on three rows packed
    into one [1, 21] sequence with PackedSeqParams: logits and weight gradients equal those of the rows run one
    by one (positions from 0 each); the same [1, 21] sequence without PackedSeqParams (one causal sequence) does
    not."""
    from laconic_nemo.bridge import ModelArch
    from laconic_nemo.bridge.megatron import build_gpt_model, transformer_config
    from laconic_nemo.runtime.kernels import SDPAttention

    arch = ModelArch(**ARCH)
    torch.manual_seed(0)
    model = build_gpt_model(arch, transformer_config(arch, 1, 1, cpu=True, dtype=torch.float64), attention=attention)
    model.to(torch.float64)  # the norms' weights are created in float32 (the actor casts them the same way)
    lens = [5, 9, 7]
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, arch.vocab_size, (1, n), generator=g) for n in lens]
    weights = [torch.randn(1, n, 128, generator=g, dtype=torch.float64) for n in lens]
    cu = torch.tensor([0, 5, 14, 21])
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    SDPAttention.packed_kernel = kernel
    try:
        if kernel == "flex":  # forward only (no flex backward on CPU)
            with torch.no_grad():
                packed = model(torch.cat(rows, 1), pos, None, packed_seq_params=packed_seq_params(cu, 9))
                alone = torch.cat([model(r, torch.arange(r.shape[1]).unsqueeze(0), None) for r in rows], 1)
            assert (packed - alone).abs().max() < 1e-12
            return

        def grads(logits_fn):
            model.zero_grad()
            logits = logits_fn()
            (logits * torch.cat(weights, 1)).sum().backward()
            return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

        packed, g_packed = grads(lambda: model(torch.cat(rows, 1), pos, None, packed_seq_params=packed_seq_params(cu, 9)))
        alone, g_alone = grads(lambda: torch.cat([model(r, torch.arange(r.shape[1]).unsqueeze(0), None) for r in rows], 1))
        with torch.no_grad():
            causal = model(torch.cat(rows, 1), pos, None)
    finally:
        SDPAttention.packed_kernel = "auto"
    assert (packed - alone).abs().max() < 1e-12
    assert max(float((g_packed[n] - g_alone[n]).abs().max()) for n in g_alone) < 1e-12
    assert (causal - alone)[:, 5:].abs().max() > 1e-3  # the later rows need the document mask


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_grpo_loss_over_packs_equals_the_padded_batch_in_float64(mp_state, aggregation):
    """The GRPO loss summed over packs (each pack's log-probs cut back into rows and handed to the loss with the
    pack's rows of the batch) equals the loss of the padded batch, value and weight gradients, in float64 through
    megatron-core's GPTModel, for both aggregations over the global token / sequence counts."""
    from laconic_nemo.bridge import ModelArch
    from laconic_nemo.bridge.megatron import build_gpt_model, transformer_config
    from laconic_nemo.grpo.loss import make_grpo_loss_fn

    arch = ModelArch(**ARCH)
    torch.manual_seed(1)
    model = build_gpt_model(arch, transformer_config(arch, 1, 1, cpu=True, dtype=torch.float64), attention="sdpa")
    model.to(torch.float64)
    g = torch.Generator().manual_seed(7)
    n, T = 6, 14
    prompt = torch.randint(2, 6, (n,), generator=g)
    resp = torch.stack([torch.randint(1, T - int(p) + 1, (1,), generator=g)[0] for p in prompt])
    tokens = torch.randint(0, arch.vocab_size, (n, T), generator=g)
    mask = torch.zeros(n, T - 1, dtype=torch.float64)
    for i in range(n):
        mask[i, int(prompt[i]) - 1 : int(prompt[i] + resp[i]) - 1] = 1.0
    batch = TrainBatch(tokens, prompt, resp, mask, advantages=torch.randn(n, generator=g, dtype=torch.float64),
                       old_logprobs=(-3.0 + 0.3 * torch.randn(n, T - 1, generator=g, dtype=torch.float64)) * mask)
    fn = make_grpo_loss_fn(0.2, 0.28, 0.0, aggregation, float(mask.sum()), float(n))

    def next_token_logprobs(logits, tok):  # [b, s, V] -> [b, s-1]
        return torch.log_softmax(logits[:, :-1, : arch.vocab_size], -1).gather(-1, tok[:, 1:, None])[..., 0]

    model.zero_grad()
    padded, _ = fn(next_token_logprobs(model(tokens, torch.arange(T).expand(n, T), None), tokens), batch)
    padded.backward()
    g_padded = {k: p.grad.clone() for k, p in model.named_parameters()}

    model.zero_grad()
    packs = build_packs(batch, 24)
    assert len(packs) >= 2
    total = 0.0
    for p in packs:
        logits = model(p.tokens, p.position_ids, None, packed_seq_params=packed_seq_params(p.cu_seqlens, p.max_seqlen))
        lp = torch.log_softmax(logits[0, :, : arch.vocab_size], -1).gather(-1, torch.roll(p.tokens[0], -1)[:, None])[:, 0]
        loss, _ = fn(p.unpack(lp), p.batch)
        loss.backward()
        total = total + float(loss)
    assert abs(total - float(padded)) < 1e-12
    assert max(float((p.grad - g_padded[k]).abs().max()) for k, p in model.named_parameters()) < 1e-12
