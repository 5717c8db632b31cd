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
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F

ATTENTION_CHOICES = ("auto", "local", "sdpa", "te")  # model.attention
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
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        return DotProductAttention
    if kind == "sdpa":
        return SDPAttention
    if kind == "te":
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        return TEDotProductAttention
    raise ValueError(f"unknown attention kind {kind!r}")


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


class SDPAttention(torch.nn.Module):
    """megatron-core core attention on ``torch.nn.functional.scaled_dot_product_attention``.

    Same constructor and call as ``megatron.core.transformer.dot_product_attention.DotProductAttention``:
    query ``[sq, b, np, hn]``, key / value ``[sk, b, ng, hn]`` (this rank's heads; ``ng`` query groups,
    grouped-query attention handled by the kernel), returns the context ``[sq, b, np * hn]``.

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

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention: packed sequences and attention bias need model.attention=te")
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
