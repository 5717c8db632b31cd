"""The decode engine: generation for any megatron-core ``GPTModel`` from its own submodules, a static KV cache
and a decode step captured as a CUDA graph per batch-size bucket.

Both actors sample through it (``rollout.engine: megatron``): the megatron-core actor on its ``GPTModel``
and the NeMo-Aligner actor on the ``GPTModel`` inside its ``MegatronGPTModel`` (:func:`unwrap_gpt_model`).

What it calls of the model (megatron-core 0.11; line numbers of that release)
-------------------------------------------------------------------------------
The engine does not call ``GPTModel.forward`` nor ``TransformerLayer.forward`` (they rebuild the RoPE table,
go through ``InferenceParams`` and ``torch.cat`` the KV cache); it calls, in the order
``TransformerLayer.forward`` does (``transformer/transformer_layer.py:383-447``), each layer's own
modules: ``input_layernorm`` -> ``self_attention.get_query_key_value_tensors`` (``attention.py:615-665``:
``linear_qkv``, the split into per-group query / key / value heads, q/k layernorm for Qwen3) -> RoPE from the
model's own table (``GPTModel.rotary_pos_emb``) with one position PER ROW, in the arithmetic of megatron's
unfused ``_apply_rotary_pos_emb_bshd`` (``rope_utils.py:88-122``, its ``_rotate_half``) but with the cosine and
sine taken once per step instead of twice per layer -> the engine's core attention over the static cache -> ``self_attention.linear_proj`` -> ``self_attn_bda`` ->
``pre_mlp_layernorm`` -> ``mlp`` -> ``mlp_bda``; then ``decoder.final_layernorm`` and ``output_layer``
(with ``shared_embedding_or_output_weight()`` when embeddings are tied, as ``gpt_model.py:279-284``).
Tensor-parallel collectives therefore come from the modules themselves (column / row parallel linears),
and the TransformerEngine layer spec works by construction: there ``input_layernorm`` and
``pre_mlp_layernorm`` are ``IdentityOp`` and the norms are fused into ``linear_qkv`` / ``linear_fc1``
(``gpt_layer_specs.py:136-150``). The model's core-attention module is not used in decode. The word
embedding at TP > 1 is looked up by the engine from ``embedding.word_embeddings``' weight shard and
all-reduced with megatron's ``reduce_from_tensor_model_parallel_region``: ``VocabParallelEmbedding.forward``
(``tensor_parallel/layers.py:247-263``) masks with boolean indexing, which synchronises with the host and
cannot be captured; the result is the same (the shard rows of out-of-range tokens are zero before the sum).

The loop
--------
1. Prefill: the prompts of a pass are de-duplicated (GRPO repeats each prompt G times), right-padded and run
   causally in as few forwards as the ``rollout.prefill_tokens`` budget allows; their keys and values are
   copied into the cache rows of every sample of that prompt. The last prompt position's logits give each
   sample's first token.
2. Decode: one token per live row per step, at the row's own position (prompts of different lengths need no
   forcing). The step - embedding, layers, final norm, logits, sampling, EOS / length bookkeeping, the
   token written into the output buffer - is one function of static buffers, run by
   :class:`~laconic_nemo.rollout.graphs.GraphRunner` (a CUDA graph per (bucket, KV length, sampling
   settings) on GPU; the same function eagerly on CPU).
3. Every ``rollout.sync_every`` steps the host reads the finished flags (its only synchronisation in the
   ``device`` sampler): when every row is done the pass ends; when the live rows fit a smaller bucket of
   ``rollout.batch_buckets`` they are moved down (state and KV rows, in place) and the steps run at that
   bucket. Attention reads ``[0, kv)`` of the cache, kv the longest live row's reach in the next window
   rounded up to ``rollout.kv_block``.

Sampling is today's, reused from :mod:`laconic_nemo.rollout.megatron_sampler`: ``device`` draws with
:func:`counter_uniforms` + :func:`draw_on_device` (uniform of token t of sample i a hash of (seed, stream, i,
t)); ``exact`` draws on the host with :func:`filtered_probs` + :func:`draw` from sample i's own
``torch.Generator`` seeded by :func:`sample_seed`, one uniform per generated token, exactly as
:func:`~laconic_nemo.rollout.megatron_sampler.sample`. A sample's tokens thus depend on (seed, stream,
sample index, step) only, not on the batch, the pass or the bucket it sits in.

Pipeline parallelism: every stage runs its own layers on its own cache; per token the ``[b, hidden]`` state
goes to the next stage by point-to-point send / receive (outside the graphs), the last stage samples and
broadcasts the tokens over the pipeline group, and every stage keeps the same bookkeeping. Each stage's
compute is one graph. The stages take turns (no micro-batch overlap): a pipeline of P stages decodes at
about the speed of one GPU holding the whole model, with 1/P of the weights and cache per GPU and no copy
of the other stages' weights (the alternative, generating on a gathered copy of all stages, as several RL
frameworks do, needs the whole model's memory on every GPU and a weight gather per rollout).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from laconic_nemo.grpo.interfaces import GenerationOutput, SamplingParams
from laconic_nemo.rollout.graphs import GraphRunner, bucket_for, kv_length
from laconic_nemo.rollout.kv_cache import KVCacheShape, StaticKVCache, check_fits, device_memory_bytes
from laconic_nemo.rollout.megatron_sampler import (
    check_sampling,
    counter_uniforms,
    draw,
    draw_on_device,
    filtered_probs,
    sample_seed,
)

ENGINE_SAMPLERS = ("exact", "device")
DEFAULT_BUCKETS = (8, 16, 32, 64, 128, 256, 512)


def gather_last_dim(t: torch.Tensor, group) -> torch.Tensor:
    """The TP shards of ``t`` side by side: [..., n] on each of the tp ranks of ``group`` -> [..., tp * n] (rank r's
    shard in columns r*n..(r+1)*n, as megatron's ``gather_from_tensor_model_parallel_region``), through torch's
    ``all_gather_single`` (torch >= 2.13 deprecates the ``all_gather_into_tensor`` that megatron-core 0.11 calls;
    older torch has only that). A copy of bytes: the result is bit for bit megatron's."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return t
    t = t.contiguous()
    out = torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)
    return torch.cat(out.chunk(world, dim=0), dim=-1).contiguous()


