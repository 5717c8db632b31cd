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
megatron's ``Attention.forward`` then squeezes q/k/v to ``[t, heads, head_dim]`` (``megatron/core/transformer/
attention.py:414-417``), applies RoPE (``:422-439``) and hands ``packed_seq_params`` to the core attention
(``:461``), which must keep every query inside its own row (document-causal attention). On a GPU nothing in that
forward may wait for the host or compile per micro-batch (every micro-batch has another size ``S``):

* RoPE per token: megatron-core's unfused THD RoPE (``rope_utils._apply_rotary_pos_emb_thd``,
  ``megatron/core/models/common/embeddings/rope_utils.py:139-175``) copies the row lengths to the host
  (``.tolist()``, ``:162``) and rotates row by row. For our core attentions a forward pre-hook on the decoder
  (:func:`rotate_packed_rows`) takes the RoPE table out of megatron's hands and the core attention rotates q and k
  itself at every token's position (the pack's position ids, which restart in every row): the same arithmetic
  (megatron's ``apply_rotary_pos_emb`` on ``[t, 1, heads, head_dim]``), one call, no host copy. TransformerEngine
  keeps megatron's path (its fused THD RoPE reads ``cu_seqlens`` on the device).
* The core attention, in this order of choice on a GPU:

  - ``te``: TransformerEngine's THD kernels read ``cu_seqlens`` themselves
    (``megatron/core/extensions/transformer_engine.py:715-816``), where ``transformer_engine`` imports;
  - ``sdpa`` with the ``varlen`` kernel: PyTorch's own variable-length FlashAttention,
    ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; ``[t, heads, head_dim]`` in and out, int32
    ``cu_seqlens`` on the device, Python-int longest row, backward, GQA; bf16 / fp16 on sm80+). Its call differs
    between releases, so the form is read from its signature (:func:`varlen_form`), never from the version;
  - ``sdpa`` with the ``flex`` kernel, where torch has no ``varlen_attn``: ``flex_attention`` with a ``BlockMask``
    built from the row boundaries by tensor operations (:func:`rows_block_mask`: no ``create_block_mask``, which
    compiles afresh for every call), the pack padded to a power of two (>= 2048) so the compiled kernel is
    built once per padded size, never per micro-batch;

  on CPU the ``dense`` kernel: one ``scaled_dot_product_attention`` call with a block-diagonal causal ``[S, S]``
  mask (the same semantics, the one the float64 tests check); ``local``: megatron's ``DotProductAttention`` with
  the same mask (:class:`LocalAttention`).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from laconic_nemo.runtime.megatron_compat import tensor_parallel_size

ATTENTION_CHOICES = ("auto", "local", "sdpa", "te")  # model.attention
PACKED_KERNELS = ("auto", "dense", "varlen", "flex")  # packed_attention's kernel; auto: choose_packed_kernel
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
            ``[t, 1, np * hn]``; q and k rotated at each token's position first (:func:`rotate_qk`)."""

            def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                        packed_seq_params=None):
                if packed_seq_params is None:
                    return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
                t = query.shape[0]
                query, key = rotate_qk(query, key, packed_seq_params, self.config)
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
def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int, position_ids: torch.Tensor | None = None):
    """megatron-core ``PackedSeqParams`` of one packed micro-batch: ``qkv_format="thd"``, ``cu_seqlens`` [k + 1]
    int32 row boundaries (0, end of row 1, ..., S; the padded tail of a fixed-size pack is a row of its own),
    ``max_seqlen`` the longest of those rows (RoPE's table length: ``rotary_pos_embedding.py:198-201``).

    It also carries ``position_ids`` [S] (int64, on the boundaries' device): each token's position inside its row,
    at which the core attention rotates q and k (:func:`rotate_packed_rows`). The actor passes its pack's (they
    restart in every row); without them they are derived from ``cu_seqlens``, which reads S on the host."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu_seqlens.to(torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=int(max_seqlen),
                             max_seqlen_kv=int(max_seqlen))
    if position_ids is None:
        total = int(cu[-1])
        position_ids = torch.arange(total, device=cu.device) - cu.long()[document_ids(cu, total)]
    params.position_ids = position_ids.reshape(-1).to(device=cu.device, dtype=torch.int64)
    params.rotary_freqs = None  # [S, 1, 1, rotary dim]: set by the decoder's pre-hook (rotate_packed_rows)
    return params


def _packed_rope_hook(module, args, kwargs):
    """Forward pre-hook of a GPTModel's decoder (``TransformerBlock``; megatron passes everything as keywords,
    ``gpt_model.py:264-273``): for a packed micro-batch, the RoPE table [max_seqlen, 1, 1, d] becomes the per-token
    angles [S, 1, 1, d] at the pack's positions (one gather for every layer), kept on ``packed_seq_params``, and
    megatron's own RoPE is skipped (``rotary_pos_emb=None``, ``attention.py:422``): the core attention rotates."""
    params, table = kwargs.get("packed_seq_params"), kwargs.get("rotary_pos_emb")
    if params is not None and table is not None and getattr(params, "position_ids", None) is not None:
        if isinstance(table, tuple):  # megatron's (q, k) pair; self-attention has one table
            table = table[0]
        params.rotary_freqs = table[params.position_ids]
        kwargs = {**kwargs, "rotary_pos_emb": None}
    return args, kwargs


