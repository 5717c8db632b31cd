"""Attention kernels and fusion flags for the megatron-core GPT, chosen per device.

megatron-core's local layer spec uses ``DotProductAttention``: it materialises the scores ``[b, heads, sq, sk]``
(in fp32 when ``attention_softmax_in_fp32``) and keeps the probabilities for backward - at 4.6k tokens and
micro-batch 4 that is gigabytes per layer. Two replacements, selected by ``model.attention``:

* ``te``: TransformerEngine's ``TEDotProductAttention`` (flash / cuDNN fused attention), where
  ``transformer_engine`` imports (the NGC container);
* ``sdpa``: :class:`SDPAttention` on ``torch.nn.functional.scaled_dot_product_attention`` - flash or
  memory-efficient kernels on GPU (no ``[s, s]`` tensor kept), the plain math kernel on CPU;
* ``local``: megatron's own ``DotProductAttention`` (unfused).

``auto`` is ``te`` > ``sdpa`` on GPU and ``local`` on CPU (there it keeps the deterministic main job's numbers
bit for bit; ``sdpa`` runs on CPU too and is tested there against the float64 reference GPT).

The core-attention module is swapped inside the layer spec only: it owns no parameters, so checkpoint and
bridge names do not change with the choice.

Packed sequences (the megatron-core actor's default training layout, ``grpo.micro_batch_tokens``): several rows
concatenated into one ``[1, S]`` micro-batch without padding between them, described by megatron-core's
``PackedSeqParams`` (``qkv_format="thd"``, ``cu_seqlens`` = row boundaries; :func:`packed_seq_params`).
megatron's ``Attention.forward`` then squeezes q/k/v to ``[t, heads, head_dim]`` and applies RoPE per row from
position 0 (``megatron/core/transformer/attention.py:414-439`` -> ``rope_utils._apply_rotary_pos_emb_thd``,
``megatron/core/models/common/embeddings/rope_utils.py:139``), and hands ``packed_seq_params`` to the core
attention, which must keep every query inside its own row (document-causal attention):

* ``te``: TransformerEngine's THD kernels read ``cu_seqlens`` themselves
  (``megatron/core/extensions/transformer_engine.py:715-816``);
* ``sdpa``: :func:`packed_attention` with the ``flex`` kernel on GPU (``torch.nn.attention.flex_attention``
  with a document ``BlockMask``: no ``[S, S]`` scores) and the ``dense`` kernel on CPU (one
  ``scaled_dot_product_attention`` call with a block-diagonal causal ``[S, S]`` mask: the same semantics, the
  one the float64 tests check);
* ``local``: megatron's ``DotProductAttention`` with the same block-diagonal mask (:class:`LocalAttention`).
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F

ATTENTION_CHOICES = ("auto", "local", "sdpa", "te")  # model.attention
PACKED_KERNELS = ("auto", "dense", "flex")  # packed_attention's kernel; auto: flex on GPU, dense on CPU
SAMPLER_CHOICES = ("auto", "exact", "device")  # rollout.sampler; auto: device on GPU, exact on CPU
REFERENCE_CHOICES = ("auto", "device", "pinned", "cpu")  # grpo.reference_on; auto: device


def transformer_engine_available() -> bool:
    """True when ``transformer_engine.pytorch`` imports (NGC containers)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return False
    return True


def resolve_attention(choice: str, on_gpu: bool) -> str:
    """The concrete attention implementation for ``model.attention = choice`` on this device."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"model.attention must be one of {', '.join(ATTENTION_CHOICES)}, got {choice!r}")
    if choice == "auto":
        if not on_gpu:
            return "local"
        return "te" if transformer_engine_available() else "sdpa"
    if choice == "te" and not (on_gpu and transformer_engine_available()):
        raise ValueError("model.attention=te needs a GPU and transformer_engine (the NGC container); use sdpa")
    return choice


def core_attention_module(kind: str):
    """The ``core_attention`` class of the layer spec for a resolved attention ``kind``."""
    if kind == "local":
        return _local_attention_class()
    if kind == "sdpa":
        return SDPAttention
    if kind == "te":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    raise ValueError(f"unknown attention kind {kind!r}")


_LOCAL_ATTENTION = None


def _local_attention_class():
    """megatron's ``DotProductAttention`` with packed sequences (built once, on first use: megatron is imported
    lazily). Without ``packed_seq_params`` it IS megatron's forward, call for call."""
    global _LOCAL_ATTENTION
    if _LOCAL_ATTENTION is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class LocalAttention(DotProductAttention):
            """megatron's unfused ``DotProductAttention``; a packed micro-batch (``packed_seq_params``, q
            ``[t, np, hn]``, k / v ``[t, ng, hn]``) runs as one sequence of ``t`` tokens under the block-diagonal
            causal mask of :func:`document_causal_mask` (megatron's convention: True = masked out), returning
            ``[t, 1, np * hn]``."""

            def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                        packed_seq_params=None):
                if packed_seq_params is None:
                    return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
                t = query.shape[0]
                allowed = document_causal_mask(packed_seq_params.cu_seqlens_q, t)
                return super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1),
                                       ~allowed.view(1, 1, t, t), attn_mask_type, attention_bias)

        _LOCAL_ATTENTION = LocalAttention
    return _LOCAL_ATTENTION


