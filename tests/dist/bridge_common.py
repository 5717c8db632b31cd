"""Tiny randomly initialised transformers models for the bridge tests (built locally, no download)."""

from __future__ import annotations

import torch

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
            vocab_size=100, max_position_embeddings=128, rms_norm_eps=1e-6)

# name -> (config class, model class, extra config)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
}


def tiny_hf_model(family: str, seed: int = 0, **overrides):
    """(config, model) of a tiny randomly initialised HF causal LM. Norm weights and biases are
    perturbed away from their 1/0 initialisation so that a swapped or dropped tensor changes the logits."""
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**{**BASE, **extra, **overrides})
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return cfg, model


def hf_checkpoint_tensors(model, tied: bool) -> dict[str, torch.Tensor]:
    """The tensors a saved HF checkpoint holds (the tied lm_head is not stored)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight", None)
    return sd


def megatron_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, padded_vocab / tp] of a single-stage megatron GPTModel (causal, no mask tensor)."""
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    with torch.no_grad():
        return model(ids, pos, None)
