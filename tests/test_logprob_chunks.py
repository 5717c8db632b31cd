"""The chunked log-probs both actors take (``laconic_nemo.actors.megatron_logprobs.chunked_token_logprobs``): their
gradient equals the unchunked computation's, element for element, and their backward allocates one gradient of the
logits' size, not one per chunk (the backward of a slice ``logits[:, a:a + chunk]`` allocates a zero-filled tensor of
the whole ``[b, s, V]`` logits and adds it into the gradient: 16 chunks, 16 such tensors). Allocations counted from
the profiler's memory events (``laconic_nemo.runtime.host_memory``), not timed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from laconic_nemo.actors.megatron_logprobs import chunked_token_logprobs  # noqa: E402
from laconic_nemo.runtime.host_memory import host_allocations  # noqa: E402


@pytest.fixture(scope="module")
def tp1():
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    init_distributed(1, 1, backend="gloo", seed=0)
    yield
    destroy_distributed()


def _inputs(b: int, s: int, v: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, s, v, generator=g) * 3).to(dtype)
    labels = torch.randint(0, v - 3, (b, s), generator=g)
    weights = torch.randn(b, s, generator=g)  # d loss / d log p of every token
    return logits, labels, weights


def _grad(logits, labels, weights, chunk, vocab, temperature):
    leaf = logits.clone().requires_grad_(True)
    lp = chunked_token_logprobs(leaf, labels, chunk, vocab, 0, temperature)
    (grad,) = torch.autograd.grad((lp * weights).sum(), leaf)
    return lp.detach(), grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradient_equal_the_unchunked_computation(tp1, dtype, temperature):
    """Chunks of 5 positions over 37 (the last one short), 3 padding columns of the vocabulary: the log-probs and the
    logits' gradient equal those of one chunk over the whole sequence exactly, and float64 log_softmax's closely."""
    logits, labels, weights = _inputs(3, 37, 50, dtype)
    vocab = 47
    lp, grad = _grad(logits, labels, weights, 5, vocab, temperature)
    lp_whole, grad_whole = _grad(logits, labels, weights, 37, vocab, temperature)
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert torch.equal(lp, lp_whole)
    assert torch.equal(grad, grad_whole)

    ref_leaf = logits.double().requires_grad_(True)
    ref = torch.log_softmax(ref_leaf[..., :vocab] / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)
    (ref * weights.double()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(lp.double(), ref.detach(), atol=tol * 10)
    assert torch.allclose(grad.double(), ref_leaf.grad, atol=tol)
    assert not grad[..., vocab:].any()  # the padding columns get no gradient


def test_chunked_logprobs_without_autograd_equal_those_with_it(tp1):
    logits, labels, weights = _inputs(2, 23, 40, torch.float32, seed=3)
    with torch.no_grad():
        plain = chunked_token_logprobs(logits, labels, 4, 38, 0)
    lp, _ = _grad(logits, labels, weights, 4, 38, 1.0)
    assert torch.equal(plain, lp)
    assert torch.equal(logits, _inputs(2, 23, 40, torch.float32, seed=3)[0])  # the logits are left as they were


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprob_backward_allocates_one_logit_sized_gradient(tp1, dtype):
    """16 chunks of [4, 4, 1000] out of [4, 64, 1000] logits: the backward allocates exactly one tensor of the
    logits' size (their gradient) and holds at most that plus a few chunks' float32 workspaces at once. Each
    sliced chunk's backward allocated a zero-filled [4, 64, 1000] tensor (16 of them) beside the gradient."""
    logits, labels, weights = _inputs(4, 64, 1000, dtype, seed=1)
    leaf = logits.clone().requires_grad_(True)
    lp = chunked_token_logprobs(leaf, labels, 4, 1000, 0)
    loss = (lp * weights).sum()
    with host_allocations() as trace:
        (grad,) = torch.autograd.grad(loss, leaf)
    full = leaf.nbytes
    chunk_fp32 = 4 * 4 * 1000 * 4  # one chunk's float32 logits
    assert grad.nbytes == full
    assert trace.count_at_least(full) == 1, trace.changes
    assert full <= trace.peak_bytes <= full + 8 * chunk_fp32, (trace.peak_bytes, full)
