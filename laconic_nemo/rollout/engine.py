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

That is the prefill's path, and the decode step's where the fused step cannot serve the model. The decode step
itself runs FUSED (:mod:`laconic_nemo.rollout.fused`, ``EngineSettings.fused``): the same modules' weights and
megatron's TP mappings, with linear_qkv's bias inside its GEMM, RoPE applied once to the layer's q | k | v heads
with cos / sin gathered once per step, keys and values written in one ``index_put_``, the attention mask built once
per step and the residual adds folded into the output GEMMs: 13 kernels per layer on a GPU by count (with torch's
one-kernel ``rms_norm``) where the module calls launch about 31 (measured, 64 rows). Models it cannot serve
(``fused.unsupported``: fp32 residuals, token types, non-megatron layer modules) decode through the modules;
``engine.fused`` says which.

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
   ``rollout.batch_buckets`` (8, then multiples of 16: 48 rows run as 48) they are moved down (state and KV rows,
   in place) and the steps run at that bucket. Attention reads ``[0, kv)`` of the cache, kv the longest live row's
   reach in the next window rounded up to ``rollout.kv_block``, never less than the pass's previous kv. The
   schedule is :class:`~laconic_nemo.rollout.schedule.WindowPlan`: a pass captures at most
   ``buckets visited + KV lengths - 1`` graphs (``laconic-nemo plan`` prints the bound; ``stats.captures`` and
   ``stats.capture_s`` what a call captured).

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
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from laconic_nemo.config import Config
from laconic_nemo.grpo.interfaces import GenerationOutput, SamplingParams
from laconic_nemo.rollout.graphs import GraphRunner
from laconic_nemo.rollout.kv_cache import KVCacheShape, StaticKVCache, check_fits, device_memory_bytes
from laconic_nemo.rollout.megatron_sampler import (
    check_sampling,
    sample_seed,
)
from laconic_nemo.rollout.parts import PartAttribute
from laconic_nemo.rollout.schedule import WindowPlan, fine_buckets
from laconic_nemo.rollout.slots import Sig, Slots
from laconic_nemo.rollout.stage import PrefillPlan, Stage

ENGINE_SAMPLERS = ("exact", "device")
ENGINE_MEMORY_CHOICES = ("resident", "release")  # rollout.engine_memory
DEFAULT_BUCKETS = fine_buckets()  # 8, 16, 32, 48, ..., 512


def check_engine_memory(engine_memory: str) -> str:
    """``rollout.engine_memory`` for an actor built without the recipe loader: ``resident`` (the engine's cache and
    graphs kept between rollouts) or ``release`` (freed after each); ValueError naming the key otherwise."""
    if engine_memory not in ENGINE_MEMORY_CHOICES:
        raise ValueError(f"rollout.engine_memory = {engine_memory!r} is invalid: allowed resident or release")
    return engine_memory


def resolve_sampler(choice: str, on_gpu: bool) -> str:
    """``rollout.sampler`` (``auto``, ``exact``, ``device``) for the device: ``auto`` is ``device`` on a GPU,
    ``exact`` on CPU; the one place ``auto`` is resolved (the actor and the engine settings both call it)."""
    if choice not in ("auto", *ENGINE_SAMPLERS):
        raise ValueError(f"rollout.sampler = {choice!r} is invalid: allowed auto, exact or device")
    if choice == "auto":
        return "device" if on_gpu else "exact"
    return choice


