"""The packed-attention path a GPU takes, checked on CPU (laconic_nemo.runtime.kernels).

* The call forms of ``torch.nn.attention.varlen.varlen_attn`` (a contract: its signature in the releases this
  project targets, the form read from it, and the adapter's call in each form against a float64 per-row reference).
* The flex fallback's BlockMask, built from the row boundaries without ``create_block_mask``, equals the one
  ``create_block_mask`` builds from the document-causal mask, and the fallback's output equals the reference.
* The guard: the actor's packed log-probs and training step for several pack sizes, through the kernel the
  selection picks on a GPU (its ``varlen_attn`` replaced by a stand-in on the dense reference where CPU torch has no
  kernel), compile nothing per micro-batch and read no ``cu_seqlens`` back to the host (megatron-core 0.11's
  unfused THD RoPE did: ``rope_utils.py:162``; ``create_block_mask(..., _compile=True)`` compiled per
  micro-batch on the first GPU run).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from laconic_nemo.runtime import kernels
from laconic_nemo.runtime.kernels import VarlenForm, packed_attention, packed_seq_params, varlen_form


@pytest.fixture(scope="module")
def mp_state():
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    init_distributed(1, 1, backend="gloo", seed=0)
    yield
    destroy_distributed()


# ------------------------------------------------------------------------------------------------ varlen_attn forms
# The public signature in each release (torch/nn/attention/varlen.py of the release's wheel):
#   2.10.0  varlen.py:127-137  (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
#                                return_aux=None); scale fixed at 1 / sqrt(D) (_flash_attention_forward at :75-86
#                                passes none); no head-count check (the kernel takes Hq a multiple of Hkv)
#   2.11.0  varlen.py:159-171  (..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1)); causal is
#                                ``window_size == (-1, 0)`` (:237, a tuple comparison: a list would not be causal)
#   2.12.0, 2.12.1  varlen.py:185-201 (the two releases' varlen.py are the same file): (..., window_size=(-1, -1),
#                                enable_gqa=False, seqused_k=None, block_table=None, num_splits=None); Hq != Hkv
#                                without enable_gqa raises (:304-309); causal at :316
#   2.13.0  varlen.py:176-192  the 2.12 form; Hq != Hkv without enable_gqa raises (:295-300); causal at :307
#   main    pytorch/pytorch 000459dc (a snapshot of main), def varlen_attn: the 2.11 form plus k_cache, v_cache,
#                                cache_seqlens, cache_batch_idx, page_table, seqused_k; causal ``window_size == (-1, 0)``
def sig_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _dense_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None, gqa=True)


def sig_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1)):
    return _dense_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale, gqa=True)


def sig_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    if not enable_gqa and query.size(1) != key.size(1):
        raise ValueError("Expect query and key/value to have the same number of heads (stand-in of 2.12 varlen.py:304, 2.13 :295)")
    return _dense_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale, gqa=True)


def sig_main(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
             window_size=(-1, -1), k_cache=None, v_cache=None, cache_seqlens=None, cache_batch_idx=None,
             page_table=None, seqused_k=None):
    return _dense_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale, gqa=True)


CALLS: list[dict] = []  # what the stand-ins were handed


def _dense_varlen(query, key, value, cu_q, cu_k, max_q, max_k, causal, scale, gqa):
    """A varlen_attn on the dense reference (CPU has no FlashAttention): [t, Hq, D] out of [t, H, D] inputs."""
    assert type(max_q) is int and type(max_k) is int, "max_q / max_k are Python ints (no host read)"
    assert cu_q.dtype == torch.int32 and cu_k is cu_q
    CALLS.append({"cu": cu_q, "max": max_q, "causal": causal, "scale": scale})
    if not causal:
        raise AssertionError("the packed path is causal inside every row")
    t, h, d = query.shape
    mask = kernels.document_causal_mask(cu_q, t)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.permute(1, 0, 2), key.permute(1, 0, 2), value.permute(1, 0, 2), attn_mask=mask,
        scale=scale, enable_gqa=h != key.shape[1])
    return out.permute(1, 0, 2)


STANDINS = {"2.10": (sig_2_10, VarlenForm("is_causal", False, False)),
            "2.11": (sig_2_11, VarlenForm("window_size", True, False)),
            "2.12": (sig_2_12, VarlenForm("window_size", True, True)),  # 2.12 on (2.13 too)
            "main": (sig_main, VarlenForm("window_size", True, False))}


def test_installed_varlen_attn_is_a_cited_form():
    """The torch installed here has varlen_attn (2.10 on) with one of the cited signatures, read as that form."""
    fn = kernels.torch_varlen_attn()
    assert fn is not None, f"torch {torch.__version__}: torch.nn.attention.varlen.varlen_attn is missing"
    names = list(inspect.signature(fn).parameters)
    cited = {release: list(inspect.signature(s).parameters) for release, (s, _) in STANDINS.items()}
    release = next((r for r, params in cited.items() if params == names), None)
    assert release is not None, f"varlen_attn{inspect.signature(fn)} is none of the cited forms {cited}"
    assert varlen_form(fn) == STANDINS[release][1]
    if torch.__version__.startswith(("2.12.", "2.13.")):
        assert release == "2.12"
    # keyword-only from 2.11 on: the adapter passes everything past max_k by keyword
    kinds = inspect.signature(fn).parameters
    assert all(kinds[n].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for n in kernels.VARLEN_HEAD)


def test_the_kernels_docs_name_the_first_release_with_enable_gqa():
    """``enable_gqa=`` and the head-count check arrive with the 2.12 signature (torch 2.12.0 and 2.12.1
    ``varlen.py:197`` and ``:304``; 2.11.0 has neither): the first cited release whose form takes it is the one
    ``VarlenForm``'s docstring names, with its lines."""
    releases = sorted((r for r in STANDINS if r != "main"), key=lambda r: tuple(map(int, r.split("."))))
    first = next(r for r in releases if STANDINS[r][1].enable_gqa)
    assert first == "2.12"
    doc = " ".join(kernels.VarlenForm.__doc__.split())
    assert f"refuses fewer key-value heads without it ({first} on;" in doc, doc
    assert "2.12.0 and 2.12.1 ``:185-201``, the head check ``:304-314``, causal ``:316``" in doc, doc


