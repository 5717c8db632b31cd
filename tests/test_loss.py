"""GRPO / SFT loss against a float64 element-by-element reference and hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from laconic_nemo.grpo.interfaces import TrainBatch
from laconic_nemo.grpo.loss import grpo_token_loss, make_grpo_loss_fn, make_sft_loss_fn


def _reference_objective(logp, old, adv, mask, ref, eps_low, eps_high, beta, aggregation, n_tok, n_seq):
    """Plain-python float64 loop over tokens (independent of the vectorised implementation)."""
    total = 0.0
    rows = []
    for i in range(len(logp)):
        row_sum, row_n = 0.0, 0.0
        for t in range(len(logp[i])):
            if mask[i][t] == 0:
                continue
            r = math.exp(logp[i][t] - old[i][t])
            a = adv[i]
            rc = min(max(r, 1 - eps_low), 1 + eps_high)
            v = -min(r * a, rc * a)
            if beta > 0:
                d = ref[i][t] - logp[i][t]
                v += beta * (math.exp(d) - d - 1)
            row_sum += v
            row_n += 1
        rows.append((row_sum, row_n))
    if aggregation == "token_mean":
        total = sum(s for s, _ in rows) / n_tok
    else:
        total = sum(s / max(n, 1.0) for s, n in rows) / n_seq
    return total


def _random_case(seed, n=5, tm1=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, tm1, generator=g, dtype=torch.float64) * 3
    old = logp + 0.4 * torch.randn(n, tm1, generator=g, dtype=torch.float64)  # ratios well outside 1±0.2
    ref = logp + 0.3 * torch.randn(n, tm1, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.zeros(n, tm1, dtype=torch.float64)
    for i in range(n):
        start = int(torch.randint(0, 3, (1,), generator=g))
        length = int(torch.randint(1, tm1 - start + 1, (1,), generator=g))
        mask[i, start : start + length] = 1.0
    old = torch.where(mask > 0, old, torch.zeros_like(old))  # convention: 0 off the mask
    ref = torch.where(mask > 0, ref, torch.zeros_like(ref))
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("eps_high,beta", [(None, 0.0), (0.28, 0.0), (None, 0.1), (0.28, 0.05)])
def test_loss_matches_float64_reference_and_gradient(aggregation, eps_high, beta):
    for seed in range(3):
        logp, old, ref, adv, mask = _random_case(seed)
        n_tok, n_seq = float(mask.sum()) * 2.5, 13.0  # global counts larger than this micro-batch
        fn = make_grpo_loss_fn(0.2, eps_high, beta, aggregation, n_tok, n_seq)
        batch = TrainBatch(
            tokens=torch.zeros(5, 8, dtype=torch.long),
            prompt_lengths=torch.ones(5, dtype=torch.long),
            response_lengths=torch.ones(5, dtype=torch.long),
            response_mask=mask,
            advantages=adv,
            old_logprobs=old,
            ref_logprobs=ref,
        )
        x = logp.clone().requires_grad_(True)
        loss, metrics = fn(x, batch)
        e_high = 0.2 if eps_high is None else eps_high
        expected = _reference_objective(
            logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), ref.tolist(), 0.2, e_high, beta,
            aggregation, n_tok, n_seq,
        )
        assert float(loss.detach()) == pytest.approx(expected, rel=1e-12, abs=1e-14)
        assert metrics["loss"] == pytest.approx(expected, rel=1e-12, abs=1e-14)
        # gradient against finite differences of the float64 reference
        loss.backward()
        h = 1e-6
        for i, t in [(0, 0), (1, 3), (2, 5), (4, 2), (3, 6)]:
            lp = logp.clone()
            lp[i, t] += h
            up = _reference_objective(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), ref.tolist(),
                                      0.2, e_high, beta, aggregation, n_tok, n_seq)
            lp[i, t] -= 2 * h
            dn = _reference_objective(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), ref.tolist(),
                                      0.2, e_high, beta, aggregation, n_tok, n_seq)
            assert float(x.grad[i, t]) == pytest.approx((up - dn) / (2 * h), rel=1e-5, abs=1e-9)
        assert torch.all(x.grad[mask == 0] == 0)


def test_float32_gradient_matches_float64_autograd():
    logp, old, ref, adv, mask = _random_case(7)
    fn = make_grpo_loss_fn(0.2, 0.3, 0.05, "seq_mean_token_mean", float(mask.sum()), 5.0)
    b64 = TrainBatch(torch.zeros(5, 8, dtype=torch.long), torch.ones(5), torch.ones(5), mask, adv, old, ref)
    x64 = logp.clone().requires_grad_(True)
    fn(x64, b64)[0].backward()
    b32 = TrainBatch(b64.tokens, b64.prompt_lengths, b64.response_lengths, mask.float(), adv.float(), old.float(),
                     ref.float())
    x32 = logp.float().requires_grad_(True)
    fn(x32, b32)[0].backward()
    torch.testing.assert_close(x32.grad.double(), x64.grad, rtol=1e-5, atol=1e-7)


def test_hand_worked_values():
    # ratio e^{0.5}=1.6487 > 1.2 with A=+1: clipped term 1.2 is active -> loss -1.2, zero gradient.
    # ratio e^{-0.5}=0.6065 < 0.8 with A=+1: min(0.6065, 0.8) = unclipped -> loss -0.6065, grad -0.6065.
    # ratio 1 with A=-2: loss +2, grad +2.
    # ratio e^{0.5} with A=-1: min(-1.6487, -1.2) = -1.6487 -> loss 1.6487 (unclipped, pessimistic).
    logp = torch.tensor([[0.5, -0.5, 0.0, 0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 4, dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    per_token, parts = grpo_token_loss(logp, old, adv, mask, clip_eps=0.2)
    e = math.exp(0.5)
    torch.testing.assert_close(per_token, torch.tensor([[-1.2, -1 / e, 2.0, e]], dtype=torch.float64))
    torch.testing.assert_close(parts["clipped"], torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64))
    per_token.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1 / e, 2.0, e]], dtype=torch.float64))
    # clip-higher: upper clip 1+0.7 > e^{0.5} -> first token no longer clipped.
    per_token_h, parts_h = grpo_token_loss(logp.detach(), old, adv, mask, clip_eps=0.2, clip_eps_high=0.7)
    assert float(per_token_h[0, 0]) == pytest.approx(-e)
    assert float(parts_h["clipped"][0, 0]) == 0.0
    # k3 KL: ref - logp = d -> e^d - d - 1; d = 1 -> e - 2; d = 0 -> 0.
    lp = torch.tensor([[0.0, -1.0]], dtype=torch.float64)
    _, parts_kl = grpo_token_loss(lp, lp, torch.zeros(1), torch.ones(1, 2), ref_logprobs=torch.tensor([[1.0, -1.0]]),
                                  kl_beta=0.1)
    torch.testing.assert_close(parts_kl["kl"], torch.tensor([[math.e - 2, 0.0]], dtype=torch.float64))


def test_aggregations_hand_worked():
    # two sequences, per-token loss = -A (ratio 1): seq 0 has 1 token (A=1), seq 1 has 3 tokens (A=3)
    logp = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]], dtype=torch.float64)
    batch = TrainBatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2), torch.ones(2), mask,
                       torch.tensor([1.0, 3.0], dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64))
    tok = make_grpo_loss_fn(aggregation="token_mean", global_num_tokens=4.0, global_num_seqs=2.0)(logp, batch)[0]
    assert float(tok) == pytest.approx(-(1 + 9) / 4)
    seq = make_grpo_loss_fn(aggregation="seq_mean_token_mean", global_num_tokens=4.0, global_num_seqs=2.0)(logp,
                                                                                                          batch)[0]
    assert float(seq) == pytest.approx(-(1 + 3) / 2)


def test_split_into_micro_batches_sums_to_global():
    logp, old, ref, adv, mask = _random_case(3, n=6)
    n_tok, n_seq = float(mask.sum()), 6.0
    for agg in ("token_mean", "seq_mean_token_mean"):
        fn = make_grpo_loss_fn(0.2, None, 0.1, agg, n_tok, n_seq)
        full = TrainBatch(torch.zeros(6, 8, dtype=torch.long), torch.ones(6), torch.ones(6), mask, adv, old, ref)
        whole, m_whole = fn(logp, full)
        parts = [fn(logp[s], full.select(s)) for s in (slice(0, 2), slice(2, 5), slice(5, 6))]
        assert float(sum(p[0] for p in parts)) == pytest.approx(float(whole), rel=1e-12)
        for k in m_whole:
            assert sum(p[1][k] for p in parts) == pytest.approx(m_whole[k], rel=1e-10, abs=1e-14)
    assert 0.0 < m_whole["clip_fraction"] < 1.0


def test_sft_loss_and_errors():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]], dtype=torch.float64))
    mask = torch.tensor([[0.0, 1.0, 1.0]], dtype=torch.float64)
    batch = TrainBatch(torch.zeros(1, 4, dtype=torch.long), torch.ones(1), torch.ones(1), mask)
    loss, m = make_sft_loss_fn(4.0)(logp, batch)
    assert float(loss) == pytest.approx(-(math.log(0.25) + math.log(0.9)) / 4)
    with pytest.raises(ValueError, match="aggregation"):
        make_grpo_loss_fn(aggregation="mean", global_num_tokens=1.0, global_num_seqs=1.0)
    with pytest.raises(ValueError, match="global_num_tokens"):
        make_grpo_loss_fn(global_num_tokens=0.0, global_num_seqs=1.0)
    with pytest.raises(ValueError, match="clip_eps"):
        grpo_token_loss(logp, logp, torch.zeros(1), mask, clip_eps=0.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_token_loss(logp, logp, torch.zeros(1), mask, kl_beta=0.1)


def test_off_mask_garbage_stays_finite():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -500.0]])  # exp(logp - old) would overflow off the mask
    per_token, _ = grpo_token_loss(logp, old, torch.ones(1), torch.tensor([[1.0, 0.0]]))
    per_token.sum().backward()
    assert torch.isfinite(per_token).all() and torch.isfinite(logp.grad).all()


def _easyr1_dual_clip_token(lp, old, a, low, high, dual):
    """EasyR1 v0.3.2.dev0 verl/trainer/core_algos.py::compute_policy_loss for one token, in Python floats."""
    nkl = lp - old
    ratio = math.exp(nkl)
    clipped_ratio = math.exp(min(max(nkl, math.log(1.0 - low)), math.log(1.0 + high)))
    pg1, pg2, pg3 = -a * ratio, -a * clipped_ratio, -a * dual
    higher = max(pg1, pg2)
    return min(higher, pg3) if a < 0 else higher


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_dual_clip_matches_easyr1_float64_reference_and_gradient(aggregation):
    """clip 0.2 / clip-high 0.3 / dual-clip 3.0 (EasyR1's defaults) against a float64 transcription of EasyR1's
    compute_policy_loss; ratios up to e^2 so that the dual bound C |A| is active for some A < 0 tokens."""
    n, tm1 = 6, 9
    g = torch.Generator().manual_seed(11)
    logp = -torch.rand(n, tm1, generator=g, dtype=torch.float64) * 3
    old = logp - 2.0 * torch.rand(n, tm1, generator=g, dtype=torch.float64) + 0.3
    adv = torch.tensor([-1.3, 0.7, -0.4, 1.1, -2.0, 0.0], dtype=torch.float64)
    mask = torch.ones(n, tm1, dtype=torch.float64)
    mask[2, 6:] = 0
    mask[5, :4] = 0
    old = torch.where(mask > 0, old, torch.zeros_like(old))
    n_tok, n_seq = float(mask.sum()), float(n)
    fn = make_grpo_loss_fn(0.2, 0.3, 0.0, aggregation, n_tok, n_seq, clip_dual=3.0)
    batch = TrainBatch(torch.zeros(n, tm1 + 1, dtype=torch.long), torch.ones(n, dtype=torch.long),
                       torch.ones(n, dtype=torch.long), mask, adv, old, None)

    def reference(lp_rows):
        rows = []
        for i in range(n):
            vals = [_easyr1_dual_clip_token(lp_rows[i][t], float(old[i, t]), float(adv[i]), 0.2, 0.3, 3.0)
                    for t in range(tm1) if mask[i, t] > 0]
            rows.append((math.fsum(vals), len(vals)))
        if aggregation == "token_mean":
            return math.fsum(s for s, _ in rows) / n_tok
        return math.fsum(s / max(c, 1) for s, c in rows) / n_seq

    x = logp.clone().requires_grad_(True)
    loss, _ = fn(x, batch)
    assert float(loss.detach()) == pytest.approx(reference(logp.tolist()), rel=1e-12, abs=1e-14)
    _, parts = grpo_token_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.3, clip_dual=3.0)
    assert parts["dual_clipped"].sum() > 0, "the case must exercise the dual bound"
    no_dual, _ = grpo_token_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.3)
    with_dual, _ = grpo_token_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.3, clip_dual=3.0)
    assert (with_dual < no_dual).any() and (with_dual <= no_dual).all()
    loss.backward()
    h = 1e-6
    for i in range(n):
        for t in range(tm1):
            lp = logp.clone()
            lp[i, t] += h
            up = reference(lp.tolist())
            lp[i, t] -= 2 * h
            dn = reference(lp.tolist())
            assert float(x.grad[i, t]) == pytest.approx((up - dn) / (2 * h), rel=1e-5, abs=1e-9)
    assert torch.all(x.grad[parts["dual_clipped"] > 0] == 0)


def test_dual_clip_must_exceed_one():
    logp, old, ref, adv, mask = _random_case(1)
    with pytest.raises(ValueError, match="clip_dual"):
        grpo_token_loss(logp, old, adv, mask, clip_dual=1.0)
