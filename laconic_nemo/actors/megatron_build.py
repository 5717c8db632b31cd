"""Model building for the megatron-core actor: the GPTModel of a recipe (the synthetic GPT of ``model:``, or a
Hugging Face checkpoint through :mod:`laconic_nemo.bridge`), wrapped in megatron's DDP with gradients SUMMED over
micro-batches and data-parallel ranks, and its optimiser.

The recipe's values were checked at the config boundary and the layout (heads / layers / key-value heads against
TP and PP) by the pre-flight (:func:`laconic_nemo.plan.layout.plan_layout`); what is checked here depends on the
device only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from laconic_nemo.config import ModelConfig
from laconic_nemo.runtime.kernels import fusion_flags, resolve_attention, rotate_packed_rows, with_core_attention
from laconic_nemo.runtime.megatron_compat import summed_grads_finalizer
from laconic_nemo.runtime.megatron_env import ParallelInfo

ModelProvider = Callable[[bool, bool], torch.nn.Module]


def resolve_choice(value: str, auto: str) -> str:
    """A ``*_CHOICES`` setting (checked at the config boundary) with ``auto`` replaced by ``auto``."""
    return auto if value == "auto" else value


def pad_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of ``tp`` that is >= vocab_size."""
    return ((vocab_size + tp - 1) // tp) * tp


@dataclass
class ModelParts:
    """What the actor is built from: megatron's TransformerConfig, the ``(pre_process, post_process) -> GPTModel``
    provider of this pipeline stage, the real and the TP-padded vocabulary, and the Hugging Face checkpoint whose
    weights to load (None: the synthetic GPT, initialised by megatron)."""

    transformer_config: Any
    model_provider: ModelProvider
    vocab_size: int
    padded_vocab_size: int
    hf_path: str | None = None
    hf_arch: Any = None


def model_parts(model: ModelConfig, info: ParallelInfo, model_provider: ModelProvider | None = None) -> ModelParts:
    """The GPT of the ``model:`` section on this rank's layout: a Hugging Face checkpoint's architecture and shapes
    (``source: hf``, :mod:`laconic_nemo.bridge`), the synthetic GPT with the architecture of ``model.shape_from``
    (a config.json; random weights), else the synthetic GPT of its shape keys. ``model_provider`` replaces the
    synthetic GPT's provider."""
    on_gpu = info.device.type == "cuda"
    attention = resolve_attention(model.attention, on_gpu)
    if model.source == "hf" or model.shape_from:
        from laconic_nemo.bridge import arch_from_hf_config
        from laconic_nemo.bridge.megatron import actor_kwargs

        arch = arch_from_hf_config(str(model.path if model.source == "hf" else model.shape_from))
        if model.source != "hf" and arch.vocab_size < model.vocab_size:
            raise ValueError(f"model.shape_from = {model.shape_from!r}: its vocabulary ({arch.vocab_size}) must hold "
                             f"the synthetic task's {model.vocab_size} token ids")
        dtype = torch.bfloat16 if model.precision == "bf16" else None
        kw = actor_kwargs(arch, info.tp_size, info.pp_size, cpu=not on_gpu, dtype=dtype, attention=attention)
        if model.source != "hf":  # the architecture only: megatron's random initialisation
            return ModelParts(kw["transformer_config"], model_provider or kw["model_provider"], kw["vocab_size"],
                              kw["padded_vocab_size"])
        return ModelParts(kw["transformer_config"], model_provider or kw["model_provider"], kw["vocab_size"],
                          kw["padded_vocab_size"], hf_path=str(model.path), hf_arch=arch)
    tconfig = build_transformer_config(model, info.tp_size, info.pp_size, on_gpu=on_gpu)
    padded = pad_vocab_size(model.vocab_size, info.tp_size)
    if model_provider is None:
        def model_provider(pre_process: bool, post_process: bool):
            return build_gpt_model(tconfig, padded, model.max_position_embeddings, pre_process, post_process,
                                   attention)

    return ModelParts(tconfig, model_provider, model.vocab_size, padded)


def build_transformer_config(model: ModelConfig, tp: int, pp: int, on_gpu: bool):
    """megatron TransformerConfig for the synthetic GPT of ``model`` (dropout 0; fp32 and fusions off on CPU, the
    available fusions on GPU: :func:`laconic_nemo.runtime.kernels.fusion_flags`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if model.precision not in ("fp32", "bf16"):
        raise ValueError(f"model.precision must be fp32 or bf16 for the megatron-core actor, got {model.precision!r}")
    if model.precision == "bf16" and not on_gpu:
        raise ValueError("model.precision=bf16 needs a GPU; use fp32 on CPU")
    dtype = torch.bfloat16 if model.precision == "bf16" else torch.float32
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=model.precision == "bf16",
        use_cpu_initialization=not on_gpu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
        **fusion_flags(on_gpu),
    )


def build_gpt_model(tconfig: Any, padded_vocab_size: int, max_position_embeddings: int, pre_process: bool,
                    post_process: bool, attention: str = "local"):
    """megatron-core GPTModel with the local layer spec, core attention ``attention`` (a resolved
    ``model.attention``, see :mod:`laconic_nemo.runtime.kernels`), RoPE (per token in packed micro-batches:
    :func:`laconic_nemo.runtime.kernels.rotate_packed_rows`), untied output."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    return rotate_packed_rows(GPTModel(
        config=tconfig,
        transformer_layer_spec=with_core_attention(get_gpt_layer_local_spec(), attention),
        vocab_size=padded_vocab_size,
        max_sequence_length=max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    ), attention)


def wrap_model(model_provider: ModelProvider, transformer_config: Any, device: torch.device) -> list:
    """This pipeline stage's GPTModel in megatron's DDP, as a list of one model chunk.

    Gradients are SUMMED over micro-batches and DP ranks (``calculate_per_token_loss=True``, set before the DDP
    wrapper: megatron-core fixes its gradient scaling factor, 1 or 1/DP, from it when DDP is built), and
    ``finalize_model_grads`` is called without a token count."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    module = model_provider(parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())
    # every weight in the model's dtype (megatron-LM's Float16Module does the same): the local spec's
    # torch RMSNorm is created in float32, and a bf16 input with a float32 weight misses the fused kernel
    module.to(device=device, dtype=transformer_config.params_dtype)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    transformer_config.calculate_per_token_loss = True
    model = [DistributedDataParallel(config=transformer_config, ddp_config=ddp_config, module=module)]
    transformer_config.finalize_model_grads_func = summed_grads_finalizer(finalize_model_grads)
    transformer_config.no_sync_func = model[0].no_sync
    transformer_config.grad_scale_func = None
    return model


def build_optimizer(model: list, transformer_config: Any, lr: float, weight_decay: float, adam_beta1: float,
                    adam_beta2: float, adam_eps: float):
    """megatron-core's plain (non-distributed) Adam over ``model``; the global grad-norm clip is the actor's own
    (megatron's asserts CUDA tensors)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=adam_beta1, adam_beta2=adam_beta2,
        adam_eps=adam_eps, clip_grad=0.0, bf16=bool(transformer_config.bf16), fp16=False,
        params_dtype=transformer_config.params_dtype, use_distributed_optimizer=False,
    )
    return get_megatron_optimizer(opt_config, model)