def test_varlen_form_by_signature_not_version():
    for release, (fn, form) in STANDINS.items():
        assert varlen_form(fn) == form, release

    def other(q, k, v, cu_seqlens, max_seqlen, causal=True):  # another head: not called
        raise AssertionError

    def no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        raise AssertionError

    assert varlen_form(other) is None and varlen_form(no_causal) is None and varlen_form(None) is None


def _rows_reference(q, k, v, cu, scale):
    """Each row attended alone, causal, float64, GQA by repetition: [t, Hq * D]."""
    heads, groups = q.shape[1], k.shape[1]
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        kk = k[a:b].repeat_interleave(heads // groups, 1)
        vv = v[a:b].repeat_interleave(heads // groups, 1)
        s = torch.einsum("qhd,khd->hqk", q[a:b], kk) * scale
        s = s.masked_fill(torch.ones(b - a, b - a).triu(1).bool(), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv).reshape(b - a, -1))
    return torch.cat(out)


@pytest.mark.parametrize("release", sorted(STANDINS))
@pytest.mark.parametrize("scale_factor", [1.0, 0.5])  # 0.5: a softmax scale other than 1 / sqrt(D)
def test_varlen_adapter_in_every_form_equals_rows_alone(release, scale_factor, monkeypatch):
    fn, _ = STANDINS[release]
    monkeypatch.setattr(kernels, "torch_varlen_attn", lambda: fn)
    g = torch.Generator().manual_seed(5)
    lens, heads, groups, hn = [3, 6, 1, 5], 6, 2, 8
    t = sum(lens)
    q, k, v = (torch.randn(t, h, hn, generator=g, dtype=torch.float64) for h in (heads, groups, groups))
    cu = torch.tensor([0, 3, 9, 10, 15], dtype=torch.int32)
    scale = scale_factor / math.sqrt(hn)
    CALLS.clear()
    out = packed_attention(q, k, v, packed_seq_params(cu, max(lens)), scale, kernel="varlen")
    assert len(CALLS) == 1 and CALLS[0]["max"] == 6
    assert CALLS[0]["scale"] == (scale if release != "2.10" else None)  # 2.10: the query is pre-scaled instead
    assert (out - _rows_reference(q, k, v, cu, scale)).abs().max() < 1e-12


# ------------------------------------------------------------------------------------------------ flex fallback
@pytest.mark.parametrize("lens", [[3, 6, 1, 5], [130, 2, 200, 1, 60], [256, 256], [1], [129, 127, 300]])
def test_rows_block_mask_equals_create_block_mask(lens):
    from torch.nn.attention.flex_attention import create_block_mask

    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lens), 0).tolist(), dtype=torch.int32)
    size = kernels.flex_padded_size(sum(lens))
    assert size >= sum(lens) and size % kernels.FLEX_BLOCK == 0
    mine = kernels.rows_block_mask(cu, size)
    doc = kernels.document_ids(cu, size)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    ref = create_block_mask(mask_mod, None, None, size, size, device="cpu", _compile=False)
    assert torch.equal(mine.to_dense(), ref.to_dense())  # the same partial and full blocks
    assert torch.equal(mine.kv_num_blocks, ref.kv_num_blocks) and torch.equal(mine.full_kv_num_blocks,
                                                                                ref.full_kv_num_blocks)