def __getattr__(name: str):
    if name == "LocalAttention":  # the class, built on first access (it subclasses a megatron module)
        return _local_attention_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def with_core_attention(spec, kind: str):
    """``spec`` (a megatron TransformerLayer ``ModuleSpec``) with its core attention set to ``kind``."""
    spec.submodules.self_attention.submodules.core_attention = core_attention_module(kind)
    return spec


# TransformerConfig fusion flags and the extension each needs (megatron-core 0.11):
#   bias_activation_fusion, bias_dropout_fusion: torch.jit-scripted functions (plain PyTorch, any GPU);
#   apply_rope_fusion: TransformerEngine's fused RoPE; masked_softmax_fusion: megatron's CUDA softmax
#   (unused by sdpa/te); persist_layer_norm: apex; gradient_accumulation_fusion: apex's
#   fused_weight_gradient_mlp_cuda.
UNFUSED = dict(
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    persist_layer_norm=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
)


def fusion_flags(on_gpu: bool) -> dict[str, bool]:
    """Fusion flags for a TransformerConfig: everything off on CPU; on GPU each fusion whose kernel is
    available in this environment."""
    if not on_gpu:
        return dict(UNFUSED)
    flags = dict(UNFUSED, bias_activation_fusion=True, bias_dropout_fusion=True)
    if transformer_engine_available():
        flags["apply_rope_fusion"] = True
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None:
        flags["gradient_accumulation_fusion"] = True
    return flags


# ------------------------------------------------------------------------------------------------ packed sequences
def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int):
    """megatron-core ``PackedSeqParams`` of one packed micro-batch: ``qkv_format="thd"``, ``cu_seqlens`` [k + 1]
    int32 row boundaries (0, end of row 1, ..., S; the padded tail of a fixed-size pack is a row of its own),
    ``max_seqlen`` the longest of those rows (RoPE's table length: ``rotary_pos_embedding.py:198-201``)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=int(max_seqlen),
                           max_seqlen_kv=int(max_seqlen))


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Row index of every packed position: [total] int64 from the boundaries ``cu_seqlens`` [k + 1]."""
    pos = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), pos, right=True)


def document_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total, total] bool, True where query i may attend key j: the same row and j <= i (block-diagonal causal)."""
    doc = document_ids(cu_seqlens, total)
    pos = torch.arange(total, device=cu_seqlens.device)
    return (doc.unsqueeze(1) == doc.unsqueeze(0)) & (pos.unsqueeze(1) >= pos.unsqueeze(0))


_COMPILED_FLEX = None


def _flex_attention_fn(device: torch.device):
    """``flex_attention``, compiled on GPU (uncompiled it falls back to a kernel that materialises the scores)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX


def document_block_mask(packed_seq_params, total: int, device: torch.device):
    """The flex-attention ``BlockMask`` of the document-causal mask, built once per micro-batch (cached on
    ``packed_seq_params``, which every layer of the forward shares)."""
    cache = packed_seq_params.__dict__.setdefault("_block_masks", {})
    key = (int(total), str(device))
    if key not in cache:
        from torch.nn.attention.flex_attention import create_block_mask

        doc = document_ids(packed_seq_params.cu_seqlens_q.to(device), total)

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        cache[key] = create_block_mask(mask_mod, None, None, total, total, device=device,
                                       _compile=device.type == "cuda")
    return cache[key]