def rotate_packed_rows(model, kind: str):
    """Install the per-token RoPE of packed micro-batches on a GPTModel whose core attention is ``kind``
    (``sdpa`` or ``local``: ours, which rotate; ``te`` keeps megatron's fused THD RoPE). Returns the model."""
    if kind in ("sdpa", "local") and getattr(model, "decoder", None) is not None:
        model.decoder.register_forward_pre_hook(_packed_rope_hook, with_kwargs=True)
    return model


def rotate_qk(query: torch.Tensor, key: torch.Tensor, packed_seq_params, config) -> tuple[torch.Tensor, torch.Tensor]:
    """q [t, np, hn] and k [t, ng, hn] rotated at every token's position (``packed_seq_params.rotary_freqs``, set by
    :func:`_packed_rope_hook`; unchanged without it) through megatron's ``apply_rotary_pos_emb`` on
    ``[t, 1, heads, hn]`` (``rope_utils.py:178``; without ``cu_seqlens``: its bshd path, ``:88-122``), the
    arithmetic megatron's THD path applies row by row."""
    freqs = getattr(packed_seq_params, "rotary_freqs", None)
    if freqs is None:
        return query, key
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    return (apply_rotary_pos_emb(query.unsqueeze(1), freqs, config=config).squeeze(1),
            apply_rotary_pos_emb(key.unsqueeze(1), freqs, config=config).squeeze(1))


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Row index of every packed position: [total] int64 from the boundaries ``cu_seqlens`` [k + 1]; positions at or
    past ``cu_seqlens[-1]`` get index k (a row of their own)."""
    pos = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), pos, right=True)


def document_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total, total] bool, True where query i may attend key j: the same row and j <= i (block-diagonal causal)."""
    doc = document_ids(cu_seqlens, total)
    pos = torch.arange(total, device=cu_seqlens.device)
    return (doc.unsqueeze(1) == doc.unsqueeze(0)) & (pos.unsqueeze(1) >= pos.unsqueeze(0))


# ----------------------------------------------------------------- varlen_attn (torch.nn.attention.varlen)
# The positional head every release shares: varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, ...)
VARLEN_HEAD = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")


@dataclass(frozen=True)
class VarlenForm:
    """How a ``varlen_attn`` is called, read from its signature (:func:`varlen_form`).

    causal: ``is_causal`` (torch 2.10: ``is_causal=True``) or ``window_size`` (2.11 on: ``window_size=(-1, 0)``);
    scale: it takes ``scale=`` (2.11 on; 2.10 always scales by 1 / sqrt(head_dim)); enable_gqa: it takes
    ``enable_gqa=`` and refuses fewer key-value heads without it (2.12 on; before, the kernel takes them as they
    are). In ``torch/nn/attention/varlen.py``: 2.10.0 ``:127-137``; 2.11.0 ``:159-171``, causal ``:237``; 2.12.0 and
    2.12.1 ``:185-201``, the head check ``:304-314``, causal ``:316``; 2.13.0 ``:176-192``, the head check
    ``:295-305``, causal ``:307`` (tests/test_packed_gpu_path.py holds the forms).
    """

    causal: str
    scale: bool
    enable_gqa: bool

    def describe(self) -> str:
        causal = "is_causal=True" if self.causal == "is_causal" else "window_size=(-1, 0)"
        extra = ", scale=" if self.scale else ", q pre-scaled"
        return causal + extra + (", enable_gqa=" if self.enable_gqa else "")


