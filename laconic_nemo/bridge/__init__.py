"""Bridge between Hugging Face checkpoints (and vLLM, which uses the same names) and megatron-core GPTModel.

Typical use on every rank of a TP x PP job::

    arch = arch_from_hf_config(path)
    actor = MegatronCoreActor(info, **actor_kwargs(arch, tp, pp), lr=...)
    load_hf_checkpoint(actor.model, path, arch)         # each rank reads only its shards
    ...
    save_hf_checkpoint(actor.model, arch, out_dir, source=path)  # gathered on global rank 0

See docs/bridge.md for the name table and the layouts.
"""

from __future__ import annotations

from laconic_nemo.bridge.arch import ModelArch, arch_from_hf_config, padded_vocab_size
from laconic_nemo.bridge.hf_io import LazySafetensors, load_safetensors_dir, save_safetensors_dir
from laconic_nemo.bridge.mapping import (
    export_hf_state_dict,
    hf_names,
    hf_shapes,
    iter_hf_tensors,
    load_hf_state_dict,
    weight_map,
)
from laconic_nemo.bridge.megatron import actor_kwargs, build_gpt_model, layer_spec, model_provider, transformer_config

__all__ = [
    "ModelArch", "arch_from_hf_config", "padded_vocab_size", "transformer_config", "layer_spec", "build_gpt_model",
    "model_provider", "actor_kwargs", "weight_map", "hf_names", "hf_shapes", "load_hf_state_dict", "export_hf_state_dict",
    "iter_hf_tensors", "LazySafetensors", "load_safetensors_dir", "save_safetensors_dir", "load_hf_checkpoint",
    "save_hf_checkpoint",
]


def load_hf_checkpoint(model_chunks, path: str, arch: ModelArch | None = None) -> ModelArch:
    """Load a HF checkpoint directory into this rank's model chunks (lazy reads). Returns the arch."""
    arch = arch or arch_from_hf_config(path)
    load_hf_state_dict(model_chunks, LazySafetensors(path), arch)
    return arch


def save_hf_checkpoint(model_chunks, arch: ModelArch, path: str, source: str | None = None, dst: int = 0,
                       config: dict | None = None) -> None:
    """Gather the model and write a HF checkpoint directory on global rank ``dst`` (collective).

    source: the original checkpoint directory, whose config.json and tokenizer files are copied;
    config: a config dict to write instead."""
    import torch.distributed as dist

    state = export_hf_state_dict(model_chunks, arch, dst=dst)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == dst:
        save_safetensors_dir(path, state, config=config if config is not None else source, copy_from=source)
    if dist.is_initialized():
        dist.barrier()