@dataclass
class EngineSettings:
    """The engine's knobs, the ``rollout.*`` keys of the same names (``laconic_nemo/config/schema.py`` documents them).

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
    fused: bool = True  # the fused decode step (rollout/fused.py); False: the model's modules (tests, benchmark)

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


def engine_settings_from_config(cfg: Config, dp_size: int, on_gpu: bool) -> EngineSettings:
    """The settings of a recipe (``cfg.rollout``, ``cfg.grpo``): ``rollout.sampler`` resolved for the device
    (:func:`resolve_sampler`); ``rollout.kv_cache_rows`` null: this DP rank's
    responses per step (:meth:`~laconic_nemo.config.GRPOConfig.rollout_per_rank`, at least 1)."""
    r = cfg.rollout
    rows = r.kv_cache_rows if r.kv_cache_rows is not None else max(1, cfg.grpo.rollout_per_rank(max(1, dp_size)))
    settings = EngineSettings(
        sampler=resolve_sampler(r.sampler, on_gpu), sync_every=r.sync_every, compact=r.compact,
        batch_buckets=tuple(r.batch_buckets), kv_block=r.kv_block, cuda_graphs=r.cuda_graphs,
        prefill_tokens=r.prefill_tokens, kv_cache_rows=rows, max_prompt_length=r.max_prompt_length,
        max_new_tokens=r.max_new_tokens, kv_cache_memory_fraction=r.kv_cache_memory_fraction)
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
    captures: int = 0                 # graphs captured (CUDA) or rehearsed (CPU) during the call
    capture_s: float = 0.0            # their warm-ups and captures, seconds
    step_ops: list = field(default_factory=list)  # opcount.OpCount per decode step, when count_ops is set


class DecodeEngine:
    """Generation for a megatron-core GPT policy (see the module docstring). SPMD: call on every rank of the
    model-parallel group with the same prompts; every rank returns the same CPU tensors.

    model: a ``GPTModel`` or a wrapper of one (:func:`unwrap_gpt_model`); vocab_size: the real vocabulary
    (logits past it are never sampled); settings: :class:`EngineSettings`.

    Its parts: ``stage`` (:class:`~laconic_nemo.rollout.stage.Stage`, this rank's part of the model, built here),
    ``cache`` (:class:`~laconic_nemo.rollout.kv_cache.StaticKVCache`) and ``slots``
    (:class:`~laconic_nemo.rollout.slots.Slots`, the per-row buffers), allocated by the first call and released by
    :meth:`free`; ``runner`` (:class:`~laconic_nemo.rollout.graphs.GraphRunner`, the captured steps); ``stats``
    (:class:`EngineStats` of the last call)."""

    # this rank's part of the model (read-only, the stage's)
    model = PartAttribute("stage", read_only=True)
    vocab_size = PartAttribute("stage", read_only=True)
    fused = PartAttribute("stage", read_only=True)
    unfused_reason = PartAttribute("stage", read_only=True)
    layers = PartAttribute("stage", read_only=True)
    heads = PartAttribute("stage", read_only=True)
    groups = PartAttribute("stage", read_only=True)
    head_dim = PartAttribute("stage", read_only=True)
    hidden = PartAttribute("stage", read_only=True)
    hidden_dtype = PartAttribute("stage", read_only=True)
    kv_dtype = PartAttribute("stage", read_only=True)
    device = PartAttribute("stage", read_only=True)
    first = PartAttribute("stage", read_only=True)
    last = PartAttribute("stage", read_only=True)
    tp = PartAttribute("stage", read_only=True)
    tp_rank = PartAttribute("stage", read_only=True)
    pp = PartAttribute("stage", read_only=True)
    max_positions = PartAttribute("stage", read_only=True)

    def __init__(self, model: Any, vocab_size: int, settings: EngineSettings | None = None):
        gpt = unwrap_gpt_model(model)
        self.settings = settings or EngineSettings()
        self.settings.check()
        self.stage = Stage(gpt, vocab_size, fused=self.settings.fused)
        self.cache: StaticKVCache | None = None
        self.slots: Slots | None = None
        self.runner = GraphRunner(self.stage.device, enabled=self.settings.cuda_graphs,
                                  rehearse=self.settings.rehearse_graphs)
        self._weights: tuple | None = None
        self.stats = EngineStats()
        self.count_ops = False  # count each decode step's operators (eager runs: CPU, or cuda_graphs off)

    # ------------------------------------------------------------------ the cache
    def cache_shape(self, rows: int, positions: int) -> KVCacheShape:
        st = self.stage
        return KVCacheShape(len(st.layers), int(rows), int(positions), st.groups, st.head_dim, st.kv_dtype)

    def planned_positions(self) -> int:
        """Positions of the cache as configured: max_prompt_length + max_new_tokens, within the context."""
        s, most = self.settings, self.stage.max_positions
        want = s.max_prompt_length + s.max_new_tokens
        return min(want, most) if most else want

    def _ensure_cache(self, rows: int, positions: int) -> None:
        """A cache of at least ``rows`` x ``positions``, allocated (or grown) after the size check."""
        if self.cache is not None and self.cache.shape.covers(rows, positions):
            return
        s, st = self.settings, self.stage
        rows = max(rows, s.kv_cache_rows or 0, self.cache.shape.rows if self.cache else 0)
        positions = max(positions, self.planned_positions(), self.cache.shape.positions if self.cache else 0)
        shape = self.cache_shape(rows, positions)
        check_fits(shape, s.kv_cache_memory_fraction, device_memory_bytes(st.device),
                   sized_by=f"rollout.kv_cache_rows ({rows} rows) and rollout.max_prompt_length + "
                            f"rollout.max_new_tokens ({positions} positions)")
        self.free()
        self.cache = StaticKVCache(shape, st.device)
        self.slots = Slots(rows, positions, st.vocab_size, st.hidden, st.hidden_dtype, st.device, st.last)
        st.set_rope(positions)

    def free(self) -> None:
        """Release the cache, the buffers and the captured graphs (the next call allocates again)."""
        self.runner.reset()
        self.cache = self.slots = None
        self.stage.free()
        if self.stage.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ one step
    def _decode_step(self, b: int, kv: int, sig: Sig, gens, slot_ids) -> None:
        """One decode step of slots [0, b) (its operators counted into ``stats.step_ops`` when ``count_ops``)."""
        if not self.count_ops:
            self._step(b, kv, sig, gens, slot_ids)
            return
        from laconic_nemo.rollout.opcount import count_ops

        with count_ops() as counter:
            self._step(b, kv, sig, gens, slot_ids)
        self.stats.step_ops.append(counter.count)

    def _step(self, b: int, kv: int, sig: Sig, gens, slot_ids) -> None:
        st, s, cache = self.stage, self.slots, self.cache
        if sig.sampler == "device" and st.pp == 1:
            def step():
                s.sample_device(st.decode(b, kv, s, cache), b, sig)
                st.tp_broadcast(b, s.drawn(sig))
                s.advance(b, sig)

            self.runner.run(("step", b, kv, sig), step, s.state(b))
            return
        # a pipeline stage and / or host sampling: this stage's compute is the graph, the rest runs eagerly
        if not st.first:
            st.recv(s.hidden_in[:b])
        if st.last and sig.sampler == "device":
            def compute():
                s.sample_device(st.decode(b, kv, s, cache), b, sig)
                st.tp_broadcast(b, s.drawn(sig))
        elif st.last:
            def compute():
                s.logits[:b].copy_(st.decode(b, kv, s, cache))
        else:
            def compute():
                st.decode(b, kv, s, cache)
        self.runner.run(("stage", b, kv, sig if st.last and sig.sampler == "device" else sig.sampler), compute)
        if not st.last:
            st.send(s.hidden_out[:b])
        if sig.sampler == "exact":
            self._sample_exact(b, sig, gens, slot_ids)
        st.pp_broadcast(b, s.drawn(sig))
        s.advance(b, sig)

    def _sample_exact(self, b: int, sig: Sig, gens, slot_ids) -> None:
        """The exact sampler: TP rank 0 of the last stage draws (:meth:`Slots.sample_exact`), the last stage's
        other TP ranks receive its tokens."""
        st = self.stage
        if st.last and st.tp_rank == 0:
            self.slots.sample_exact(b, sig, gens, slot_ids)
        if st.last:
            st.tp_broadcast(b, self.slots.drawn(sig))

    # ------------------------------------------------------------------ generation
    def _weights_moved(self) -> bool:
        ptrs = tuple(p.data_ptr() for p in self.stage.model.parameters())
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
        stops, V, most = sampling.stops(), self.stage.vocab_size, self.stage.max_positions
        if not all(0 <= i < V for i in stops):
            raise ValueError(f"sampling.eos_id and stop_ids must be in [0, {V}), got {list(stops)}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        st = self.settings
        st.check()
        pad = int(sampling.eos_id if pad_id is None else pad_id)
        L = int(sampling.max_new_tokens)
        need_pos = max(len(p) for p in prompts) + L
        if most and need_pos > most:
            raise ValueError(f"prompt + max_new_tokens = {need_pos} exceeds max_position_embeddings {most}")
        sig = Sig(st.sampler, float(sampling.temperature), float(sampling.top_p), int(sampling.eos_id), pad, L,
                   bool(return_logprobs), stops)
        B = len(prompts)
        rows = B if st.kv_cache_rows is None else min(B, st.kv_cache_rows)
        self.stats = EngineStats()
        captures, capture_s = self.runner.captures, self.runner.capture_seconds
        with inference_context(self.stage.model):
            self._ensure_cache(rows, need_pos)
            if self._weights_moved():
                self.runner.reset()
            R = self.slots.R
            outs = [self._run_pass(prompts[a : a + R], a, sampling, sig, stream) for a in range(0, B, R)]
        self.stats.graphs = self.runner.num_graphs
        self.stats.captures = self.runner.captures - captures
        self.stats.capture_s = self.runner.capture_seconds - capture_s
        if len(outs) == 1:
            return outs[0]
        width = max(o.tokens.shape[1] for o in outs)
        tokens = torch.cat([F.pad(o.tokens, (0, width - o.tokens.shape[1]), value=pad) for o in outs])
        lp = (torch.cat([F.pad(o.logprobs, (0, width - 1 - o.logprobs.shape[1])) for o in outs])
              if return_logprobs else None)
        return GenerationOutput(tokens=tokens, logprobs=lp, **{
            k: torch.cat([getattr(o, k) for o in outs])
            for k in ("prompt_lengths", "response_lengths", "lengths", "truncated")})

    def _run_pass(self, prompts: list[list[int]], first: int, sampling: SamplingParams, sig: Sig,
                  stream: int) -> GenerationOutput:
        """One pass over at most ``R`` rows (samples ``first .. first + n - 1`` of the call)."""
        st, s, stage, n = self.settings, self.slots, self.stage, len(prompts)
        L, pad = sig.max_new, sig.pad
        self.stats.passes += 1
        P = [len(p) for p in prompts]
        plan = WindowPlan(P, s.R, self.cache.shape.positions, L, st.batch_buckets, st.kv_block, st.sync_every,
                          st.compact)
        b = plan.b
        seeds = [sample_seed(sampling.seed, stream, first + i) for i in range(n)]
        gens = ([torch.Generator().manual_seed(x) for x in seeds]
                if sig.sampler == "exact" and stage.last and stage.tp_rank == 0 else [])
        s.start(prompts, seeds, pad)

        # prefill, first token
        prefill = PrefillPlan.of(prompts, st.prefill_tokens)
        logits = stage.prefill(prefill, b, pad, self.cache)
        self.stats.prefill_forwards += len(prefill.chunks)
        self.stats.prefill_prompts += len(prefill.texts)
        if sig.sampler == "device":
            if stage.last:
                s.sample_device(logits, b, sig)
                stage.tp_broadcast(b, s.drawn(sig))
        else:
            if stage.last:
                s.logits[:b].copy_(logits)
            self._sample_exact(b, sig, gens, plan.slot_ids)
        stage.pp_broadcast(b, s.drawn(sig))
        s.advance(b, sig)

        finished = L == 1 or bool(s.done[:b].all())
        while not finished:
            window = plan.window()
            if window is None:
                break
            b, kv, todo = window
            steps = 0
            for _ in range(todo):
                self._decode_step(b, kv, sig, gens, plan.slot_ids)
                steps += 1
                if sig.sampler == "exact" and bool(s.done[:b].all()):  # the host knows every step here
                    finished = True
                    break
            plan.ran(steps)
            self.stats.decode_steps += steps
            self.stats.windows.append((b, kv, steps))
            if finished:
                break
            done = s.done[:b].cpu()
            self.stats.host_syncs += 1
            alive = torch.nonzero(~done).flatten().tolist()
            if not alive:
                break
            move = plan.sync(alive)
            if move is not None:
                s.compact(move.alive, move.old, move.new, move.upto, pad, self.cache)
                self.stats.compactions += 1
                b = move.new

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
