"""The decode engine's fused decode step: one token per row through a megatron-core ``TransformerLayer`` in fewer
kernels than calling the layer's modules (:meth:`~laconic_nemo.rollout.stage.Stage.layer`, kept for the
prefill and as ``EngineSettings.fused = False``).

A decode step inside a CUDA graph costs about 2 us per kernel beyond its memory traffic, so at the 1.5B shapes the
kernel count, not the arithmetic, separates a graphed step from the bandwidth bound. Per layer, on a GPU:

====================================  ======================  =============================================
piece                                  module path (kernels)    fused (kernels)
====================================  ======================  =============================================
input norm                             ``input_layernorm``      the same module (torch's fused ``rms_norm``)
linear_qkv + bias                      matmul, add              one ``addmm`` (bias in the GEMM)
RoPE of q and k                        ~10 (twice megatron's    3 (flip, mul, addcmul; on CPU mul, add) once over
                                       unfused function)        the q | k | v heads, cos / sin gathered once a step
keys, values into the cache            2 ``index_put_``         1 ``index_put_`` (keys and values together)
attention mask                         bool -> float per call   an additive mask built once per step
linear_proj, bias-dropout-add          matmul, add(s)           ``addmm_`` into the residual (the add folded)
pre-MLP norm                           module                   the same module
linear_fc1, SwiGLU                     matmul, chunk, silu, mul ``mm`` / ``addmm``, silu, mul
linear_fc2, bias-dropout-add           matmul, add(s)           ``addmm_`` into the residual
====================================  ======================  =============================================

The layout trick: ``linear_qkv``'s output is megatron's ``[rows, groups, (heads per group + 2) x head_dim]``
(each group's query heads, then its key, then its value; ``attention.py:620-660``). Viewed as
``[rows, groups, heads per group + 2, head_dim]``, RoPE turns every slot at once with factors that are the
position's (cos, sin) for the query and key slots and (1, 0) for the value slot (``v * 1 + flip(v) * 0 = v``
exactly); the rotated tensor then holds the attention's query rows per group (megatron's GQA: query head i reads
group i // (heads / groups)) and, in its last two slots, the key and value the cache takes in one write. The
rotation is megatron's ``t * cos + _rotate_half(t) * sin`` (``rope_utils.py:69-85, 118-121``: ``cat(-x2, x1)``)
as ``flip`` of the two halves (of the pairs when interleaved) times a sine whose first half (even entries) is
negated: the same products and sum (on a GPU the last multiply-add is one ``addcmul``, within a rounding).

What is not fused is called as a module: norms (torch's ``RMSNorm`` / ``LayerNorm``: one fused kernel each on a GPU
in recent torch; TransformerEngine's and others as they are), linears that are not exactly megatron's
``ColumnParallelLinear`` / ``RowParallelLinear`` (TransformerEngine's ``LayerNormColumnParallelLinear`` keeps its norm
inside), q / k layernorms (Qwen3), and the MLP of ``bias_activation_fusion`` with GELU (megatron's tanh
approximation). Tensor-parallel collectives are megatron's own mappings (``reduce_from_tensor_model_parallel_region``
after a row-parallel GEMM, as ``RowParallelLinear.forward``, ``layers.py:1187-1193``), so TP > 1 is served.

Why not ``torch.compile``: it would trace these same few operators, and with ``dynamic=False`` it compiles once per
input shape - with the KV length inside the step, once per (bucket, KV length), tens of compilations of a 28-layer
step per rollout (compiling only the pieces between attentions would bring it to one per bucket, for a few
elementwise fusions beyond the ones written here); the hand-fused step compiles nothing and is captured in the
engine's own graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unsupported(model) -> str | None:
    """Why the fused step cannot run ``model`` (None: it can); the engine then calls the modules."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    cfg = model.config
    if cfg.fp32_residual_connection:
        return "fp32_residual_connection"
    emb = getattr(model, "embedding", None)
    if emb is not None and getattr(emb, "num_tokentypes", 0):
        return "token-type embeddings"
    for layer in model.decoder.layers:
        if not isinstance(layer.self_attention, SelfAttention) or type(layer.mlp) is not MLP:
            return f"layer modules {type(layer.self_attention).__name__} / {type(layer.mlp).__name__}"
    return None


def _identity(mod) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return mod is None or isinstance(mod, IdentityOp)


