"""Build a megatron-core GPTModel with the architecture of a Hugging Face checkpoint.

Uses the megatron-core *local* layer spec (no apex): ``torch.nn.RMSNorm``, column/row-parallel linears,
SwiGLU (``gated_linear_unit`` with silu), per-head q/k RMSNorm for Qwen3, bias on the fused QKV only for
Qwen2. The core attention is chosen per device (:mod:`laconic_nemo.runtime.kernels`: TransformerEngine or
``scaled_dot_product_attention`` on GPU); it owns no parameters, so names are the same for every choice.
The same spec runs on CPU (gloo) and GPU (NCCL).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from laconic_nemo.bridge.arch import ModelArch, padded_vocab_size
from laconic_nemo.runtime.kernels import core_attention_module, fusion_flags, resolve_attention, rotate_packed_rows


def transformer_config(arch: ModelArch, tp: int = 1, pp: int = 1, cpu: bool = True, dtype: torch.dtype | None = None,
                       **overrides):
    """A ``megatron.core.transformer.TransformerConfig`` for ``arch`` at tensor-parallel size ``tp`` and
    pipeline size ``pp``. ``cpu=True``: float32, CPU initialisation, every fusion off (what megatron-core
    needs to run over gloo); on GPU the fusions whose kernels are available (:func:`laconic_nemo.runtime.kernels.
    fusion_flags`). ``dtype`` defaults to float32 on CPU and bfloat16 otherwise. ``overrides`` are passed to
    TransformerConfig last (e.g. ``recompute_granularity``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
    if arch.num_kv_heads % tp != 0:
        raise ValueError(f"tp={tp} must divide num_kv_heads={arch.num_kv_heads} (whole query groups per rank)")
    if arch.ffn_hidden_size % tp != 0:
        raise ValueError(f"tp={tp} must divide ffn_hidden_size={arch.ffn_hidden_size}")
    if arch.num_layers % pp != 0:
        raise ValueError(f"pp={pp} must divide num_layers={arch.num_layers}")
    if dtype is None:
        dtype = torch.float32 if cpu else torch.bfloat16
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=cpu,
        **fusion_flags(on_gpu=not cpu),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(arch: ModelArch, attention: str = "local"):
    """The megatron-core local transformer-layer ``ModuleSpec`` for ``arch`` (RMSNorm from torch, q/k
    layernorm when ``arch.qk_norm``) with core attention ``attention`` (a resolved choice of
    :func:`laconic_nemo.runtime.kernels.resolve_attention`). Parameter names are those of ``get_gpt_layer_local_spec``."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    norm = WrappedTorchNorm
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=core_attention_module(attention),
                    linear_proj=RowParallelLinear,
                    q_layernorm=norm if arch.qk_norm else IdentityOp,
                    k_layernorm=norm if arch.qk_norm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _rope_kwargs(arch: ModelArch) -> dict:
    if arch.rope_scaling is None:
        return {"rope_scaling": False}
    s = arch.rope_scaling
    # megatron-core 0.11 hard-codes low=1, high=4, original context 8192 (Llama 3.1/3.2/3.3 values).
    if (s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]) != (1.0, 4.0, 8192):
        raise NotImplementedError(f"llama3 rope scaling with {s} differs from megatron-core's fixed (1, 4, 8192)")
    return {"rope_scaling": True, "rope_scaling_factor": s["factor"]}


def build_gpt_model(arch: ModelArch, config, pre_process: bool = True, post_process: bool = True,
                    vocab_divisible_by: int = 128, parallel_output: bool = True, attention: str = "auto"):
    """One GPTModel (pipeline stage) for ``arch`` with ``config`` from :func:`transformer_config`;
    ``attention``: ``model.attention`` (auto: by the device the config was built for); packed micro-batches get RoPE
    per token (:func:`laconic_nemo.runtime.kernels.rotate_packed_rows`)."""
    from megatron.core.models.gpt import GPTModel

    on_gpu = not config.use_cpu_initialization  # the device transformer_config(cpu=...) was built for
    kind = resolve_attention(attention, on_gpu=on_gpu)
    return rotate_packed_rows(GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(arch, kind),
        vocab_size=padded_vocab_size(arch.vocab_size, config.tensor_model_parallel_size, vocab_divisible_by),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        **_rope_kwargs(arch),
    ), kind)


def model_provider(arch: ModelArch, cpu: bool | None = None, dtype: torch.dtype | None = None,
                   vocab_divisible_by: int = 128, parallel_output: bool = True, config=None, attention: str = "auto",
                   **config_overrides) -> Callable[[bool, bool], object]:
    """A ``(pre_process, post_process) -> GPTModel`` callable for the actor.

    config: the TransformerConfig every stage shares (pass the one the actor holds, so that settings the actor
    puts on it, e.g. ``finalize_model_grads_func``, reach the model). Without it, one is built when the
    callable runs, with TP and PP sizes from ``megatron.core.parallel_state``. ``cpu`` defaults to
    ``not torch.cuda.is_available()``. attention: ``model.attention`` (see :mod:`laconic_nemo.runtime.kernels`).
    """
    if cpu is None:
        cpu = not torch.cuda.is_available()

    def provide(pre_process: bool = True, post_process: bool = True):
        cfg = config
        if cfg is None:
            from megatron.core import parallel_state as ps

            tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
            pp = ps.get_pipeline_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
            cfg = transformer_config(arch, tp=tp, pp=pp, cpu=cpu, dtype=dtype, **config_overrides)
        return build_gpt_model(arch, cfg, pre_process, post_process, vocab_divisible_by, parallel_output, attention)

    return provide


def actor_kwargs(arch: ModelArch, tp: int, pp: int, cpu: bool | None = None, dtype: torch.dtype | None = None,
                 vocab_divisible_by: int = 128, attention: str = "auto", **config_overrides) -> dict:
    """The model part of ``MegatronCoreActor(...)`` for ``arch``: ``transformer_config``, ``model_provider``
    (sharing that config), ``vocab_size`` (HF) and ``padded_vocab_size`` (multiple of ``vocab_divisible_by * tp``)."""
    if cpu is None:
        cpu = not torch.cuda.is_available()
    config = transformer_config(arch, tp=tp, pp=pp, cpu=cpu, dtype=dtype, **config_overrides)
    return {
        "transformer_config": config,
        "model_provider": model_provider(arch, cpu=cpu, vocab_divisible_by=vocab_divisible_by, config=config,
                                         attention=attention),
        "vocab_size": arch.vocab_size,
        "padded_vocab_size": padded_vocab_size(arch.vocab_size, tp, vocab_divisible_by),
    }