def resolve_packed_kernel(kernel: str, device: torch.device) -> str:
    """``dense`` or ``flex`` for ``kernel`` in :data:`PACKED_KERNELS` on ``device`` (auto: flex on GPU)."""
    if kernel not in PACKED_KERNELS:
        raise ValueError(f"packed attention kernel must be one of {', '.join(PACKED_KERNELS)}, got {kernel!r}")
    if kernel == "auto":
        return "flex" if device.type == "cuda" else "dense"
    return kernel


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed_seq_params, scale: float,
                     kernel: str = "auto", dropout: float = 0.0) -> torch.Tensor:
    """Document-causal attention over one packed micro-batch.

    query [t, np, hn], key / value [t, ng, hn] (``ng`` divides ``np``: grouped-query attention; megatron's
    order, query head i reads key head i // (np / ng)); rows given by ``packed_seq_params.cu_seqlens_q``.
    Returns the context [t, np * hn]. ``kernel``: ``dense`` (SDPA with the [t, t] block-diagonal causal mask) |
    ``flex`` (flex_attention with a document BlockMask, no [t, t] tensor; GPU) | ``auto``."""
    t, heads, groups = query.shape[0], query.shape[1], key.shape[1]
    kernel = resolve_packed_kernel(kernel, query.device)
    q = query.permute(1, 0, 2).unsqueeze(0)  # [1, np, t, hn]
    k = key.permute(1, 0, 2).unsqueeze(0)  # [1, ng, t, hn]
    v = value.permute(1, 0, 2).unsqueeze(0)
    if kernel == "flex":
        if dropout:
            raise ValueError("the flex packed-attention kernel has no attention dropout; use attention_dropout=0")
        block_mask = document_block_mask(packed_seq_params, t, query.device)
        out = _flex_attention_fn(query.device)(q, k, v, block_mask=block_mask, scale=scale,
                                               enable_gqa=heads != groups)
    else:
        mask = document_causal_mask(packed_seq_params.cu_seqlens_q.to(query.device), t)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
                                             enable_gqa=heads != groups)
    return out[0].permute(1, 0, 2).reshape(t, heads * query.shape[2])  # [t, np * hn] (a copy: contiguous)


class SDPAttention(torch.nn.Module):
    """megatron-core core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Same constructor and call as ``megatron.core.transformer.dot_product_attention.DotProductAttention``:
    query ``[sq, b, np, hn]``, key / value ``[sk, b, ng, hn]`` (this rank's heads; ``ng`` query groups,
    grouped-query attention handled by the kernel), returns the context ``[sq, b, np * hn]``.

    Packed micro-batches (``packed_seq_params``, query ``[t, np, hn]``): :func:`packed_attention`, context
    ``[t, np * hn]``.

    Masking: a given ``attention_mask`` (megatron's convention, True = masked out) is used as is; otherwise
    causal when ``sq == sk`` (training, prefill) and none when ``sq == 1`` (a decode step over the KV cache,
    computed with the query heads of each group folded into the query length: no GQA expansion).
    ``sq > 1`` with ``sk > sq`` (a chunked prefill over a cache) is causal with the queries at the last
    ``sq`` positions.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.utils import divide

        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism; use model.attention=te")
        self.config = config
        self.attn_mask_type = attn_mask_type
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    packed_kernel = "auto"  # packed micro-batches: packed_attention's kernel (auto: flex on GPU, dense on CPU)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention bias needs model.attention=te")
        if packed_seq_params is not None:
            # megatron squeezed the batch dimension: q [t, np, hn], k / v [t, ng, hn] (attention.py:414-417)
            return packed_attention(query, key, value, packed_seq_params, self.scale, self.packed_kernel,
                                    self.dropout if self.training else 0.0)
        sq, b = query.shape[0], query.shape[1]
        sk = key.shape[0]
        k = key.permute(1, 2, 0, 3)  # [b, ng, sk, hn]
        v = value.permute(1, 2, 0, 3)
        if sq == 1 and attention_mask is None:
            # a decode step: the np / ng query heads of each group become that group's "query positions"
            # (megatron's GQA: query head i reads kv head i // (np / ng)), so one non-GQA, unmasked kernel
            # call reads each cached key once
            q = query[0].reshape(b, self.groups, self.heads // self.groups, -1)  # [b, ng, np/ng, hn]
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
            return out.reshape(1, b, -1)  # [1, b, np * hn]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        mask = None
        causal = False
        if attention_mask is not None:
            mask = ~attention_mask.bool()  # SDPA: True = attend
        elif sq == sk and sq > 1:
            causal = True
        elif 1 < sq < sk:
            qpos = torch.arange(sk - sq, sk, device=q.device).unsqueeze(1)
            mask = torch.arange(sk, device=q.device).unsqueeze(0) <= qpos  # [sq, sk]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal,
            scale=self.scale, enable_gqa=self.heads != self.groups,
        )
        # [b, np, sq, hn] -> [sq, b, np * hn], contiguous: flash kernels return a [b, sq, np, hn] layout, whose
        # permuted view megatron's linear backward cannot flatten (it calls .view(sq * b, h) on its input)
        return out.permute(2, 0, 1, 3).contiguous().view(sq, b, -1)