def column(mod, x: torch.Tensor) -> torch.Tensor:
    """A column-parallel linear of ``x`` [n, in] -> this rank's [n, out / TP], its bias added (also a
    ``skip_bias_add`` bias: the caller adds it next in megatron): one ``addmm`` for megatron's
    ``ColumnParallelLinear`` (``layers.py:916-965``: identity input mapping in inference, no gather), else the
    module."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if type(mod) is ColumnParallelLinear and not mod.gather_output and not mod.sequence_parallel:
        w, bias = mod.weight, mod.bias
        return torch.mm(x, w.t()) if bias is None else torch.addmm(bias, x, w.t())
    out, bias = mod(x.unsqueeze(0))
    out = out[0]
    return out if bias is None else out + bias


def row_into(mod, x: torch.Tensor, h: torch.Tensor, tp: int) -> None:
    """``h += x @ W^T`` reduced over TP (+ bias), in place: megatron's ``RowParallelLinear`` (``layers.py:1147-1202``)
    followed by the bias-dropout-add of inference (``fused_bias_dropout.py``: residual + (out + bias)); at TP 1 the
    residual add is the GEMM's own accumulation (``addmm_``). Other modules are called."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    if type(mod) is RowParallelLinear and mod.input_is_parallel and not mod.sequence_parallel:
        w = mod.weight
        if tp == 1:
            h.addmm_(x, w.t())
        else:
            from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

            h.add_(reduce_from_tensor_model_parallel_region(torch.mm(x, w.t())))
        if mod.bias is not None:
            h.add_(mod.bias)
        return
    out, bias = mod(x.unsqueeze(0))
    out = out[0]
    h.add_(out if bias is None else out + bias)


def rope_table(freqs: torch.Tensor, interleaved: bool, dtype: torch.dtype) -> torch.Tensor:
    """[positions, 2, 2, rot]: per position (cos, signed sin) for the query / key slots and (1, 0) for the value
    slot, in ``dtype``, from the model's float32 angles ``freqs`` [positions, rot] (``GPTModel.rotary_pos_emb``;
    megatron takes cos / sin of the same float32 angles and casts, ``rope_utils.py:118-119``). The sine's first half
    (even entries when interleaved) is negated: ``flip(x) * signed sin`` is ``_rotate_half(x) * sin``."""
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    half = freqs.shape[-1] // 2
    sign = torch.ones_like(sin)
    if interleaved:
        sign[:, 0::2] = -1
    else:
        sign[:, :half] = -1
    qk = torch.stack((cos, sin * sign), dim=1)  # [positions, 2, rot]
    v = torch.stack((torch.ones_like(cos), torch.zeros_like(sin)), dim=1)
    return torch.stack((qk, v), dim=2).to(dtype)  # [positions, 2 (cos, sin), 2 (qk, v), rot]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
           fma: bool | None = None) -> torch.Tensor:
    """RoPE of ``x`` [b, groups, slots, d] with factors [b, 1, slots, rot] (rot <= d; the rest passes): a new tensor.

    fma: the last multiply-add as one ``addcmul`` (one kernel fewer; its rounding may differ from megatron's by
    the fused multiply-add) - the default on CUDA; elsewhere ``t * cos + flip(t) * sin``, megatron's arithmetic bit
    for bit, so a CPU rollout samples exactly the module path's tokens."""
    rot = cos.shape[-1]
    t = x[..., :rot] if rot < x.shape[-1] else x
    pairs = (rot // 2, 2) if interleaved else (2, rot // 2)
    flipped = t.unflatten(-1, pairs).flip(-1 if interleaved else -2).flatten(-2)
    if x.is_cuda if fma is None else fma:
        out = torch.addcmul(t * cos, flipped, sin)
    else:
        out = t * cos + flipped * sin
    return torch.cat((out, x[..., rot:]), dim=-1) if rot < x.shape[-1] else out


class FusedLayer:
    """One layer's modules as the fused step uses them (references to the model's own modules, so an optimiser's
    in-place update is read by the next step)."""

    def __init__(self, layer):
        sa, mlp = layer.self_attention, layer.mlp
        cfg = layer.config
        self.in_norm = None if _identity(layer.input_layernorm) else layer.input_layernorm
        self.qkv, self.proj = sa.linear_qkv, sa.linear_proj
        self.q_norm = None if _identity(getattr(sa, "q_layernorm", None)) else sa.q_layernorm
        self.k_norm = None if _identity(getattr(sa, "k_layernorm", None)) else sa.k_layernorm
        self.pre_norm = None if _identity(layer.pre_mlp_layernorm) else layer.pre_mlp_layernorm
        self.mlp, self.fc1, self.fc2 = mlp, mlp.linear_fc1, mlp.linear_fc2
        self.act, self.gated = cfg.activation_func, bool(cfg.gated_linear_unit)
        # megatron's fused bias-GELU is the tanh approximation (fused_bias_gelu.py): that MLP is called as a module
        self.mlp_module = bool(cfg.bias_activation_fusion) and self.act is not F.silu

    def mlp_into(self, x: torch.Tensor, h: torch.Tensor, tp: int) -> None:
        """``h += MLP(x)`` (``mlp.py:94-130``: fc1 + bias, activation or gated unit, fc2), in place."""
        if self.mlp_module:
            out, bias = self.mlp(x.unsqueeze(0))
            out = out[0]
            h.add_(out if bias is None else out + bias)
            return
        a = column(self.fc1, x)
        if self.gated:
            a0, a1 = torch.chunk(a, 2, dim=-1)
            a = self.act(a0) * a1
        else:
            a = self.act(a)
        row_into(self.fc2, a, h, tp)