@functools.lru_cache(maxsize=8)
def varlen_form(fn) -> VarlenForm | None:
    """The call form of ``fn`` (a ``varlen_attn``) from ``inspect.signature``, or None when it is not one this
    module knows how to call (another positional head, or neither ``is_causal`` nor ``window_size``)."""
    if fn is None:
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if tuple(params)[: len(VARLEN_HEAD)] != VARLEN_HEAD:
        return None
    if "window_size" in params:
        causal = "window_size"
    elif "is_causal" in params:
        causal = "is_causal"
    else:
        return None
    return VarlenForm(causal=causal, scale="scale" in params, enable_gqa="enable_gqa" in params)


def torch_varlen_attn():
    """``torch.nn.attention.varlen.varlen_attn`` where this torch has it (2.10 on), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float) -> torch.Tensor:
    """Document-causal attention through :func:`torch_varlen_attn` in the form its signature states: q [t, np, hn],
    k / v [t, ng, hn], ``cu_seqlens`` [k + 1] int32 on the device, ``max_seqlen`` a Python int (nothing read back
    to the host). Returns [t, np, hn]."""
    fn = torch_varlen_attn()
    form = varlen_form(fn)
    if form is None:
        raise RuntimeError(f"torch {torch.__version__} has no varlen_attn this module can call; use the flex kernel")
    kw: dict = {"window_size": (-1, 0)} if form.causal == "window_size" else {"is_causal": True}
    if form.scale:
        kw["scale"] = scale
    elif not math.isclose(scale, 1.0 / math.sqrt(query.shape[-1]), rel_tol=1e-12):
        query = query * (scale * math.sqrt(query.shape[-1]))  # the kernel's own scale is 1 / sqrt(head_dim)
    if form.enable_gqa and query.shape[1] != key.shape[1]:
        kw["enable_gqa"] = True
    m = int(max_seqlen)
    return fn(query.contiguous(), key.contiguous(), value.contiguous(), cu_seqlens, cu_seqlens, m, m, **kw)


# ----------------------------------------------------------------- flex fallback (no per-micro-batch compilation)
FLEX_BLOCK = 128  # flex_attention's default sparse block
FLEX_MIN_PADDED = 2048  # the smallest padded size: packs are padded to a power of two >= this

_COMPILED_FLEX = None


def flex_padded_size(total: int) -> int:
    """The size a pack of ``total`` positions is padded to for the flex kernel: the next power of two >=
    ``max(total, FLEX_MIN_PADDED)``, so the compiled kernel sees a handful of sizes over a run (one per padded
    size: 2048 ... 131072 is seven), not one per micro-batch."""
    return max(FLEX_MIN_PADDED, 1 << (int(total) - 1).bit_length())


def _flex_attention_fn(device: torch.device):
    """``flex_attention``, compiled once on GPU with static shapes (uncompiled it falls back to a kernel that
    materialises the scores); as it is on CPU."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def rows_block_mask(cu_seqlens: torch.Tensor, size: int, block: int = FLEX_BLOCK):
    """The flex-attention ``BlockMask`` of the document-causal mask over ``size`` positions (a multiple of
    ``block``; positions past ``cu_seqlens[-1]`` form a row of their own), built from the row boundaries by tensor
    operations on their device, with no compilation and nothing read back to the host.

    Rows are contiguous and ordered, so a ``block`` of positions spans the rows ``first .. last`` of its first and
    last position: key block j may hold a key that query block i sees iff j <= i and their row spans overlap
    (partial or full), and every pair is allowed iff j < i and both blocks lie inside one row (full)."""
    from torch.nn.attention.flex_attention import BlockMask

    if size % block:
        raise ValueError(f"rows_block_mask: size {size} must be a multiple of the block {block}")
    doc = document_ids(cu_seqlens, size)
    nb = size // block
    first, last = doc.view(nb, block)[:, 0], doc.view(nb, block)[:, -1]
    idx = torch.arange(nb, device=doc.device)
    below = idx.view(1, nb) <= idx.view(nb, 1)  # [q block, kv block]: j <= i
    overlap = below & (first.view(1, nb) <= last.view(nb, 1)) & (last.view(1, nb) >= first.view(nb, 1))
    single = first == last
    full = (idx.view(1, nb) < idx.view(nb, 1)) & single.view(nb, 1) & single.view(1, nb) & (
        first.view(1, nb) == first.view(nb, 1))
    partial = overlap & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the kv blocks of each query block, the marked ones first (ascending), as BlockMask wants them
        count = dense.sum(-1, dtype=torch.int32)
        order = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count.view(1, 1, nb), order.view(1, 1, nb, nb)

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(size, size))