@dataclass
class EngineSettings:
    """The engine's knobs, the ``rollout.*`` keys of the same names (``laconic_nemo/config.py`` documents them).

    sampler: ``exact`` or ``device`` (resolved, not ``auto``); kv_cache_rows: None = as many as a call needs;
    max_new_tokens: ``rollout.max_new_tokens``, with ``max_prompt_length`` the cache's planned positions."""

    sampler: str = "exact"
    sync_every: int = 8
    compact: bool = True
    batch_buckets: Sequence[int] = DEFAULT_BUCKETS
    kv_block: int = 256
    cuda_graphs: bool = True
    prefill_tokens: int = 16384
    kv_cache_rows: int | None = None
    max_prompt_length: int = 1024
    max_new_tokens: int = 4096
    kv_cache_memory_fraction: float = 0.3
    rehearse_graphs: bool = False  # tests: run the capture's warm-up / restore sequence on CPU too

    def check(self) -> None:
        """Raise ValueError naming the ``rollout.*`` key of a bad value."""
        def bad(key, allowed, value):
            raise ValueError(f"rollout.{key} = {value!r} is invalid: allowed {allowed}")

        if self.sampler not in ENGINE_SAMPLERS:
            bad("sampler", "exact or device", self.sampler)
        if self.sync_every < 1:
            bad("sync_every", ">= 1", self.sync_every)
        b = list(self.batch_buckets)
        if not b or any(int(x) < 1 for x in b) or any(x >= y for x, y in zip(b, b[1:])):
            bad("batch_buckets", "a non-empty strictly increasing list of integers >= 1", b)
        if self.kv_block < 1:
            bad("kv_block", ">= 1", self.kv_block)
        if self.prefill_tokens < 1:
            bad("prefill_tokens", ">= 1", self.prefill_tokens)
        if self.kv_cache_rows is not None and self.kv_cache_rows < 1:
            bad("kv_cache_rows", "null or >= 1", self.kv_cache_rows)
        if self.max_prompt_length < 1:
            bad("max_prompt_length", ">= 1", self.max_prompt_length)
        if self.max_new_tokens < 1:
            bad("max_new_tokens", ">= 1", self.max_new_tokens)
        if not 0 < self.kv_cache_memory_fraction <= 1:
            bad("kv_cache_memory_fraction", "in (0, 1]", self.kv_cache_memory_fraction)


