"""Weight mapping between Hugging Face names and a TP-sharded, PP-staged megatron-core GPTModel.

Name table (``i`` = global layer index; megatron stores layers per stage with local indices, the
global index is ``layer.layer_number - 1``):

=============================================  ==========================================================  ========
megatron-core (local spec)                     Hugging Face (Qwen2 / Qwen3 / Llama)                        TP split
=============================================  ==========================================================  ========
embedding.word_embeddings.weight  [Vp, H]      model.embed_tokens.weight [V, H] (rows padded to Vp)        vocab
decoder.layers.i.input_layernorm.weight        model.layers.i.input_layernorm.weight                       none
decoder.layers.i.self_attention.linear_qkv.*   model.layers.i.self_attn.{q,k,v}_proj.{weight,bias}         qkv
decoder.layers.i.self_attention.q_layernorm.w  model.layers.i.self_attn.q_norm.weight (Qwen3)              none
decoder.layers.i.self_attention.k_layernorm.w  model.layers.i.self_attn.k_norm.weight (Qwen3)              none
decoder.layers.i.self_attention.linear_proj.w  model.layers.i.self_attn.o_proj.weight                      row
decoder.layers.i.pre_mlp_layernorm.weight      model.layers.i.post_attention_layernorm.weight              none
decoder.layers.i.mlp.linear_fc1.weight         model.layers.i.mlp.{gate,up}_proj.weight                    fc1
decoder.layers.i.mlp.linear_fc2.weight         model.layers.i.mlp.down_proj.weight                         row
decoder.final_layernorm.weight                 model.norm.weight                                           none
output_layer.weight [Vp, H]                    lm_head.weight (tied: model.embed_tokens.weight)            vocab
=============================================  ==========================================================  ========

Layouts ("full" = the concatenation of the TP shards along the split dimension):

* qkv: megatron fuses q, k, v per query group: for every KV head g, the rows of its
  ``heads_per_group`` query heads, then key head g, then value head g ([q_g..., k_g, v_g] blocks of
  ``head_dim`` rows). TP splits whole groups, so a rank's shard is a contiguous block of the full tensor.
* fc1: each TP rank holds ``[gate_shard; up_shard]``; the full tensor is ``cat_r [gate_r; up_r]``.
* column/vocab split dim 0, row split dim 1; vocab rows beyond V are padding (zero on import,
  dropped on export).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from laconic_nemo.bridge.arch import ModelArch

SPLIT_DIM = {"none": None, "qkv": 0, "fc1": 0, "column": 0, "vocab": 0, "row": 1}


@dataclass(frozen=True)
class Entry:
    """One megatron parameter and the HF tensors it is made of.

    megatron: global megatron name (layer index global); hf: HF names in the order the conversion
    expects; kind: a key of SPLIT_DIM plus the fused layouts "qkv"/"fc1"; layer: global layer or None.
    """

    megatron: str
    hf: tuple[str, ...]
    kind: str
    layer: int | None = None


def layer_entries(arch: ModelArch, i: int) -> list[Entry]:
    """The entries of global layer ``i`` (in a fixed order shared by every rank)."""
    p, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    out = [
        Entry(p + "input_layernorm.weight", (h + "input_layernorm.weight",), "none", i),
        Entry(p + "self_attention.linear_qkv.weight",
              tuple(h + f"self_attn.{x}_proj.weight" for x in "qkv"), "qkv", i),
    ]
    if arch.qkv_bias:
        out.append(Entry(p + "self_attention.linear_qkv.bias",
                         tuple(h + f"self_attn.{x}_proj.bias" for x in "qkv"), "qkv", i))
    if arch.qk_norm:
        out.append(Entry(p + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), "none", i))
        out.append(Entry(p + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), "none", i))
    out += [
        Entry(p + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row", i),
        Entry(p + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "none", i),
        Entry(p + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "fc1", i),
        Entry(p + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row", i),
    ]
    return out


def weight_map(arch: ModelArch) -> list[Entry]:
    """Every entry of the model in HF order (embedding, layers, final norm, lm head).
    With tied embeddings the output layer maps to ``model.embed_tokens.weight``."""
    out = [Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(arch.num_layers):
        out += layer_entries(arch, i)
    out.append(Entry("decoder.final_layernorm.weight", ("model.norm.weight",), "none"))
    out.append(Entry("output_layer.weight",
                     ("model.embed_tokens.weight",) if arch.tie_word_embeddings else ("lm_head.weight",), "vocab"))
    return out


def hf_names(arch: ModelArch) -> list[str]:
    """The HF tensor names of a full checkpoint of ``arch`` (what vLLM's ``load_weights`` expects)."""
    names: list[str] = []
    for e in weight_map(arch):
        for n in e.hf:
            if n not in names:
                names.append(n)
    return names


def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """HF name -> shape for ``arch`` (as in a transformers checkpoint)."""
    H, d, F = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    nq, nkv = arch.num_attention_heads * d, arch.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size, H), "model.norm.weight": (H,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, H)
    for i in range(arch.num_layers):
        h = f"model.layers.{i}."
        shapes.update({
            h + "input_layernorm.weight": (H,), h + "post_attention_layernorm.weight": (H,),
            h + "self_attn.q_proj.weight": (nq, H), h + "self_attn.k_proj.weight": (nkv, H),
            h + "self_attn.v_proj.weight": (nkv, H), h + "self_attn.o_proj.weight": (H, nq),
            h + "mlp.gate_proj.weight": (F, H), h + "mlp.up_proj.weight": (F, H), h + "mlp.down_proj.weight": (H, F),
        })
        if arch.qkv_bias:
            shapes.update({h + "self_attn.q_proj.bias": (nq,), h + "self_attn.k_proj.bias": (nkv,),
                           h + "self_attn.v_proj.bias": (nkv,)})
        if arch.qk_norm:
            shapes.update({h + "self_attn.q_norm.weight": (d,), h + "self_attn.k_norm.weight": (d,)})
    return shapes