def flex_attention_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed_seq_params,
                        scale: float) -> torch.Tensor:
    """Document-causal attention through ``flex_attention``: q [t, np, hn], k / v [t, ng, hn] padded with zeros to
    :func:`flex_padded_size` (the padding is a row of its own: it changes nothing of the real rows), the
    ``BlockMask`` of :func:`rows_block_mask` (built once per micro-batch, cached on ``packed_seq_params``, which
    every layer shares). Returns [t, np, hn]."""
    t, heads, groups = query.shape[0], query.shape[1], key.shape[1]
    size = flex_padded_size(t)
    cache = packed_seq_params.__dict__.setdefault("_block_masks", {})
    mkey = (size, str(query.device))
    if mkey not in cache:
        cache[mkey] = rows_block_mask(packed_seq_params.cu_seqlens_q.to(query.device), size)

    def prep(x):  # [t, h, hn] -> [1, h, size, hn]
        x = x.permute(1, 0, 2).unsqueeze(0)
        return F.pad(x, (0, 0, 0, size - t)) if size > t else x

    out = _flex_attention_fn(query.device)(prep(query), prep(key), prep(value), block_mask=cache[mkey], scale=scale,
                                           enable_gqa=heads != groups)
    return out[0, :, :t].permute(1, 0, 2)  # [t, np, hn]


# ----------------------------------------------------------------- the choice
@functools.lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def choose_packed_kernel(on_gpu: bool, dtype: torch.dtype | None = None,
                         capability: tuple[int, int] | None = None) -> str:
    """The packed kernel of ``sdpa`` for a device: on a GPU ``varlen`` where torch has a ``varlen_attn`` of a
    known form (:func:`varlen_form`) and the inputs suit FlashAttention (``dtype`` bf16 / fp16, None counting as
    bf16; compute ``capability`` >= 8.0, None: assumed), else ``flex``; on CPU ``dense``."""
    if not on_gpu:
        return "dense"
    half = dtype is None or dtype in (torch.float16, torch.bfloat16)
    if half and (capability is None or tuple(capability) >= (8, 0)) and varlen_form(torch_varlen_attn()) is not None:
        return "varlen"
    return "flex"


