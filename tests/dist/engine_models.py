"""Tiny megatron-core GPTModels for the decode-engine tests, in both layer layouts the engine must serve.

* ``local``: the project's layer spec (``laconic_nemo.bridge.megatron.layer_spec``: separate ``input_layernorm``
  and ``pre_mlp_layernorm``, torch RMSNorm, column / row parallel linears);
* ``te``: the layout of megatron-core's TransformerEngine spec (``get_gpt_layer_with_transformer_engine_spec``,
  ``gpt_layer_specs.py:136-150`` and ``get_mlp_module_spec(use_te=True)``): ``input_layernorm`` and
  ``pre_mlp_layernorm`` left at their ``IdentityOp`` default (``transformer_layer.py:202,210``) and the RMSNorm
  fused into ``linear_qkv`` and ``linear_fc1`` (TE's ``LayerNormColumnParallelLinear``, weight
  ``layer_norm_weight``). TransformerEngine needs a GPU, so :class:`FusedNormColumnParallelLinear` stands in
  for it: megatron's own ``ColumnParallelLinear`` preceded by an RMSNorm whose weight it holds, under TE's name.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from laconic_nemo.bridge import ModelArch


def tiny_arch(**overrides) -> ModelArch:
    """A Qwen2-like shape: GQA (4 heads, 2 key-value groups), qkv bias, tied embeddings, RMSNorm, SwiGLU; a large
    init scale so that every token's distribution depends strongly on its context."""
    kw = dict(model_type="qwen2", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=16,
              ffn_hidden_size=96, vocab_size=29, max_position_embeddings=256, rope_theta=1e4, rms_norm_eps=1e-6,
              tie_word_embeddings=True, qkv_bias=True, qk_norm=False, initializer_range=0.15)
    kw.update(overrides)
    return ModelArch(**kw)


class FusedNormColumnParallelLinear(torch.nn.Module):
    """Stand-in for TransformerEngine's ``TELayerNormColumnParallelLinear`` on CPU: RMSNorm (weight
    ``layer_norm_weight``) then megatron's ``ColumnParallelLinear``; same constructor and call."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__()
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.linear = ColumnParallelLinear(input_size, output_size, config=config, **kwargs)
        self.weight = self.linear.weight  # the engine reads the dtype / device of linear_qkv.weight

    def forward(self, x, weight=None, runtime_gather_output=None):
        x = F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
        return self.linear(x, weight=weight, runtime_gather_output=runtime_gather_output)


def te_shaped_spec(arch: ModelArch, attention: str = "sdpa"):
    """The TransformerEngine spec's layout with local modules (see the module docstring)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from laconic_nemo.runtime.kernels import core_attention_module

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(  # input_layernorm / pre_mlp_layernorm: IdentityOp (the default)
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=FusedNormColumnParallelLinear,
                    core_attention=core_attention_module(attention),
                    linear_proj=RowParallelLinear,
                    q_layernorm=WrappedTorchNorm if arch.qk_norm else IdentityOp,
                    k_layernorm=WrappedTorchNorm if arch.qk_norm else IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=FusedNormColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def build_model(arch: ModelArch, layout: str = "local", attention: str = "sdpa", pre_process: bool = True,
                post_process: bool = True, seed: int = 0):
    """A GPTModel of ``arch`` with layer ``layout`` (local | te) at the current TP / PP, fp32 on CPU, its norm
    weights and biases moved away from 1 / 0 (a dropped or doubled norm changes the logits). The weights depend on
    ``seed`` only, on every TP rank alike where they are replicated."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from laconic_nemo.bridge.arch import padded_vocab_size
    from laconic_nemo.bridge.megatron import layer_spec, transformer_config

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    torch.manual_seed(seed)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    cfg = transformer_config(arch, tp=tp, pp=pp, cpu=True)
    spec = layer_spec(arch, attention) if layout == "local" else te_shaped_spec(arch, attention)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=padded_vocab_size(arch.vocab_size, tp),
                     max_sequence_length=arch.max_position_embeddings, pre_process=pre_process,
                     post_process=post_process, parallel_output=True,
                     share_embeddings_and_output_weights=arch.tie_word_embeddings, position_embedding_type="rope",
                     rotary_base=arch.rope_theta)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@torch.no_grad()
def full_forward_logprobs(model, vocab_size: int, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) [b, T-1] from the model's own full forward (TP 1, PP 1 or a
    gathered TP output), at ``temperature``."""
    from megatron.core import tensor_parallel

    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand(*tokens.shape)
    with warnings.catch_warnings():  # megatron's gather calls torch's deprecated all_gather_into_tensor: this
        warnings.simplefilter("ignore", FutureWarning)  # reference's warning, not the code under test's
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(model(tokens, pos, None))[..., :vocab_size]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)


def response_positions(out) -> torch.Tensor:
    """Bool [N, T-1]: the log-prob positions that score a response token of ``out`` (a GenerationOutput)."""
    n, T = out.tokens.shape
    j = torch.arange(T - 1).unsqueeze(0)
    p, r = out.prompt_lengths.unsqueeze(1), out.response_lengths.unsqueeze(1)
    return (j >= p - 1) & (j < p + r - 1)
