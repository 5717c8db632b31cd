"""The shape of a decoder-only checkpoint, read from a Hugging Face ``config.json``.

Supported families (the architectures of the paper's runs):

* ``qwen2``  (DeepSeek-R1-Distill-Qwen-1.5B, DeepScaleR-1.5B-Preview, Qwen2.5-Math-1.5B): bias on the
  q/k/v projections only, optional tied embeddings.
* ``qwen3``  (Qwen3-8B): RMSNorm on every query/key head (``q_norm``/``k_norm``), no biases, a head
  dimension that need not equal ``hidden_size / num_attention_heads``.
* ``llama``  (Llama 2/3): no biases; Llama-3.1 RoPE frequency scaling (``rope_type: llama3``).

All three use pre-RMSNorm blocks, rotary position embeddings (rotate-half), grouped-query attention
and a SwiGLU MLP (``down(silu(gate(x)) * up(x))``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class ModelArch:
    """Everything the bridge needs to build a megatron-core GPTModel and map its weights.

    num_kv_heads < num_attention_heads means grouped-query attention (GQA); head_dim is the per-head
    width (``kv_channels`` in megatron-core). vocab_size is the HF (unpadded) vocabulary.
    rope_scaling is None or the Llama-3 parameters (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings).
    """

    model_type: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict | None = None
    initializer_range: float = 0.02

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim",
                     "ffn_hidden_size", "vocab_size", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelArch.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _read_config(hf_config: Any) -> dict:
    if isinstance(hf_config, (str, os.PathLike)):
        path = os.fspath(hf_config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"hf_config: no config.json at {path}")
        with open(path) as f:
            return json.load(f)
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"hf_config must be a path, a dict or a transformers PretrainedConfig, got {type(hf_config)}")


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, llama3 scaling or None) from either the classic keys (``rope_theta``,
    ``rope_scaling``) or the newer ``rope_parameters`` dictionary."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = cfg.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    rope_type = None
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type"))
    elif params and params.get("rope_type", "default") != "default":
        rope_type, scaling = params["rope_type"], params
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "llama3":
        raise NotImplementedError(
            f"rope scaling type {rope_type!r} is not supported (supported: none/default, llama3)"
        )
    llama3 = {
        "factor": float(scaling.get("factor", 8.0)),
        "low_freq_factor": float(scaling.get("low_freq_factor", 1.0)),
        "high_freq_factor": float(scaling.get("high_freq_factor", 4.0)),
        "original_max_position_embeddings": int(scaling.get("original_max_position_embeddings", 8192)),
    }
    return float(theta), llama3


def arch_from_hf_config(hf_config: Any) -> ModelArch:
    """Read a :class:`ModelArch` from a HF config (path to a checkpoint directory or config.json, a dict,
    or a ``transformers.PretrainedConfig``). Raises for families or options the bridge cannot map."""
    cfg = _read_config(hf_config)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"model_type {model_type!r} is not supported by the bridge (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if cfg.get("mlp_bias"):
        raise NotImplementedError("mlp_bias=True is not supported")
    if model_type == "qwen2":
        qkv_bias = True
        if cfg.get("use_sliding_window"):
            raise NotImplementedError("qwen2 with use_sliding_window=True is not supported")
    else:
        if cfg.get("attention_bias"):
            raise NotImplementedError(f"{model_type} with attention_bias=True (bias on q/k/v/o) is not supported")
        qkv_bias = False
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // heads
    theta, scaling = _rope(cfg)
    return ModelArch(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=model_type == "qwen3",
        rope_scaling=scaling,
        initializer_range=float(cfg.get("initializer_range", 0.02)),
    )


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the smallest multiple of ``divisible_by * tp`` >= vocab_size."""
    if vocab_size <= 0 or tp <= 0 or divisible_by <= 0:
        raise ValueError(f"vocab_size, tp, divisible_by must be positive, got {vocab_size}, {tp}, {divisible_by}")
    m = divisible_by * tp
    return ((vocab_size + m - 1) // m) * m