def test_flex_padded_sizes_are_few():
    sizes = {kernels.flex_padded_size(n) for n in range(1, 20000, 37)}
    assert sizes == {2048, 4096, 8192, 16384, 32768}


def test_flex_fallback_equals_rows_alone():
    g = torch.Generator().manual_seed(9)
    lens, heads, groups, hn = [5, 300, 7], 4, 2, 8
    t = sum(lens)
    q, k, v = (torch.randn(t, h, hn, generator=g, dtype=torch.float64) for h in (heads, groups, groups))
    cu = torch.tensor([0, 5, 305, 312], dtype=torch.int32)
    with torch.no_grad():  # flex attention has no CPU backward
        out = packed_attention(q, k, v, packed_seq_params(cu, 300), 1 / math.sqrt(hn), kernel="flex")
    assert (out - _rows_reference(q, k, v, cu, 1 / math.sqrt(hn))).abs().max() < 1e-12


# ------------------------------------------------------------------------------------------------ the guard
HOST_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__index__", "__bool__", "__float__", "__array__")


class HostWatch(torch.Tensor):
    """Row boundaries that record every read back to the host (on a GPU each one is a synchronisation) of
    themselves and of every integer / bool tensor computed from them (a float result - attention output - is
    a plain tensor again, so the loss's reads do not count)."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            cls.reads.append(name)
        out = super().__torch_function__(func, types, args, kwargs or {})
        return _plain_unless_index(out)


def _plain_unless_index(x):
    if isinstance(x, HostWatch) and (x.is_floating_point() or x.is_complex()):
        return x.as_subclass(torch.Tensor)
    if isinstance(x, (tuple, list)):
        return type(x)(_plain_unless_index(y) for y in x)
    return x


for _name in HOST_READS:  # methods that bypass __torch_function__ (int(t), bool(t), ...) are counted here
    if hasattr(torch.Tensor, _name):
        def _reader(self, *a, _name=_name, **kw):
            HostWatch.reads.append(_name)
            return getattr(torch.Tensor, _name)(self.as_subclass(torch.Tensor), *a, **kw)
        setattr(HostWatch, _name, _reader)


ARCH = dict(model_type="qwen2", hidden_size=48, num_layers=2, num_attention_heads=6, num_kv_heads=2, head_dim=8,
            ffn_hidden_size=64, vocab_size=50, max_position_embeddings=256, rope_theta=1e4, rms_norm_eps=1e-6,
            tie_word_embeddings=False, qkv_bias=True, qk_norm=False)


def _actor(budget: int):
    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.bridge import ModelArch
    from laconic_nemo.bridge.megatron import actor_kwargs
    from laconic_nemo.runtime.megatron_env import parallel_info

    torch.manual_seed(0)
    kw = actor_kwargs(ModelArch(**ARCH), 1, 1, cpu=True, dtype=torch.float32, attention="sdpa")
    return MegatronCoreActor(parallel_info(1, 1), **kw, lr=1e-3, micro_batch_size=2, kl_beta=0.0,
                             micro_batch_tokens=budget)


def _batch(n: int, T: int, seed: int):
    from laconic_nemo.grpo.interfaces import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, 5, (n,), generator=g)
    resp = torch.stack([torch.randint(1, T - int(p) + 1, (1,), generator=g)[0] for p in prompt])
    tokens = torch.randint(0, ARCH["vocab_size"], (n, T), generator=g)
    mask = torch.zeros(n, T - 1)
    for i in range(n):
        mask[i, int(prompt[i]) - 1 : int(prompt[i] + resp[i]) - 1] = 1.0
    return TrainBatch(tokens, prompt, resp, mask, advantages=torch.randn(n, generator=g), old_logprobs=-3.0 * mask)


class CompileWatch:
    """Counts torch.compile and create_block_mask calls and dynamo's captured graphs while active."""

    def __init__(self, monkeypatch):
        from torch._dynamo.utils import counters
        from torch.nn.attention import flex_attention as fa

        self.counters, self.compiles, self.block_masks, self.paused = counters, [], [], False
        real_compile, real_cbm = torch.compile, fa.create_block_mask

        def compile_(*a, **k):
            if not self.paused:  # paused: inside a stand-in of a kernel (CPU flex compiles its own eager wrapper)
                self.compiles.append(a)
            return real_compile(*a, **k)

        monkeypatch.setattr(torch, "compile", compile_)
        monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: self.block_masks.append(a) or real_cbm(*a, **k))
        self.graphs0 = sum(counters["stats"].values())

    def graphs(self) -> int:
        return sum(self.counters["stats"].values()) - self.graphs0