# ----------------------------------------------------------------------------------------------------------
# Pure tensor conversions (full tensors)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """HF q [nh*d, ...], k/v [nkv*d, ...] -> megatron fused [(nh + 2*nkv)*d, ...] in per-group order
    [q heads of group g, k_g, v_g] for g = 0..nkv-1 (weights [., H] and biases [.] alike)."""
    d, g, hpg = arch.head_dim, arch.num_kv_heads, arch.heads_per_group
    rest = q.shape[1:]
    if q.shape[0] != arch.num_attention_heads * d or k.shape[0] != g * d or v.shape[0] != g * d:
        raise ValueError(f"q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} do not match {arch}")
    fused = torch.cat([q.reshape(g, hpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
    return fused.reshape(g * (hpg + 2) * d, *rest)


def split_qkv(fused: torch.Tensor, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    d, g, hpg = arch.head_dim, arch.num_kv_heads, arch.heads_per_group
    rest = fused.shape[1:]
    x = fused.reshape(g, (hpg + 2) * d, *rest)
    q, k, v = torch.split(x, [hpg * d, d, d], dim=1)
    return (q.reshape(g * hpg * d, *rest).contiguous(), k.reshape(g * d, *rest).contiguous(),
            v.reshape(g * d, *rest).contiguous())


def fuse_fc1(gate: torch.Tensor, up: torch.Tensor, tp: int) -> torch.Tensor:
    """HF gate/up [F, H] -> megatron full fc1 [2F, H] = cat over TP ranks r of [gate_r; up_r]."""
    return torch.cat([torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))], dim=0)


def split_fc1(fc1: torch.Tensor, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_fc1`."""
    gates, ups = [], []
    for shard in fc1.chunk(tp, 0):
        g, u = shard.chunk(2, 0)
        gates.append(g)
        ups.append(u)
    return torch.cat(gates, 0), torch.cat(ups, 0)


