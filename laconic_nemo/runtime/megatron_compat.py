"""The megatron-core releases the project runs on, and the one place where their differences are handled.

* 0.11.0: NeMo-Aligner's container (``nvcr.io/nvidia/nemo:25.02``) and the ``nemo`` test tier
  (containers/cpu_nemo_venv.sh);
* 0.16.1: the last release for Python < 3.12, the main CPU test tier (pyproject's ``megatron`` extra);
* 0.19.2: Python >= 3.12, GPU hosts (scripts/gpu_wheelhouse.sh).

What differs is how megatron calls back into project code. Each adapter below serves every release and chooses
nothing from the version number: it accepts every form of the call, or reads what the installed megatron offers
(a signature, a module). The calls each release makes are recorded beside the adapter, cited to that release's
source (paths under ``megatron/core/``); tests/test_megatron_compat.py calls every adapter in every recorded form
and checks the installed release against its record.

(a) ``SelfAttention`` builds the core attention (``model.attention = sdpa``: runtime/kernels.SDPAttention) with
    ``pg_collection=`` in 0.16.1 and 0.19.2, without it in 0.11.0: :func:`tensor_parallel_size`.
(b) The schedules call ``config.finalize_model_grads_func`` with ``pg_collection=`` and ``force_all_reduce=``
    in 0.16.1 and 0.19.2, with two positional arguments only in 0.11.0: :func:`summed_grads_finalizer`.
(c) ``GPTModel.forward`` takes the KV cache as ``inference_params=`` in 0.11.0 and as ``inference_context=`` in
    0.16.1 and 0.19.2 (``inference_params=`` deprecated there, with a warning); 0.16.1 asserts
    ``runtime_gather_output`` when a cache is passed in eval mode: :func:`kv_cache_forward`.
(d) The TransformerEngine layer spec reads TE's classes from ``gpt_layer_specs``' own names in 0.11.0 and from
    ``TESpecProvider``'s module in 0.16.1 and 0.19.2: :func:`transformer_engine_layer_spec` (the tests read the
    layout the decode engine serves through it).
(e) The unfused gated MLP (``bias_activation_fusion`` off, as on every CPU run) multiplies ``silu(x[0]) * x[1]`` in
    0.11.0 and ``silu(x_glu) * (x_linear + glu_linear_offset)`` in 0.16.1 and 0.19.2, whose sum is one more
    ffn-sized tensor autograd keeps per token: :func:`glu_keeps_offset_sum` (the memory model counts it,
    actors/memory.layer_bytes_per_token).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

RELEASES = ("0.11.0", "0.16.1", "0.19.2")


@dataclass(frozen=True)
class Site:
    """Where a release makes (or defines) a call: ``path`` under ``megatron/core/``, the first and last line of each
    place (``spans``) and the names that stand there (``names``: the keywords passed, or the names defined)."""

    path: str
    spans: tuple[tuple[int, int], ...]
    names: tuple[str, ...]

    def cite(self) -> str:
        return self.path + ":" + ",".join(f"{a}-{b}" if b != a else str(a) for a, b in self.spans)


# (a) SelfAttention.__init__ -> submodules.core_attention(**keywords) (0.11.0 through build_module).
_CORE_ATTENTION = ("config", "layer_number", "attn_mask_type", "attention_type", "cp_comm_type", "softmax_scale")
CORE_ATTENTION_CALL = {
    "0.11.0": Site("transformer/attention.py", ((110, 118),), _CORE_ATTENTION),
    "0.16.1": Site("transformer/attention.py", ((318, 326),), _CORE_ATTENTION + ("pg_collection",)),
    "0.19.2": Site("transformer/attention.py", ((382, 390),), _CORE_ATTENTION + ("pg_collection",)),
}

# (b) the schedules (no pipelining, interleaved 1F1B, 1F1B) -> config.finalize_model_grads_func(model, num_tokens,
# **keywords).
FINALIZE_CALL = {
    "0.11.0": Site("pipeline_parallel/schedules.py", ((493, 495), (1475, 1477), (1877, 1879)), ()),
    "0.16.1": Site("pipeline_parallel/schedules.py", ((680, 685), (1919, 1924), (2311, 2316)),
                   ("pg_collection", "force_all_reduce")),
    "0.19.2": Site("pipeline_parallel/schedules.py", ((839, 844), (2065, 2070), (2459, 2464)),
                   ("pg_collection", "force_all_reduce")),
}

# (c) GPTModel.forward's parameters for the KV cache and the TP gather (runtime_gather_output=True: the output
# layer, a ColumnParallelLinear, gathers), and where the release asserts the gather in inference (none in 0.11.0;
# 0.16.1 when a cache is passed in eval mode; 0.19.2 under its InferenceMode).
GPT_FORWARD = {
    "0.11.0": Site("models/gpt/gpt_model.py", ((202, 205),), ("inference_params", "runtime_gather_output")),
    "0.16.1": Site("models/gpt/gpt_model.py", ((477, 482), (584, 586)),
                   ("inference_context", "runtime_gather_output", "inference_params")),
    "0.19.2": Site("models/gpt/gpt_model.py", ((526, 531), (648, 650)),
                   ("inference_context", "runtime_gather_output", "inference_params")),
}

# (d) get_gpt_layer_with_transformer_engine_spec(): the module whose names hold TE's classes (0.11.0: its own;
# 0.16.1 and 0.19.2: TESpecProvider's, which gpt_layer_specs imports only where TE imports: 0.16.1 :42-50 and
# TESpecProvider() at :222; 0.19.2 :46-54 and :233).
TE_SPEC_NAMES = ("TEColumnParallelLinear", "TEDotProductAttention", "TELayerNormColumnParallelLinear", "TENorm",
                 "TERowParallelLinear")
TE_SPEC_LOOKUP = {
    "0.11.0": Site("models/gpt/gpt_layer_specs.py", ((32, 38),), TE_SPEC_NAMES),
    "0.16.1": Site("extensions/transformer_engine_spec_provider.py", ((6, 16),), TE_SPEC_NAMES),
    "0.19.2": Site("extensions/transformer_engine_spec_provider.py", ((8, 18),), TE_SPEC_NAMES),
}
TE_SPEC_PROVIDER = "megatron.core.extensions.transformer_engine_spec_provider"

# (e) MLP.forward's unfused gated activation, ``glu`` (the product autograd saves its factors of)
GLU_PRODUCT = {
    "0.11.0": Site("transformer/mlp.py", ((119, 121),), ("def glu", "torch.chunk", "activation_func(x[0]) * x[1]")),
    "0.16.1": Site("transformer/mlp.py", ((219, 226),), ("def glu", "torch.chunk", "x_linear + self.config.glu_linear_offset")),
    "0.19.2": Site("transformer/mlp.py", ((324, 331),), ("def glu", "torch.chunk", "x_linear + self.config.glu_linear_offset")),
}


def installed_release() -> str:
    """The installed megatron-core's version string."""
    from importlib.metadata import version

    return version("megatron-core")