def _watched_params(monkeypatch):
    """megatron_schedule's packed_seq_params with the row boundaries wrapped in HostWatch (the device copy the
    model sees); returns the list of boundaries handed out."""
    from laconic_nemo.actors import megatron_schedule

    seen = []

    def watched(cu_seqlens, max_seqlen, position_ids=None):
        cu = cu_seqlens.as_subclass(HostWatch)
        seen.append(cu)
        return kernels.packed_seq_params(cu, max_seqlen, position_ids=position_ids)

    monkeypatch.setattr(megatron_schedule, "packed_seq_params", watched)
    return seen


@pytest.mark.parametrize("release", ["2.10", "2.12"])
def test_gpu_packed_path_never_compiles_nor_reads_cu_seqlens_on_the_host(mp_state, monkeypatch, release):
    """Log-probs and a training step over packs of several sizes through the kernel a GPU chooses (varlen_attn,
    here a stand-in of the release's signature on the dense reference): no torch.compile, no create_block_mask,
    no dynamo graph, no cu_seqlens read back to the host - and the same numbers as the CPU's dense kernel."""
    from laconic_nemo.grpo.loss import make_grpo_loss_fn
    from laconic_nemo.runtime.kernels import SDPAttention

    monkeypatch.setattr(kernels, "torch_varlen_attn", lambda: STANDINS[release][0])
    gpu_kernel = kernels.choose_packed_kernel(on_gpu=True, dtype=torch.bfloat16, capability=(9, 0))
    assert gpu_kernel == "varlen"
    actor = _actor(budget=40)
    batch = _batch(10, 24, seed=3)
    assert len({p.size for p in actor.batches.packs(batch)}) >= 3  # several pack sizes in one call
    monkeypatch.setattr(SDPAttention, "packed_kernel", "dense")
    dense_lp = actor.logprobs(batch)

    watch = CompileWatch(monkeypatch)
    seen = _watched_params(monkeypatch)
    HostWatch.reads.clear()
    CALLS.clear()
    monkeypatch.setattr(SDPAttention, "packed_kernel", gpu_kernel)
    lp = actor.logprobs(batch)
    fn = make_grpo_loss_fn(0.2, 0.28, 0.0, "token_mean", float(batch.response_mask.sum()), float(len(batch)))
    actor.train_step(batch, fn)
    actor.train_step(_batch(7, 30, seed=4), fn)  # another batch: other pack sizes

    assert len(seen) >= 8  # a micro-batch each: 5 packs of the log-probs, as many of the first step, more
    assert CALLS and all(isinstance(c["cu"], HostWatch) for c in CALLS)  # the kernel got the watched boundaries
    assert len(CALLS) == 2 * len(seen)  # one call per layer and pack (forward; megatron recomputes none here)
    assert HostWatch.reads == [], f"cu_seqlens read back to the host: {HostWatch.reads}"
    assert watch.compiles == [] and watch.block_masks == [] and watch.graphs() == 0
    assert (lp - dense_lp).abs().max() < 1e-5


def test_flex_fallback_compiles_per_padded_size_only(mp_state, monkeypatch):
    """Without varlen_attn (torch < 2.10) the GPU takes the flex fallback: no create_block_mask, no cu_seqlens
    read on the host, and the (compiled, on a GPU) kernel sees only the padded sizes: with the smallest padded size
    at 256 here (2048 on a GPU), 256 for every pack."""
    from torch.nn.attention.flex_attention import flex_attention

    from laconic_nemo.runtime.kernels import SDPAttention

    monkeypatch.setattr(kernels, "torch_varlen_attn", lambda: None)
    gpu_kernel = kernels.choose_packed_kernel(on_gpu=True, dtype=torch.bfloat16, capability=(9, 0))
    assert gpu_kernel == "flex"
    shapes = []

    def recorded(q, k, v, **kw):  # the compiled kernel's stand-in: flex_attention as CPU runs it
        shapes.append(tuple(q.shape))
        watch.paused = True
        try:
            return flex_attention(q, k, v, **kw)
        finally:
            watch.paused = False

    monkeypatch.setattr(kernels, "_flex_attention_fn", lambda device: recorded)
    monkeypatch.setattr(kernels, "FLEX_MIN_PADDED", 256)  # CPU's flex materialises the scores: keep them small
    actor = _actor(budget=40)
    batch = _batch(10, 24, seed=3)
    watch = CompileWatch(monkeypatch)
    seen = _watched_params(monkeypatch)
    HostWatch.reads.clear()
    monkeypatch.setattr(SDPAttention, "packed_kernel", gpu_kernel)
    actor.logprobs(batch)
    assert len({p.size for p in actor.batches.packs(batch)}) >= 3 and len(shapes) == 2 * len(seen)
    assert {s[2] for s in shapes} == {256}
    assert HostWatch.reads == [] and watch.block_masks == [] and watch.compiles == []