def engine_settings_from_config(cfg: Any, dp_size: int, on_gpu: bool) -> EngineSettings:
    """The settings of a recipe (``cfg.rollout``, ``cfg.grpo``): ``rollout.sampler`` auto resolved for the device
    (device on GPU, exact on CPU); ``rollout.kv_cache_rows`` null: this DP rank's responses per step."""
    r, g = cfg.rollout, cfg.grpo
    sampler = str(r.sampler)
    if sampler == "auto":
        sampler = "device" if on_gpu else "exact"
    rows = r.kv_cache_rows
    if rows is None:
        rows = max(1, int(g.num_prompts_per_step) * int(g.group_size) // max(1, int(dp_size)))
    settings = EngineSettings(
        sampler=sampler, sync_every=int(r.sync_every), compact=bool(r.compact),
        batch_buckets=tuple(int(x) for x in r.batch_buckets), kv_block=int(r.kv_block),
        cuda_graphs=bool(r.cuda_graphs), prefill_tokens=int(r.prefill_tokens), kv_cache_rows=int(rows),
        max_prompt_length=int(r.max_prompt_length), max_new_tokens=int(r.max_new_tokens),
        kv_cache_memory_fraction=float(r.kv_cache_memory_fraction))
    settings.check()
    return settings


def unwrap_gpt_model(model: Any):
    """The megatron-core ``GPTModel`` inside ``model``: a list of one chunk, megatron's
    ``DistributedDataParallel`` / ``Float16Module`` (``.module``), NeMo's ``MegatronGPTModel``
    (``get_model_module_list()``), or the model itself. Several chunks (virtual pipeline stages) are refused."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    m = model
    for _ in range(10):
        if isinstance(m, GPTModel):
            return m
        if isinstance(m, (list, tuple)):
            if len(m) != 1:
                raise ValueError(f"the decode engine needs one model chunk per rank, got {len(m)} "
                                 "(virtual pipeline stages are not supported)")
            m = m[0]
        elif hasattr(m, "get_model_module_list"):
            m = m.get_model_module_list()
        elif isinstance(getattr(m, "module", None), torch.nn.Module):
            m = m.module
        elif isinstance(getattr(m, "model", None), (torch.nn.Module, list)):
            m = m.model
        else:
            break
    raise TypeError(f"no megatron-core GPTModel found inside {type(model).__name__}")


@contextlib.contextmanager
def inference_context(model):
    """``model`` in eval mode with sequence parallelism off, restored afterwards (decode feeds one position per
    row, which cannot be split over the sequence). As NeMo does for its own generation
    (``MegatronGPTModel._reset_sequence_parallelism_args``, ``megatron_gpt_model.py:2166-2183`` in NeMo 2.2.1):
    the config flag and every module's ``sequence_parallel`` attribute; also the embedding's
    ``reduce_scatter_embeddings`` (``language_model_embedding.py:45-50``)."""
    was_training = model.training
    saved: list[tuple[Any, str, Any]] = []
    cfg = model.config
    saved.append((cfg, "sequence_parallel", cfg.sequence_parallel))
    for mod in model.modules():
        for name in ("sequence_parallel", "reduce_scatter_embeddings"):
            if isinstance(getattr(mod, name, None), bool):
                saved.append((mod, name, getattr(mod, name)))
    try:
        for obj, name, _ in saved:
            setattr(obj, name, False)
        model.eval()
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        model.train(was_training)


@dataclass(frozen=True)
class _Sig:
    """The sampling settings a captured step bakes in (part of its graph key)."""

    sampler: str
    temperature: float
    top_p: float
    eos: int
    pad: int
    max_new: int
    logprobs: bool


class _Slots:
    """Static per-row buffers of the decode loop: capacity ``R`` rows, ``S`` positions, ``V`` vocabulary."""

    def __init__(self, R: int, S: int, V: int, hidden: int, hidden_dtype: torch.dtype, device, last: bool):
        long = dict(dtype=torch.long, device=device)
        self.R = R
        self.tokens = torch.zeros(R, **long)        # input token of the next step
        self.pos = torch.zeros(R, **long)           # its position
        self.seeds = torch.zeros(R, **long)         # device sampler: per-sample seed
        self.generated = torch.zeros(R, **long)     # tokens generated so far (EOS included)
        self.done = torch.ones(R, dtype=torch.bool, device=device)
        self.hit_eos = torch.zeros(R, dtype=torch.bool, device=device)
        self.sample_id = torch.full((R,), R, **long)  # output row of each slot; R = the scratch row
        self.rows = torch.arange(R, **long)
        self.sampled = torch.zeros(R, **long)
        self.sampled_lp = torch.zeros(R, dtype=torch.float32, device=device)
        self.logits = torch.zeros(R, V, dtype=torch.float32, device=device) if last else None
        self.hidden_in = torch.zeros(R, hidden, dtype=hidden_dtype, device=device)
        self.hidden_out = torch.zeros(R, hidden, dtype=hidden_dtype, device=device)
        self.out_tokens = torch.zeros(R + 1, S + 1, **long)
        self.out_lp = torch.zeros(R + 1, S + 1, dtype=torch.float32, device=device)
        self.res_generated = torch.zeros(R + 1, **long)
        self.res_eos = torch.zeros(R + 1, dtype=torch.bool, device=device)
        self.arange = torch.arange(S, **long)

    def state(self, b: int) -> list[torch.Tensor]:
        """What a decode step advances (restored after a graph's warm-up)."""
        return [self.tokens[:b], self.pos[:b], self.generated[:b], self.done[:b], self.hit_eos[:b]]

    def retire(self, b: int) -> None:
        """Copy the counters of slots [0, b) to their samples' result rows."""
        ids = self.sample_id[:b]
        self.res_generated.index_copy_(0, ids, self.generated[:b].clone())
        self.res_eos.index_copy_(0, ids, self.hit_eos[:b].clone())

    def clear(self, a: int, b: int, pad: int) -> None:
        """Slots [a, b) hold no sample: finished, writing into the scratch row."""
        self.done[a:b] = True
        self.sample_id[a:b] = self.R
        self.pos[a:b] = 0
        self.tokens[a:b] = pad
        self.generated[a:b] = 0
        self.seeds[a:b] = 0
        self.hit_eos[a:b] = False


@dataclass
class EngineStats:
    """What the last :meth:`DecodeEngine.generate` did (tests and the benchmark read it)."""

    passes: int = 0
    prefill_forwards: int = 0
    prefill_prompts: int = 0          # distinct prompts prefilled
    decode_steps: int = 0
    host_syncs: int = 0
    compactions: int = 0
    windows: list = field(default_factory=list)  # (bucket, kv length, steps) per window of sync_every steps
    graphs: int = 0                   # captured graphs (CUDA) after the call


class DecodeEngine:
    """Generation for a megatron-core GPT policy (see the module docstring). SPMD: call on every rank of the
    model-parallel group with the same prompts; every rank returns the same CPU tensors.

    model: a ``GPTModel`` or a wrapper of one (:func:`unwrap_gpt_model`); vocab_size: the real vocabulary
    (logits past it are never sampled); settings: :class:`EngineSettings`."""

    def __init__(self, model: Any, vocab_size: int, settings: EngineSettings | None = None):
        from megatron.core import parallel_state as ps

        self.model = unwrap_gpt_model(model)
        self.vocab_size = int(vocab_size)
        self.settings = settings or EngineSettings()
        self.settings.check()
        m, cfg = self.model, self.model.config
        unsupported = [name for name, on in (
            ("multi_latent_attention", getattr(cfg, "multi_latent_attention", False)),
            ("num_moe_experts", getattr(cfg, "num_moe_experts", None)),
            ("context_parallel_size > 1", getattr(cfg, "context_parallel_size", 1) > 1),
            ("flash_decode", getattr(cfg, "flash_decode", False)),
            ("fp8", getattr(cfg, "fp8", None)),
        ) if on]
        if unsupported:
            raise ValueError(f"the decode engine does not support {', '.join(unsupported)}")
        self.layers = list(m.decoder.layers)
        if not self.layers:
            raise ValueError("the decode engine needs at least one transformer layer on every pipeline stage")
        attn = self.layers[0].self_attention
        self.heads = int(attn.num_attention_heads_per_partition)
        self.groups = int(attn.num_query_groups_per_partition)
        self.head_dim = int(attn.hidden_size_per_attention_head)
        self.scale = float(cfg.softmax_scale) if cfg.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.hidden = int(cfg.hidden_size)
        self.kv_dtype = attn.linear_qkv.weight.dtype
        self.hidden_dtype = torch.float32 if cfg.fp32_residual_connection else self.kv_dtype
        self.device = attn.linear_qkv.weight.device
        self.first, self.last = bool(m.pre_process), bool(m.post_process)
        self.final_norm = getattr(m.decoder, "final_layernorm", None) if self.last else None
        self.rope = m.position_embedding_type == "rope"
        self.max_positions = int(getattr(m, "max_position_embeddings", 0) or 0)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        if self.tp > 1:
            self._tp_group, self._tp_src = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank()
        if self.pp > 1:
            self._pp_group = ps.get_pipeline_model_parallel_group()
            self._pp_last = ps.get_pipeline_model_parallel_last_rank()
            self._next = None if self.last else ps.get_pipeline_model_parallel_next_rank()
            self._prev = None if self.first else ps.get_pipeline_model_parallel_prev_rank()
        self.cache: StaticKVCache | None = None
        self.slots: _Slots | None = None
        self._rope_cos: torch.Tensor | None = None  # [positions, rotary dim] float32
        self._rope_sin: torch.Tensor | None = None
        self.runner = GraphRunner(self.device, enabled=self.settings.cuda_graphs, rehearse=self.settings.rehearse_graphs)
        self._weights: tuple | None = None
        self.stats = EngineStats()

    # ------------------------------------------------------------------ the cache
    def cache_shape(self, rows: int, positions: int) -> KVCacheShape:
        return KVCacheShape(len(self.layers), int(rows), int(positions), self.groups, self.head_dim, self.kv_dtype)

    def planned_positions(self) -> int:
        """Positions of the cache as configured: max_prompt_length + max_new_tokens, within the context."""
        s = self.settings
        want = s.max_prompt_length + s.max_new_tokens
        return min(want, self.max_positions) if self.max_positions else want

    def _ensure_cache(self, rows: int, positions: int) -> None:
        """A cache of at least ``rows`` x ``positions``, allocated (or grown) after the size check."""
        if self.cache is not None and self.cache.shape.covers(rows, positions):
            return
        s = self.settings
        rows = max(rows, s.kv_cache_rows or 0, self.cache.shape.rows if self.cache else 0)
        positions = max(positions, self.planned_positions(), self.cache.shape.positions if self.cache else 0)
        shape = self.cache_shape(rows, positions)
        check_fits(shape, s.kv_cache_memory_fraction, device_memory_bytes(self.device),
                   sized_by=f"rollout.kv_cache_rows ({rows} rows) and rollout.max_prompt_length + "
                            f"rollout.max_new_tokens ({positions} positions)")
        self.free()
        self.cache = StaticKVCache(shape, self.device)
        self.slots = _Slots(rows, positions, self.vocab_size, self.hidden, self.hidden_dtype, self.device, self.last)
        if self.rope:
            # the model's table [positions, 1, 1, rotary dim] of float32 angles
            freqs = self.model.rotary_pos_emb(positions).reshape(positions, -1)
            self._rope_cos, self._rope_sin = torch.cos(freqs), torch.sin(freqs)

    def free(self) -> None:
        """Release the cache, the buffers and the captured graphs (the next call allocates again)."""
        self.runner.reset()
        self.cache = self.slots = self._rope_cos = self._rope_sin = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ the model's pieces
    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [b, s] -> hidden [s, b, H] (``LanguageModelEmbedding.forward`` in eval mode)."""
        emb = self.model.embedding
        if self.tp == 1:
            return emb(input_ids=tokens, position_ids=positions)
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        we = emb.word_embeddings
        local = tokens - we.vocab_start_index
        inside = (local >= 0) & (local < we.num_embeddings_per_partition)
        out = F.embedding(local.clamp(0, we.num_embeddings_per_partition - 1), we.weight)
        out = torch.where(inside.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        x = reduce_from_tensor_model_parallel_region(out)
        if emb.add_position_embedding:
            x = x + emb.position_embeddings(positions)
        x = x.transpose(0, 1).contiguous()
        if self.model.config.fp32_residual_connection:
            x = x.float()
        return emb.embedding_dropout(x)

    def _rope(self, pos: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype):
        """(cos, sin) of the model's RoPE table at positions ``pos``, viewed as ``shape`` + (rotary dim,), in
        ``dtype``: once per step for every layer (megatron's ``_apply_rotary_pos_emb_bshd`` takes the cosine and
        sine of the same float32 angles in every call, ``rope_utils.py:118-119``)."""
        if self._rope_cos is None:
            return None
        d = self._rope_cos.shape[-1]
        return (self._rope_cos[pos].to(dtype).view(*shape, d), self._rope_sin[pos].to(dtype).view(*shape, d))

    def _rotate(self, t: torch.Tensor, rope) -> torch.Tensor:
        """megatron's ``_apply_rotary_pos_emb_bshd`` (``rope_utils.py:88-122``, not multi-latent) with the cosine
        and sine given: the same arithmetic, so the same bits."""
        if rope is None:
            return t
        from megatron.core.models.common.embeddings.rope_utils import _rotate_half

        cos, sin = rope
        rot = cos.shape[-1]
        t, t_pass = t[..., :rot], t[..., rot:]
        t = (t * cos) + (_rotate_half(t, self.model.config.rotary_interleaved) * sin)
        return torch.cat((t, t_pass), dim=-1) if t_pass.shape[-1] else t

    def _layer(self, layer, h: torch.Tensor, rope, attend) -> torch.Tensor:
        """One TransformerLayer on hidden [s, b, H]; ``attend(q, k, v)`` -> context [s, b, heads * head_dim]."""
        fused = self.model.config.bias_dropout_fusion
        residual = h
        x = layer.input_layernorm(h)
        q, k, v = layer.self_attention.get_query_key_value_tensors(x)
        ctx = attend(self._rotate(q, rope), self._rotate(k, rope), v)
        h = layer.self_attn_bda(False, fused)(layer.self_attention.linear_proj(ctx), residual, layer.hidden_dropout)
        residual = h
        h = layer.mlp_bda(False, fused)(layer.mlp(layer.pre_mlp_layernorm(h)), residual, layer.hidden_dropout)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, H] -> float32 logits [s, b, V] over the real vocabulary, gathered over TP."""
        if self.final_norm is not None:
            h = self.final_norm(h)
        m = self.model
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits, _ = m.output_layer(h, weight=weight, runtime_gather_output=False)  # this rank's vocabulary shard
        if self.tp > 1:
            logits = gather_last_dim(logits, self._tp_group)
        return logits[..., : self.vocab_size].float()

    # ------------------------------------------------------------------ communication (no-ops at TP 1 / PP 1)
    def _tp_broadcast(self, b: int, sig: _Sig) -> None:
        if self.tp > 1:
            import torch.distributed as dist

            dist.broadcast(self.slots.sampled[:b], src=self._tp_src, group=self._tp_group)
            if sig.logprobs:
                dist.broadcast(self.slots.sampled_lp[:b], src=self._tp_src, group=self._tp_group)

    def _pp_broadcast(self, b: int, sig: _Sig) -> None:
        if self.pp > 1:
            import torch.distributed as dist

            dist.broadcast(self.slots.sampled[:b], src=self._pp_last, group=self._pp_group)
            if sig.logprobs:
                dist.broadcast(self.slots.sampled_lp[:b], src=self._pp_last, group=self._pp_group)

    def _send(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.send(t.contiguous(), dst=self._next)

    def _recv(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.recv(t, src=self._prev)

    # ------------------------------------------------------------------ sampling and bookkeeping
    def _sample_device(self, logits: torch.Tensor, b: int, sig: _Sig) -> None:
        """Device sampler on logits [b, V]: tokens (and their log-probs) into the static buffers."""
        s = self.slots
        u = counter_uniforms(s.seeds[:b], s.generated[:b])
        tok = draw_on_device(logits, u, sig.temperature, sig.top_p)
        s.sampled[:b].copy_(tok)
        if sig.logprobs:
            lp = torch.log_softmax(logits / sig.temperature, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
            s.sampled_lp[:b].copy_(lp)

    def _sample_exact(self, b: int, sig: _Sig, gens: list[torch.Generator], slot_ids: list[int]) -> None:
        """Exact sampler: TP rank 0 of the last stage draws on the host from ``logits[:b]`` with each live
        sample's generator (one float64 uniform per generated token), as ``megatron_sampler.sample``."""
        s = self.slots
        if self.last and self.tp_rank == 0:
            logits = s.logits[:b].cpu()
            active = (~s.done[:b]).cpu()
            probs = filtered_probs(logits, sig.temperature, sig.top_p)
            u = torch.zeros(b, dtype=torch.float64)
            for j in torch.nonzero(active).flatten().tolist():
                u[j] = torch.rand((), generator=gens[slot_ids[j]], dtype=torch.float64)
            tok = draw(probs, u)
            s.sampled[:b].copy_(tok.to(self.device))
            if sig.logprobs:
                lp = torch.log_softmax(logits / sig.temperature, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
                s.sampled_lp[:b].copy_(lp.to(self.device))
        if self.last:
            self._tp_broadcast(b, sig)

    def _advance(self, b: int, sig: _Sig) -> None:
        """Take the sampled tokens of slots [0, b): write them after each row's position, count them, flag EOS
        and the length limit, move each live row to its new token. Finished rows are fed ``pad``."""
        s = self.slots
        active = ~s.done[:b]
        nxt = torch.where(active, s.sampled[:b], torch.full_like(s.sampled[:b], sig.pad))
        pos, ids = s.pos[:b], s.sample_id[:b]
        s.out_tokens.index_put_((ids, pos + 1), nxt)
        if sig.logprobs:
            s.out_lp.index_put_((ids, pos), torch.where(active, s.sampled_lp[:b], torch.zeros_like(s.sampled_lp[:b])))
        gen = s.generated[:b] + active.long()
        s.generated[:b].copy_(gen)
        new_eos = active & (nxt == sig.eos)
        s.hit_eos[:b] |= new_eos
        s.done[:b] |= new_eos | (active & (gen >= sig.max_new))
        s.pos[:b] += active.long()
        s.tokens[:b].copy_(nxt)

    # ------------------------------------------------------------------ prefill
    def _prefill(self, prompts: list[list[int]], b: int, pad: int) -> torch.Tensor | None:
        """Fill the cache rows [0, n) with the prompts' keys / values; return the logits [b, V] of each row's
        last prompt position on the last stage (zeros for slots >= n), None elsewhere."""
        n = len(prompts)
        uniq: dict[tuple[int, ...], int] = {}
        of_slot = [uniq.setdefault(tuple(p), len(uniq)) for p in prompts]
        texts = list(uniq)
        order = sorted(range(len(texts)), key=lambda u: -len(texts[u]))
        chunks, cur = [], []
        for u in order:  # longest first: each chunk is as wide as its first prompt
            if cur and (len(cur) + 1) * len(texts[cur[0]]) > self.settings.prefill_tokens:
                chunks.append(cur)
                cur = []
            cur.append(u)
        chunks.append(cur)
        logits_all = torch.zeros(b, self.vocab_size, dtype=torch.float32, device=self.device) if self.last else None
        for chunk in chunks:
            where = {u: i for i, u in enumerate(chunk)}
            width = len(texts[chunk[0]])
            dest = [j for j in range(n) if of_slot[j] in where]
            dest_t = torch.tensor(dest, dtype=torch.long, device=self.device)
            src_t = torch.tensor([where[of_slot[j]] for j in dest], dtype=torch.long, device=self.device)
            U = len(chunk)
            if self.first:
                tok = torch.full((U, width), pad, dtype=torch.long)
                for i, u in enumerate(chunk):
                    tok[i, : len(texts[u])] = torch.tensor(texts[u], dtype=torch.long)
                tok = tok.to(self.device)
                h = self._embed(tok, torch.arange(width, device=self.device).unsqueeze(0).expand(U, width))
            else:
                h = torch.empty(width, U, self.hidden, dtype=self.hidden_dtype, device=self.device)
                self._recv(h)
            rope = self._rope(torch.arange(width, device=self.device), (width, 1, 1), self.kv_dtype)
            for li, layer in enumerate(self.layers):
                h = self._layer(layer, h, rope, self._prefill_attention(li, dest_t, src_t))
            self.stats.prefill_forwards += 1
            if not self.last:
                self._send(h)
                continue
            last_pos = torch.tensor([len(texts[u]) - 1 for u in chunk], device=self.device)
            h_last = h[last_pos, torch.arange(U, device=self.device)].unsqueeze(0)  # [1, U, H]
            logits_all[dest_t] = self._logits(h_last)[0][src_t]
        self.stats.prefill_prompts += len(texts)
        return logits_all

    def _prefill_attention(self, li: int, dest: torch.Tensor, src: torch.Tensor):
        def attend(q, k, v):  # q [s, U, heads, d], k / v [s, U, groups, d]
            self.cache.write_prefix(li, dest, k.transpose(0, 1)[src], v.transpose(0, 1)[src])
            s, U = q.shape[0], q.shape[1]
            out = F.scaled_dot_product_attention(
                q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True,
                scale=self.scale, enable_gqa=self.heads != self.groups)  # [U, heads, s, d]
            return out.permute(2, 0, 1, 3).reshape(s, U, self.heads * self.head_dim)

        return attend

    # ------------------------------------------------------------------ decode
    def _decode_compute(self, b: int, kv: int) -> torch.Tensor | None:
        """This stage's part of one decode step for slots [0, b), attention over positions [0, kv): logits
        [b, V] on the last stage; otherwise the hidden state goes to ``hidden_out``."""
        s = self.slots
        pos = s.pos[:b]
        if self.first:
            h = self._embed(s.tokens[:b].unsqueeze(1), pos.unsqueeze(1))  # [1, b, H]
        else:
            h = s.hidden_in[:b].unsqueeze(0)
        rope = self._rope(pos, (1, b, 1), self.kv_dtype)
        mask = (s.arange[:kv].unsqueeze(0) <= pos.unsqueeze(1)).view(b, 1, 1, kv)
        rows = s.rows[:b]
        for li, layer in enumerate(self.layers):
            h = self._layer(layer, h, rope, self._decode_attention(li, rows, pos, mask, b, kv))
        if not self.last:
            s.hidden_out[:b].copy_(h[0])
            return None
        return self._logits(h)[0]

    def _decode_attention(self, li: int, rows, pos, mask, b: int, kv: int):
        g, per = self.groups, self.heads // self.groups

        def attend(q, k, v):  # q [1, b, heads, d], k / v [1, b, groups, d]
            self.cache.write(li, rows, pos, k[0], v[0])
            keys = self.cache.keys(li)[:b, :kv].transpose(1, 2)  # [b, groups, kv, d]
            vals = self.cache.values(li)[:b, :kv].transpose(1, 2)
            # megatron's GQA: query head i reads key-value group i // (heads / groups), so the heads of a group
            # become that group's query rows (one kernel call, no key / value expansion)
            qq = q[0].reshape(b, g, per, self.head_dim)
            out = F.scaled_dot_product_attention(qq, keys, vals, attn_mask=mask, scale=self.scale)
            return out.reshape(1, b, self.heads * self.head_dim)

        return attend

    def _decode_step(self, b: int, kv: int, sig: _Sig, gens, slot_ids) -> None:
        s = self.slots
        if sig.sampler == "device" and self.pp == 1:
            def step():
                self._sample_device(self._decode_compute(b, kv), b, sig)
                self._tp_broadcast(b, sig)
                self._advance(b, sig)

            self.runner.run(("step", b, kv, sig), step, s.state(b))
            return
        # a pipeline stage and / or host sampling: this stage's compute is the graph, the rest runs eagerly
        if not self.first:
            self._recv(s.hidden_in[:b])
        if self.last and sig.sampler == "device":
            def compute():
                self._sample_device(self._decode_compute(b, kv), b, sig)
                self._tp_broadcast(b, sig)
        elif self.last:
            def compute():
                s.logits[:b].copy_(self._decode_compute(b, kv))
        else:
            def compute():
                self._decode_compute(b, kv)
        self.runner.run(("stage", b, kv, sig if self.last and sig.sampler == "device" else sig.sampler), compute)
        if not self.last:
            self._send(s.hidden_out[:b])
        if sig.sampler == "exact":
            self._sample_exact(b, sig, gens, slot_ids)
        self._pp_broadcast(b, sig)
        self._advance(b, sig)

    def _compact(self, alive: list[int], b: int, nb: int, upto: int, pad: int) -> None:
        """Move the live slots ``alive`` (increasing) to [0, len(alive)) - state and KV rows - and clear the
        rest of the new bucket ``nb``."""
        s, n = self.slots, len(alive)
        s.retire(b)
        idx = torch.tensor(alive, dtype=torch.long, device=self.device)
        for t in (s.tokens, s.pos, s.seeds, s.generated, s.done, s.hit_eos, s.sample_id):
            t[:n] = t[idx]
        s.clear(n, nb, pad)
        self.cache.move_rows(alive, upto)
        self.stats.compactions += 1

    # ------------------------------------------------------------------ generation
    def _weights_moved(self) -> bool:
        ptrs = tuple(p.data_ptr() for p in self.model.parameters())
        moved = self._weights is not None and ptrs != self._weights
        self._weights = ptrs
        return moved

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, stream: int = 0,
                 pad_id: int | None = None, return_logprobs: bool = False) -> GenerationOutput:
        """Sample one response per prompt (same contract as ``megatron_sampler.sample``).

        prompts: B non-empty token lists; stream: the random stream (data-parallel rank); pad_id: written after
        each row's end (default the EOS id); return_logprobs: also return ``logprobs`` [B, T-1]: log p of each
        response token under the engine's forward at the sampling temperature (position t scores token t+1,
        0 elsewhere), the rollout side of the rollout / training log-prob mismatch.
        Returns CPU tensors, identical on every rank of the model-parallel group."""
        check_sampling(sampling)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        st = self.settings
        st.check()
        pad = int(sampling.eos_id if pad_id is None else pad_id)
        L = int(sampling.max_new_tokens)
        need_pos = max(len(p) for p in prompts) + L
        if self.max_positions and need_pos > self.max_positions:
            raise ValueError(f"prompt + max_new_tokens = {need_pos} exceeds max_position_embeddings "
                             f"{self.max_positions}")
        sig = _Sig(st.sampler, float(sampling.temperature), float(sampling.top_p), int(sampling.eos_id), pad, L,
                   bool(return_logprobs))
        B = len(prompts)
        rows = B if st.kv_cache_rows is None else min(B, st.kv_cache_rows)
        self.stats = EngineStats()
        with inference_context(self.model):
            self._ensure_cache(rows, need_pos)
            if self._weights_moved():
                self.runner.reset()
            R = self.slots.R
            outs = [self._run_pass(prompts[a : a + R], a, sampling, sig, stream) for a in range(0, B, R)]
        self.stats.graphs = self.runner.num_graphs
        if len(outs) == 1:
            return outs[0]
        width = max(o.tokens.shape[1] for o in outs)
        tokens = torch.cat([F.pad(o.tokens, (0, width - o.tokens.shape[1]), value=pad) for o in outs])
        lp = (torch.cat([F.pad(o.logprobs, (0, width - 1 - o.logprobs.shape[1])) for o in outs])
              if return_logprobs else None)
        return GenerationOutput(tokens=tokens, logprobs=lp, **{
            k: torch.cat([getattr(o, k) for o in outs])
            for k in ("prompt_lengths", "response_lengths", "lengths", "truncated")})

    def _run_pass(self, prompts: list[list[int]], first: int, sampling: SamplingParams, sig: _Sig,
                  stream: int) -> GenerationOutput:
        """One pass over at most ``R`` rows (samples ``first .. first + n - 1`` of the call)."""
        st, s, n = self.settings, self.slots, len(prompts)
        L, pad, dev = sig.max_new, sig.pad, self.device
        self.stats.passes += 1
        P = [len(p) for p in prompts]
        b = bucket_for(n, st.batch_buckets, s.R)
        seeds = [sample_seed(sampling.seed, stream, first + i) for i in range(n)]
        gens = ([torch.Generator().manual_seed(x) for x in seeds]
                if sig.sampler == "exact" and self.last and self.tp_rank == 0 else [])
        s.clear(0, s.R, pad)
        s.done[:n] = False
        s.sample_id[:n] = torch.arange(n, device=dev)
        s.seeds[:n] = torch.tensor(seeds, dtype=torch.long, device=dev)
        s.pos[:n] = torch.tensor(P, dtype=torch.long, device=dev) - 1
        s.res_generated.zero_()
        s.res_eos.zero_()
        s.out_lp[: n + 1].zero_()
        head = torch.full((n, s.out_tokens.shape[1]), pad, dtype=torch.long)
        for i, p in enumerate(prompts):
            head[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        s.out_tokens[:n].copy_(head.to(dev))
        slot_ids = list(range(n)) + [-1] * (b - n)

        # prefill, first token
        logits = self._prefill(prompts, b, pad)
        if sig.sampler == "device":
            if self.last:
                self._sample_device(logits, b, sig)
                self._tp_broadcast(b, sig)
        else:
            if self.last:
                s.logits[:b].copy_(logits)
            self._sample_exact(b, sig, gens, slot_ids)
        self._pp_broadcast(b, sig)
        self._advance(b, sig)

        t = 0  # decode steps done; every live row has generated t + 1 tokens
        finished = L == 1 or bool(s.done[:b].all())
        while not finished and t < L - 1:
            window = min(st.sync_every, L - 1 - t)
            reach = max(P[slot_ids[j]] for j in range(b) if slot_ids[j] >= 0) + t + window
            kv = kv_length(reach, st.kv_block, self.cache.shape.positions)
            steps = 0
            for _ in range(window):
                self._decode_step(b, kv, sig, gens, slot_ids)
                t += 1
                steps += 1
                if sig.sampler == "exact" and bool(s.done[:b].all()):  # the host knows every step here
                    finished = True
                    break
            self.stats.decode_steps += steps
            self.stats.windows.append((b, kv, steps))
            if finished:
                break
            done = s.done[:b].cpu()
            self.stats.host_syncs += 1
            alive = torch.nonzero(~done).flatten().tolist()
            if not alive:
                break
            if st.compact:
                nb = bucket_for(len(alive), st.batch_buckets, s.R)
                if nb < b:
                    upto = max(P[slot_ids[j]] for j in alive) + t + 1
                    self._compact(alive, b, nb, min(upto, self.cache.shape.positions), pad)
                    slot_ids = [slot_ids[j] for j in alive] + [-1] * (nb - len(alive))
                    b = nb

        s.retire(b)
        # copies: on a CPU device .cpu() would return views of the static buffers the next call overwrites
        gen = s.res_generated[:n].to("cpu", copy=True)
        hit = s.res_eos[:n].to("cpu", copy=True)
        prompt_lens = torch.tensor(P, dtype=torch.long)
        T = int((prompt_lens + gen).max())
        return GenerationOutput(
            tokens=s.out_tokens[:n, :T].to("cpu", copy=True),
            prompt_lengths=prompt_lens,
            response_lengths=gen,
            lengths=gen - hit.long(),
            truncated=~hit & (gen >= L),
            logprobs=s.out_lp[:n, : T - 1].to("cpu", copy=True) if sig.logprobs else None,
        )
