"""A plain-torch float64 re-implementation of megatron-core's GPTModel (local layer spec, RoPE, untied
output), reading the unsharded weights of ``MegatronCoreActor.full_state_dict()``. Used as the
independent reference for log-probs, losses and gradients."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def init_full_weights(num_layers: int, hidden: int, ffn: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Random weights with megatron's naming (float32), non-trivial biases and layer-norm parameters."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.08):
        return (torch.randn(*shape, generator=g) * scale).float()

    w = {"embedding.word_embeddings.weight": r(vocab, hidden, scale=0.5)}
    for i in range(num_layers):
        p = f"decoder.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + r(hidden, scale=0.1)
        w[p + "input_layernorm.bias"] = r(hidden, scale=0.1)
        w[p + "self_attention.linear_qkv.weight"] = r(3 * hidden, hidden, scale=0.3)
        w[p + "self_attention.linear_qkv.bias"] = r(3 * hidden, scale=0.1)
        w[p + "self_attention.linear_proj.weight"] = r(hidden, hidden, scale=0.2)
        w[p + "self_attention.linear_proj.bias"] = r(hidden, scale=0.05)
        w[p + "pre_mlp_layernorm.weight"] = 1 + r(hidden, scale=0.1)
        w[p + "pre_mlp_layernorm.bias"] = r(hidden, scale=0.1)
        w[p + "mlp.linear_fc1.weight"] = r(ffn, hidden, scale=0.2)
        w[p + "mlp.linear_fc1.bias"] = r(ffn, scale=0.05)
        w[p + "mlp.linear_fc2.weight"] = r(hidden, ffn, scale=0.1)
        w[p + "mlp.linear_fc2.bias"] = r(hidden, scale=0.05)
    w["decoder.final_layernorm.weight"] = 1 + r(hidden, scale=0.1)
    w["decoder.final_layernorm.bias"] = r(hidden, scale=0.1)
    w["output_layer.weight"] = r(vocab, hidden, scale=0.3)
    return w


def _rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """x [b, s, heads, d]: rotate-half RoPE over the full head dimension."""
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)  # [s, d/2]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def forward(w: dict[str, torch.Tensor], tokens: torch.Tensor, num_layers: int, heads: int) -> torch.Tensor:
    """Logits [b, s, V] in the dtype of ``w`` (pass float64 weights for the reference)."""
    x = w["embedding.word_embeddings.weight"][tokens]
    b, s, h = x.shape
    d = h // heads
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(num_layers):
        p = f"decoder.layers.{i}."
        y = F.layer_norm(x, (h,), w[p + "input_layernorm.weight"], w[p + "input_layernorm.bias"], eps=1e-5)
        qkv = y @ w[p + "self_attention.linear_qkv.weight"].T + w[p + "self_attention.linear_qkv.bias"]
        qkv = qkv.view(b, s, heads, 3 * d)  # megatron layout: per head [q | k | v]
        q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]
        q, k = _rope(q), _rope(k)
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        att = att.masked_fill(causal, float("-inf")).softmax(-1)
        ctx = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, h)
        x = x + ctx @ w[p + "self_attention.linear_proj.weight"].T + w[p + "self_attention.linear_proj.bias"]
        y = F.layer_norm(x, (h,), w[p + "pre_mlp_layernorm.weight"], w[p + "pre_mlp_layernorm.bias"], eps=1e-5)
        y = F.gelu(y @ w[p + "mlp.linear_fc1.weight"].T + w[p + "mlp.linear_fc1.bias"])
        x = x + y @ w[p + "mlp.linear_fc2.weight"].T + w[p + "mlp.linear_fc2.bias"]
    x = F.layer_norm(x, (h,), w["decoder.final_layernorm.weight"], w["decoder.final_layernorm.bias"], eps=1e-5)
    return x @ w["output_layer.weight"].T


def token_logprobs(w, tokens, num_layers, heads) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) [b, s-1]."""
    logp = torch.log_softmax(forward(w, tokens, num_layers, heads), dim=-1)
    return logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