def hf_to_full(entry: Entry, tensors: list[torch.Tensor], arch: ModelArch, tp: int,
               padded_vocab: int | None = None) -> torch.Tensor:
    """HF tensors of ``entry`` -> the full megatron tensor (TP shards concatenated)."""
    if entry.kind == "qkv":
        return fuse_qkv(*tensors, arch)
    if entry.kind == "fc1":
        return fuse_fc1(*tensors, tp)
    (t,) = tensors
    if entry.kind == "vocab" and padded_vocab is not None and padded_vocab != t.shape[0]:
        if padded_vocab < t.shape[0]:
            raise ValueError(f"padded vocab {padded_vocab} < HF vocab {t.shape[0]} for {entry.megatron}")
        t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])], 0)
    return t


def full_to_hf(entry: Entry, full: torch.Tensor, arch: ModelArch, tp: int) -> dict[str, torch.Tensor]:
    """Inverse of :func:`hf_to_full` (drops vocab padding)."""
    if entry.kind == "qkv":
        return dict(zip(entry.hf, split_qkv(full, arch)))
    if entry.kind == "fc1":
        return dict(zip(entry.hf, split_fc1(full, tp)))
    if entry.kind == "vocab":
        full = full[: arch.vocab_size]
    return {entry.hf[0]: full}


def shard(full: torch.Tensor, kind: str, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's shard of a full megatron tensor."""
    dim = SPLIT_DIM[kind]
    if dim is None or tp == 1:
        return full
    if full.shape[dim] % tp != 0:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} is not divisible by tp={tp}")
    return full.chunk(tp, dim)[rank]


# ----------------------------------------------------------------------------------------------------------
# Model side


def unwrap(module):
    """The GPTModel inside DDP / Float16Module wrappers."""
    from megatron.core.models.gpt import GPTModel

    m = module
    while not isinstance(m, GPTModel) and hasattr(m, "module"):
        m = m.module
    if not isinstance(m, GPTModel):
        raise TypeError(f"expected a megatron-core GPTModel (possibly wrapped), got {type(module).__name__}")
    return m


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def local_parameters(model_chunks) -> dict[str, torch.nn.Parameter]:
    """Global megatron name -> parameter of this rank, over all model chunks (virtual stages).

    Layer indices are made global with ``layer_number - 1``. Parameters that megatron-core does not
    allocate (the output layer of a tied model on the first stage) are absent."""
    if not isinstance(model_chunks, (list, tuple)):
        model_chunks = [model_chunks]
    out: dict[str, torch.nn.Parameter] = {}
    for chunk in model_chunks:
        model = unwrap(chunk)
        for name, param in model.named_parameters():
            m = _LAYER.match(name)
            if m:
                layer = model.decoder.layers[int(m.group(1))]
                name = f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"
            if name in out:
                raise ValueError(f"parameter {name} appears in two model chunks")
            out[name] = param
    return out