# ------------------------------------------------------------------------------------------ (a) core attention
def tensor_parallel_size(pg_collection: Any = None) -> int:
    """The TP size a core attention is built for: its ``pg_collection``'s ``tp`` group where megatron hands one
    (0.16.1, 0.19.2: :data:`CORE_ATTENTION_CALL`), else ``parallel_state``'s (0.11.0)."""
    group = getattr(pg_collection, "tp", None)
    if group is not None:
        return int(group.size())
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


# ---------------------------------------------------------------------------------- (b) finalize_model_grads
def summed_grads_finalizer(finalize: Callable) -> Callable:
    """The ``finalize_model_grads_func`` of a TransformerConfig whose gradients stay SUMMED: it calls ``finalize``
    (megatron's ``finalize_model_grads``) with no token count, whatever count the schedule passes, and hands on
    the keywords the schedule adds (:data:`FINALIZE_CALL`; megatron's own ``finalize_model_grads`` takes the same
    ones in the same release)."""

    def finalize_summed(model: list, num_tokens: torch.Tensor | None = None, **keywords):
        return finalize(model, None, **keywords)

    return finalize_summed


# ------------------------------------------------------------------------------------ (c) forward with a KV cache
def kv_cache_forward(model: Any, tokens: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache) -> Any:
    """``GPTModel.forward`` of ``tokens`` [b, s] over the KV cache ``cache`` (megatron's ``InferenceParams``; a
    ``StaticInferenceContext`` in 0.16.1 and 0.19.2), with the logits gathered over TP (``runtime_gather_output=True``:
    [b, s, padded vocab] on every TP rank; 0.16.1 keeps the last position only). The cache goes in under the
    keyword the model's ``forward`` names (:data:`GPT_FORWARD`). ``model`` may be wrapped (megatron's DDP hands
    keywords on: the signature is read from the innermost ``.module``)."""
    inner = model
    while isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    names = inspect.signature(type(inner).forward).parameters
    keyword = "inference_context" if "inference_context" in names else "inference_params"
    return model(tokens, position_ids, attention_mask, runtime_gather_output=True, **{keyword: cache})


# ---------------------------------------------------------------------------------------- (d) the TE layer spec
def transformer_engine_layer_spec(stand_ins: dict[str, type], **spec_kwargs):
    """megatron-core's TransformerEngine layer spec (``get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)``)
    with TE's classes replaced by ``stand_ins`` (names from :data:`TE_SPEC_NAMES`) where the installed release
    reads them (:data:`TE_SPEC_LOOKUP`), and TE version checks answering True; every name is restored afterwards.
    TransformerEngine needs a GPU: this lets the spec's layout be read on any machine."""
    import megatron.core.models.gpt.gpt_layer_specs as specs

    has_provider = importlib.util.find_spec(TE_SPEC_PROVIDER) is not None
    target = importlib.import_module(TE_SPEC_PROVIDER) if has_provider else specs
    patches = [(target, name, cls) for name, cls in stand_ins.items()]
    patches += [(obj, "is_te_min_version", lambda *a, **k: True) for obj in {target, specs}]
    if has_provider:  # without TE installed the spec module leaves its TESpecProvider name unset or None
        patches.append((specs, "TESpecProvider", target.TESpecProvider))
    missing = object()
    saved = [(obj, name, getattr(obj, name, missing)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        return specs.get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)
    finally:
        for obj, name, value in saved:
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def glu_keeps_offset_sum(config: Any) -> bool:
    """Whether megatron's unfused gated MLP keeps ``x_linear + glu_linear_offset`` for backward, one more tensor of
    the MLP's width per token (:data:`GLU_PRODUCT`): read from ``config`` (a TransformerConfig), which has
    ``glu_linear_offset`` in exactly the releases that add it (0.16.1 ``transformer/transformer_config.py:180``,
    0.19.2 ``:224``; 0.11.0 has none)."""
    return hasattr(config, "glu_linear_offset")