def resolve_packed_kernel(kernel: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``dense``, ``varlen`` or ``flex`` for ``kernel`` in :data:`PACKED_KERNELS` on ``device`` for inputs of
    ``dtype`` (auto: :func:`choose_packed_kernel`)."""
    if kernel not in PACKED_KERNELS:
        raise ValueError(f"packed attention kernel must be one of {', '.join(PACKED_KERNELS)}, got {kernel!r}")
    if kernel == "auto":
        on_gpu = device.type == "cuda"
        cap = _capability(device.index if device.index is not None else torch.cuda.current_device()) if on_gpu else None
        return choose_packed_kernel(on_gpu, dtype, cap)
    return kernel


def describe_packed_attention(attention: str = "auto", dtype: torch.dtype | None = torch.bfloat16) -> str:
    """What a packed micro-batch runs on an sm80+ GPU with this environment's packages, for ``model.attention =
    attention`` and weights of ``dtype`` (``plan`` and the benchmarks print it)."""
    try:
        kind = resolve_attention(attention, on_gpu=True)
    except ValueError as exc:
        return f"none: {exc}"
    if kind == "te":
        return "te: TransformerEngine's THD attention (cu_seqlens read on the device)"
    if kind == "local":
        return "local: megatron's DotProductAttention under a block-diagonal [S, S] mask"
    kernel = choose_packed_kernel(True, dtype)
    if kernel == "varlen":
        return (f"varlen: torch.nn.attention.varlen.varlen_attn of torch {torch.__version__} "
                f"({varlen_form(torch_varlen_attn()).describe()})")
    why = "no varlen_attn in this torch" if varlen_form(torch_varlen_attn()) is None else f"{dtype} weights"
    return (f"flex: flex_attention with a BlockMask from the row boundaries, compiled once per padded size "
            f"({why}; torch {torch.__version__})")


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed_seq_params, scale: float,
                     kernel: str = "auto", dropout: float = 0.0) -> torch.Tensor:
    """Document-causal attention over one packed micro-batch.

    query [t, np, hn], key / value [t, ng, hn] (``ng`` divides ``np``: grouped-query attention; megatron's
    order, query head i reads key head i // (np / ng)); rows given by ``packed_seq_params.cu_seqlens_q``.
    Returns the context [t, np * hn]. ``kernel``: ``dense`` (SDPA with the [t, t] block-diagonal causal mask) |
    ``varlen`` (torch's varlen_attn; GPU) | ``flex`` (flex_attention with a BlockMask from the row boundaries, no
    [t, t] tensor) | ``auto`` (:func:`resolve_packed_kernel`)."""
    t, heads, groups = query.shape[0], query.shape[1], key.shape[1]
    kernel = resolve_packed_kernel(kernel, query.device, query.dtype)
    if kernel in ("varlen", "flex") and dropout:
        raise ValueError(f"the {kernel} packed-attention kernel has no attention dropout; use attention_dropout=0")
    if kernel == "varlen":
        out = varlen_attention(query, key, value, packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q,
                               scale)
        return out.reshape(t, heads * query.shape[2])
    if kernel == "flex":
        return flex_attention_rows(query, key, value, packed_seq_params, scale).reshape(t, heads * query.shape[2])
    q = query.permute(1, 0, 2).unsqueeze(0)  # [1, np, t, hn]
    k = key.permute(1, 0, 2).unsqueeze(0)  # [1, ng, t, hn]
    v = value.permute(1, 0, 2).unsqueeze(0)
    mask = document_causal_mask(packed_seq_params.cu_seqlens_q.to(query.device), t)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
                                         enable_gqa=heads != groups)
    return out[0].permute(1, 0, 2).reshape(t, heads * query.shape[2])  # [t, np * hn] (a copy: contiguous)


class SDPAttention(torch.nn.Module):
    """megatron-core core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Same constructor (every release's keywords: :data:`laconic_nemo.runtime.megatron_compat.CORE_ATTENTION_CALL`)
    and call as ``megatron.core.transformer.dot_product_attention.DotProductAttention``:
    query ``[sq, b, np, hn]``, key / value ``[sk, b, ng, hn]`` (this rank's heads; ``ng`` query groups,
    grouped-query attention handled by the kernel), returns the context ``[sq, b, np * hn]``.

    Packed micro-batches (``packed_seq_params``, query ``[t, np, hn]``): q and k rotated at each token's position
    (:func:`rotate_qk`), then :func:`packed_attention`, context ``[t, np * hn]``.

    Masking: a given ``attention_mask`` (megatron's convention, True = masked out) is used as is; otherwise
    causal when ``sq == sk`` (training, prefill) and none when ``sq == 1`` (a decode step over the KV cache,
    computed with the query heads of each group folded into the query length: no GQA expansion).
    ``sq > 1`` with ``sk > sq`` (a chunked prefill over a cache) is causal with the queries at the last
    ``sq`` positions.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        from megatron.core.utils import divide

        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism; use model.attention=te")
        self.config = config
        self.attn_mask_type = attn_mask_type
        tp = tensor_parallel_size(pg_collection)  # megatron-core 0.16.1 and 0.19.2 hand their process groups
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, tp)
        head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    packed_kernel = "auto"  # packed micro-batches: packed_attention's kernel (auto: choose_packed_kernel)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention: attention bias needs model.attention=te")
        if packed_seq_params is not None:
            # megatron squeezed the batch dimension: q [t, np, hn], k / v [t, ng, hn] (attention.py:414-417)
            query, key = rotate_qk(query, key, packed_seq_params, self.config)
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