def _parallel():
    """(tp_size, tp_rank, tp_group, pp_size, pp_group) or single-process defaults."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                    ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_world_size(),
                    ps.get_pipeline_model_parallel_group())
    except ImportError:
        pass
    return 1, 0, None, 1, None


@torch.no_grad()
def load_hf_state_dict(model_chunks, hf_state_dict: Mapping[str, torch.Tensor], arch: ModelArch) -> list[str]:
    """Copy HF weights into this rank's shards (every rank calls it; no communication).

    hf_state_dict: any mapping name -> tensor (e.g. :class:`laconic_nemo.bridge.hf_io.LazySafetensors`, read
    on access); only the tensors this rank needs are read. Every parameter of the chunks must be covered.
    Returns the HF names that were read. Raises KeyError for a missing HF tensor and ValueError for a shape
    mismatch or an unmapped megatron parameter."""
    tp, tp_rank, _, _, _ = _parallel()
    params = local_parameters(model_chunks)
    entries = {e.megatron: e for e in weight_map(arch)}
    unknown = sorted(set(params) - set(entries))
    if unknown:
        raise ValueError(f"megatron parameters without a HF mapping: {unknown[:5]} (arch {arch.model_type})")
    used: list[str] = []
    for name, param in params.items():
        e = entries[name]
        missing = [n for n in e.hf if n not in hf_state_dict]
        if missing and e.megatron == "output_layer.weight" and "model.embed_tokens.weight" in hf_state_dict \
                and arch.tie_word_embeddings:
            missing = []
        if missing:
            raise KeyError(f"HF state dict lacks {missing} needed for megatron {name}")
        tensors = [hf_state_dict[n] for n in e.hf]
        dim = SPLIT_DIM[e.kind]
        padded = param.shape[0] * tp if e.kind == "vocab" else None
        full = hf_to_full(e, tensors, arch, tp, padded)
        piece = shard(full, e.kind, tp, tp_rank)
        if tuple(piece.shape) != tuple(param.shape):
            raise ValueError(f"{name}: mapped shape {tuple(piece.shape)} != parameter shape {tuple(param.shape)} "
                             f"(tp={tp}, split dim {dim})")
        param.copy_(piece.to(dtype=param.dtype, device=param.device))
        used += [n for n in e.hf if n not in used]
    return used


def _gather_tp(t: torch.Tensor, kind: str, tp: int, group) -> torch.Tensor:
    dim = SPLIT_DIM[kind]
    if dim is None or tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


@torch.no_grad()
def iter_hf_tensors(model_chunks, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for the whole model, in HF order, on EVERY rank.

    Collective: every rank of the model-parallel group must run the loop to the end, in step. TP shards
    are all-gathered within the TP group; each tensor is then broadcast from the pipeline stage that
    holds it to the other stages. With tied embeddings ``lm_head.weight`` is not yielded. Tensors stay on
    the parameters' device and may alias them (tp=1, pp=1): copy them if the model is trained further."""
    tp, _, tp_group, pp, pp_group = _parallel()
    params = local_parameters(model_chunks)
    entries = weight_map(arch)
    if arch.tie_word_embeddings:
        entries = [e for e in entries if e.megatron != "output_layer.weight"]
    # which stage holds what, with full shapes and dtypes: one object all-gather over the PP group
    mine = {}
    for e in entries:
        if e.megatron in params:
            p = params[e.megatron]
            shape = list(p.shape)
            dim = SPLIT_DIM[e.kind]
            if dim is not None:
                shape[dim] *= tp
            mine[e.megatron] = (tuple(shape), p.dtype)
    if pp > 1:
        stages: list = [None] * pp
        torch.distributed.all_gather_object(stages, mine, group=pp_group)
    else:
        stages = [mine]
    device = next(iter(params.values())).device if params else torch.device("cpu")
    for e in entries:
        owner = next((s for s, held in enumerate(stages) if e.megatron in held), None)
        if owner is None:
            raise ValueError(f"no pipeline stage holds {e.megatron}")
        if e.megatron in params:
            full = _gather_tp(params[e.megatron].detach(), e.kind, tp, tp_group)
        else:
            shape, dtype = stages[owner][e.megatron]
            full = torch.empty(shape, dtype=dtype, device=device)
        if pp > 1:
            src = torch.distributed.get_global_rank(pp_group, owner)
            full = full.contiguous()
            torch.distributed.broadcast(full, src=src, group=pp_group)
        yield from full_to_hf(e, full, arch, tp).items()


def export_hf_state_dict(model_chunks, arch: ModelArch, dst: int | None = None, device: str | None = "cpu",
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Full HF state dict of the model (TP shards gathered, PP stages collected). Collective.

    dst: None -> every rank returns the dict; an int -> only that global rank does, the others return {}.
    device/dtype: where and in what dtype to put the tensors (copies; None keeps the parameter's)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    keep = dst is None or rank == dst
    out: dict[str, torch.Tensor] = {}
    for name, t in iter_hf_tensors(model_chunks, arch):
        if keep:
            t = t.detach().to(device=device or t.device, dtype=dtype or t.dtype, copy=True).contiguous()
            out[name] = t
    return out
