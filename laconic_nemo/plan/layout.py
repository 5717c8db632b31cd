"""The layout of a launch: whether a recipe fits ``nodes`` x ``gpus_per_node`` GPUs (:func:`plan_layout`).

World size = nodes x GPUs per node divisible by TP x PP, groups of G responses whole on each data-parallel rank,
the global rollout batch divisible into optimiser minibatches and those into DP x micro-batches, attention heads
divisible by TP, layers by PP, L_max inside the context window, which data goes with which model, the data and
checkpoint paths present (or created by the conversion step), the decode engine's KV cache within the GPU's
memory and the training memory of either actor (refused when it cannot fit, with the engine's cache beside it). Nothing is allocated: no torch.distributed, no
model, no GPU. A bad layout or key raises :class:`~laconic_nemo.config.LayoutError` naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from laconic_nemo.bridge.hf_folder import HFConfigError, hf_config
from laconic_nemo.config import Config, LayoutError, check_layout
from laconic_nemo.plan.images import actor_of


@dataclass
class Plan:
    """The resolved layout of one launch (all batch sizes in responses unless named prompts)."""

    recipe: str
    nodes: int
    gpus_per_node: int
    world_size: int
    tp: int
    pp: int
    dp: int
    actor: str                   # "nemo_aligner" (model.source nemo) or "megatron_core" (hf / synthetic)
    num_prompts_per_step: int    # global prompts per step
    group_size: int              # G
    rollout_batch: int           # global responses per step = prompts x G
    minibatch_size: int          # global responses per optimiser step
    micro_batch_size: int        # responses per forward/backward on one DP rank
    steps_per_rollout: int       # optimiser steps per GRPO step
    prompts_per_rank: int        # prompts per DP rank (whole groups)
    samples_per_rank: int        # responses per DP rank per step
    micro_batches_per_step: int  # micro-batches per optimiser step on one DP rank (gradient accumulation)
    max_new_tokens: int          # L_max
    budget: float                # B
    max_generated_tokens_per_step: int  # rollout_batch x L_max (upper bound)
    budget_tokens_per_step: int  # rollout_batch x B (generated tokens when the mean sits at the budget)
    num_steps: int
    conversion_needed: bool      # model.path (.nemo) missing and converted from the HF checkpoint first
    warnings: list[str] = field(default_factory=list)
    tokenizer: str | None = None          # HF folder whose tokenizer was loaded (None: not readable here)
    end_strings: list[str] | None = None  # NeMo sampler end strings (single tokens of that tokenizer)
    rollout_engine: str = "megatron"      # rollout.engine
    kv_cache: str | None = None           # the decode engine's KV cache per GPU (shape, dtype, GiB); None: not ours
    kv_cache_bytes: int | None = None
    decode_graphs: str | None = None      # the decode engine's bound on CUDA-graph captures (rollout/schedule.py)
    decode_graphs_per_pass: int | None = None
    decode_graphs_in_all: int | None = None
    training_memory: str | None = None    # activations per micro-batch, the recompute that fits (both actors)
    packed_attention: str | None = None   # megatron-core actor, packed micro-batches: the GPU kernel of the target
    image: str | None = None              # the image the launch runs in (a name of plan.images.IMAGES); None: this machine
    attention: str | None = None          # the core attention that image runs (either actor)


ROLLOUT_ENGINES = {
    "megatron": "megatron: the decode engine (laconic_nemo/rollout/engine.py; static KV cache, CUDA-graphed steps)",
    "vllm": "vllm (colocated, weights refitted every step)",
    "nemo": "nemo: NeMo-Aligner's native generation",
}


def _fail(key: str, value, allowed: str) -> None:
    raise LayoutError(f"{key} = {value!r} does not fit the layout: {allowed}")


def _invalid(key: str, value, allowed: str) -> None:
    raise LayoutError(f"{key} = {value!r} is invalid: allowed {allowed}")


def plan_layout(cfg: Config, nodes: int, gpus_per_node: int, recipe: str = "", hf_model: str | None = None,
                check_paths: bool = True, cluster: bool = True, gpu_memory_gib: float = 80.0,
                image: str = "auto") -> Plan:
    """Check ``cfg`` against ``nodes`` x ``gpus_per_node`` GPUs and return the resolved :class:`Plan`.

    hf_model: the HF checkpoint the launch converts to ``model.path`` when that .nemo is missing.
    check_paths: verify data files and checkpoints exist, and every data row (off for planning away from
    the cluster).
    cluster: a GPU cluster launch (``plan``); False for ``train`` on this machine (gloo allowed).
    gpu_memory_gib: memory of one GPU; on a cluster the decode engine's KV cache must fit
    ``rollout.kv_cache_memory_fraction`` of it.
    image: the container the launch runs in (``plan --image``, :func:`laconic_nemo.plan.images.resolve_image`):
    auto = the recipe's actor's image on a cluster and this machine otherwise; none = this machine; or a name of
    ``plan.images.IMAGES``. The attention kernel is that image's.
    Raises :class:`LayoutError` (a ConfigError) naming the offending key.
    """
    if int(nodes) < 1:
        _fail("--nodes", nodes, "an integer >= 1")
    if int(gpus_per_node) < 1:
        _fail("--gpus-per-node", gpus_per_node, "an integer >= 1")
    world = int(nodes) * int(gpus_per_node)
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    if tp > gpus_per_node or gpus_per_node % tp:
        _fail("parallel.tensor_model_parallel_size", tp,
              f"a divisor of --gpus-per-node = {gpus_per_node} (tensor parallelism stays inside a node)")
    if world % (tp * pp):
        _fail("parallel.pipeline_model_parallel_size", pp,
              f"world size {world} must be divisible by TP x PP = {tp} x {pp} = {tp * pp}")
    dp = world // (tp * pp)

    check_layout(cfg, dp)
    g = cfg.grpo
    prompts, G, rollout = g.num_prompts_per_step, g.group_size, g.rollout_batch
    mini, mbs = g.minibatch_size, g.micro_batch_size

    m = cfg.model
    try:
        hf = hf_config(hf_model if m.source == "nemo" else (m.shape_from if m.source == "synthetic" else m.path))
    except HFConfigError as exc:
        raise LayoutError(str(exc)) from None
    if m.shape_from and check_paths and hf is None:
        _fail("model.shape_from", m.shape_from, "a Hugging Face config.json (or its folder) that exists")
    heads = int(hf["num_attention_heads"]) if hf else m.num_attention_heads
    layers = int(hf["num_hidden_layers"]) if hf else m.num_layers
    kv_heads = int(hf.get("num_key_value_heads", heads)) if hf else m.num_query_groups
    hidden = int(hf.get("hidden_size", m.hidden_size)) if hf else m.hidden_size
    head_dim = int(hf.get("head_dim") or hidden // heads) if hf else hidden // heads
    max_pos = int(hf.get("max_position_embeddings", m.max_position_embeddings)) if hf else m.max_position_embeddings
    if heads % tp:
        _fail("parallel.tensor_model_parallel_size", tp, f"a divisor of the attention heads ({heads})")
    if kv_heads is not None and kv_heads % tp:
        _fail("parallel.tensor_model_parallel_size", tp, f"a divisor of the key-value heads ({kv_heads})")
    if layers % pp:
        _fail("parallel.pipeline_model_parallel_size", pp, f"a divisor of the number of layers ({layers})")
    lmax = cfg.rollout.max_new_tokens
    if lmax >= max_pos:
        _fail("rollout.max_new_tokens", lmax, f"< the context window model.max_position_embeddings = {max_pos} "
              "(prompt + response must fit)")

    warnings: list[str] = []
    actor = actor_of(m.source)
    engine = cfg.rollout.engine
    if m.source == "nemo" and engine == "vllm":
        _fail("rollout.engine", engine, "megatron (the decode engine) or nemo (NeMo-Aligner generation) when "
              "model.source = nemo")
    if m.source != "nemo" and engine == "nemo":
        _fail("rollout.engine", engine, "megatron or vllm unless model.source = nemo")
    kv_desc = kv_bytes = graphs = graphs_pass = graphs_all = None
    if engine == "megatron":
        kv = kv_cache_shape(cfg, layers // pp, (kv_heads or heads) // tp, head_dim, rollout // dp, max_pos)
        kv_desc, kv_bytes = kv.describe(), kv.nbytes
        graphs, graphs_pass, graphs_all = decode_graph_bound(cfg, kv.rows, kv.positions)
        if cluster:
            from laconic_nemo.rollout.kv_cache import KVCacheTooLarge, check_fits

            try:
                check_fits(kv, cfg.rollout.kv_cache_memory_fraction, int(gpu_memory_gib * 2**30),
                           sized_by=f"rollout.kv_cache_rows ({kv.rows} rows: null = responses per DP rank) and "
                                    f"rollout.max_prompt_length + rollout.max_new_tokens ({kv.positions} positions)")
            except KVCacheTooLarge as exc:
                raise LayoutError(str(exc)) from exc
    if world > 1 and m.precision == "fp32" and m.source != "synthetic":
        warnings.append("model.precision = fp32 on GPUs: bf16 is the usual choice")
    if cluster and cfg.parallel.backend == "gloo" and m.source != "synthetic":
        _fail("parallel.backend", cfg.parallel.backend, "auto or nccl on a GPU cluster")

    conversion = False
    if m.source in ("nemo", "hf") and check_paths:
        if not Path(m.path).exists():
            if m.source == "nemo" and hf_model:
                conversion = True
                if not Path(hf_model).exists():
                    _fail("model.path", m.path, f"an existing .nemo, or an existing HF checkpoint to convert "
                          f"(--hf-model {hf_model} does not exist)")
            else:
                _fail("model.path", m.path, "an existing checkpoint" +
                      (" (or pass --hf-model to convert one)" if m.source == "nemo" else ""))
    elif m.source == "nemo" and hf_model:
        conversion = not Path(m.path).exists()
    # which data goes with which model: the synthetic task has its own character tokenizer and GPT, math problems
    # need a checkpoint's tokenizer; reward.kind names the checker the data's answers are graded by
    if cfg.data.kind == "synthetic" and m.source != "synthetic":
        _invalid("data.kind", "synthetic", f"math with model.source = {m.source} (the synthetic task has its own "
                 "tokenizer and model: model.source = synthetic)")
    if cfg.data.kind == "math" and m.source == "synthetic":
        _invalid("data.kind", "math", "synthetic with model.source = synthetic (math problems need a checkpoint's "
                 "tokenizer: model.source = hf or nemo)")
    if cfg.reward.kind != cfg.data.kind:
        _invalid("reward.kind", cfg.reward.kind, f"{cfg.data.kind}, the checker of data.kind = {cfg.data.kind}")
    if cfg.rollout.engine == "vllm" and m.source != "hf":
        _invalid("rollout.engine", "vllm", f"megatron with model.source = {m.source} (vLLM loads a Hugging Face "
                 "checkpoint: model.source = hf)")
    if cfg.data.kind == "synthetic":
        _synthetic_context(cfg, max_pos)
    if cfg.data.kind == "math":
        from laconic_nemo.data.datasets import TEMPLATES

        if cfg.data.prompt_template not in TEMPLATES:
            _invalid("data.prompt_template", cfg.data.prompt_template, f"one of {', '.join(sorted(TEMPLATES))}")
        files = list(cfg.data.train_files)
        if not files:
            _fail("data.train_files", files, "at least one json/jsonl/parquet file with problem and answer")
        if check_paths:
            for f in files:
                if not Path(str(f)).is_file():
                    _fail("data.train_files", str(f), "existing files (see docs/cluster.md, data preparation)")
            from laconic_nemo.data.datasets import validate_data_files

            try:
                validate_data_files(files)
            except ValueError as exc:
                raise LayoutError(f"data.train_files: {exc}") from exc

    engine_mem = None
    if kv_bytes is not None:
        from laconic_nemo.actors import memory as mem

        engine_mem = mem.engine_bytes(kv_bytes, kv.rows, kv.positions, layer_shape(cfg, hf, tp).vocab, hidden, tp=tp,
                                      dtype_bytes=mem.precision_bytes(m.precision),
                                      graphs=cfg.rollout.cuda_graphs)
    resident = engine_mem if cfg.rollout.engine_memory == "resident" else None
    mp, memory = training_memory(cfg, hf, tp, pp, dp, mini // (dp * mbs), resident, gpu_memory_gib)
    if cluster:  # refused before anything is allocated, naming the keys to change
        if not mp.fits:
            raise LayoutError(f"training memory of one GPU: {memory.splitlines()[0]}")
        if engine_mem is not None:
            check_engine_beside_training(cfg, mp, engine_mem, cfg.rollout.kv_cache_memory_fraction,
                                         device_gib(gpu_memory_gib))
    target, attention, packed_attention = target_attention(cfg, actor, engine, image if cluster else "none")
    return Plan(
        recipe=recipe, nodes=int(nodes), gpus_per_node=int(gpus_per_node), world_size=world, tp=tp, pp=pp, dp=dp,
        actor=actor, num_prompts_per_step=prompts, group_size=G, rollout_batch=rollout, minibatch_size=mini,
        micro_batch_size=mbs, steps_per_rollout=rollout // mini, prompts_per_rank=prompts // dp,
        samples_per_rank=rollout // dp, micro_batches_per_step=mini // (dp * mbs), max_new_tokens=lmax,
        budget=cfg.laconic.budget, max_generated_tokens_per_step=rollout * lmax,
        budget_tokens_per_step=int(round(rollout * cfg.laconic.budget)), num_steps=cfg.run.num_steps,
        conversion_needed=conversion, warnings=warnings, rollout_engine=engine, kv_cache=kv_desc,
        kv_cache_bytes=kv_bytes, decode_graphs=graphs, decode_graphs_per_pass=graphs_pass,
        decode_graphs_in_all=graphs_all, training_memory=memory,
        packed_attention=packed_attention, image=None if target is None else target.name, attention=attention,
    )


def target_attention(cfg: Config, actor: str, engine: str, image: str):
    """(the Image the launch runs in or None for this machine, its attention line, the packed kernel of the
    megatron-core actor or None) for ``plan --image image`` (:mod:`laconic_nemo.plan.images`)."""
    from laconic_nemo.plan.images import attention_line, packed_kernel, resolve_image

    try:
        target = resolve_image(image, actor, engine)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None
    packed = actor == "megatron_core" and bool(cfg.grpo.micro_batch_tokens)
    if target is None:  # this machine's packages (CONTAINER=none, or train's own pre-flight)
        kernel = packed_kernel_line(cfg) if packed else None
        return None, kernel, kernel
    attention = attention_line(target, actor, cfg.model.attention, cfg.model.precision, packed)
    return target, attention, packed_kernel(target, cfg.model.attention, cfg.model.precision) if packed else None


def packed_kernel_line(cfg: Config) -> str:
    """The kernel packed micro-batches run on an sm80+ GPU with this environment's packages, for the recipe's
    ``model.attention`` and precision (:func:`laconic_nemo.runtime.kernels.describe_packed_attention`)."""
    from laconic_nemo.runtime.kernels import describe_packed_attention

    return describe_packed_attention(cfg.model.attention, precision_dtype(cfg.model.precision))


def precision_dtype(precision: str):
    """The torch dtype of ``model.precision`` (fp32, bf16, fp16); its bytes are
    :func:`laconic_nemo.actors.memory.precision_bytes`."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def decode_graph_bound(cfg: Config, rows: int, positions: int) -> tuple[str, int, int]:
    """The decode engine's CUDA graphs for a cache of ``rows`` x ``positions``: a description and the most captured
    in one rollout pass and in all (one per batch bucket and KV length; :mod:`laconic_nemo.rollout.schedule`). The
    step is fused by hand: nothing is compiled."""
    from laconic_nemo.rollout.schedule import buckets_up_to, captures_in_all, captures_per_pass

    r = cfg.rollout
    buckets, block = list(r.batch_buckets), r.kv_block
    per_pass = captures_per_pass(rows, positions, buckets, block)
    in_all = captures_in_all(rows, positions, buckets, block)
    n_buckets, n_kv = len(buckets_up_to(rows, buckets)), -(-positions // block)
    desc = (f"<= {per_pass} captures per rollout pass ({n_buckets} batch buckets <= {rows} rows + {n_kv} KV lengths "
            f"- 1), <= {in_all} kept (rollout.batch_buckets, kv_block); no torch.compile (0 compilations)")
    return desc, per_pass, in_all


def kv_cache_shape(cfg: Config, layers_per_stage: int, kv_heads_per_rank: int, head_dim: int,
                   samples_per_rank: int, max_positions: int):
    """The decode engine's KV cache on one GPU (:class:`laconic_nemo.rollout.kv_cache.KVCacheShape`): rows
    ``rollout.kv_cache_rows`` (null: the responses per DP rank), positions ``rollout.max_prompt_length +
    rollout.max_new_tokens`` within the context window, the model's dtype."""
    from laconic_nemo.rollout.kv_cache import KVCacheShape

    r = cfg.rollout
    rows = r.kv_cache_rows if r.kv_cache_rows is not None else int(samples_per_rank)
    positions = min(r.max_prompt_length + r.max_new_tokens, int(max_positions))
    return KVCacheShape(int(layers_per_stage), rows, positions, int(kv_heads_per_rank), int(head_dim),
                        precision_dtype(cfg.model.precision))


def layer_shape(cfg: Config, hf: dict | None, tp: int):
    """The model's sizes for :mod:`laconic_nemo.actors.memory`: from the HF config when readable, else from model.*
    (key-value heads then taken = attention heads); the vocabulary padded to a multiple of 128 x TP."""
    from laconic_nemo.actors import memory

    m = cfg.model
    hf = hf or {}

    def dim(hf_key: str, recipe_value) -> int:  # the checkpoint's value when it has one, else the recipe's
        return int(hf.get(hf_key) or recipe_value)

    h, heads = dim("hidden_size", m.hidden_size), dim("num_attention_heads", m.num_attention_heads)
    return memory.LayerShape(
        hidden=h, heads=heads, groups=dim("num_key_value_heads", m.num_query_groups or heads),
        head_dim=dim("head_dim", h // heads), ffn=dim("intermediate_size", m.ffn_hidden_size),
        layers=dim("num_hidden_layers", m.num_layers), vocab=-(-dim("vocab_size", m.vocab_size) // (128 * tp)) * 128 * tp,
        gated=m.source != "synthetic" or bool(hf))


def device_gib(gpu_memory_gib: float) -> float:
    """The memory a plan assumes for one GPU: an H100 80 GB's 79.1 GiB for the default ``--gpu-memory-gib 80``."""
    from laconic_nemo.actors import memory

    return memory.H100_GIB if float(gpu_memory_gib) == 80.0 else float(gpu_memory_gib)


def training_memory(cfg: Config, hf: dict | None, tp: int, pp: int, dp: int, micro_batches: int,
                    engine=None, gpu_memory_gib: float = 80.0):
    """The training memory of the recipe's actor on one GPU by :mod:`laconic_nemo.actors.memory`, and its line.

    megatron-core actor: the activations of the largest micro-batch (``grpo.micro_batch_tokens``, or a longer single
    row up to L_max; unpacked: micro_batch_size rows of L_max). NeMo-Aligner actor (``model.source = nemo``):
    ``grpo.micro_batch_size`` rows at the widest minibatch, ``rollout.max_prompt_length + rollout.max_new_tokens``
    (within the context window), NeMo's optimiser sharded over DP. Both: the recompute setting that fits
    (``grpo.recompute_layers``: null chooses it the same way on the device) beside ``engine`` (an
    :class:`~laconic_nemo.actors.memory.EngineMemory`: the decode engine when it stays resident through training).
    Returns (the :class:`~laconic_nemo.actors.memory.MemoryPlan`, its line)."""
    from laconic_nemo.actors import memory

    m, g = cfg.model, cfg.grpo
    shape = layer_shape(cfg, hf, tp)
    lmax = cfg.rollout.max_new_tokens
    tied = bool((hf or {}).get("tie_word_embeddings", False))
    params = memory.params_per_rank(shape, tp, pp, tied=tied)
    dtype_bytes = memory.precision_bytes(m.precision)
    device = device_gib(gpu_memory_gib)
    resident = engine.total if engine is not None else 0.0
    if m.source == "nemo":
        max_pos = int((hf or {}).get("max_position_embeddings") or m.max_position_embeddings)
        width = min(cfg.rollout.max_prompt_length + lmax, max_pos)
        mp = memory.nemo_actor_plan(shape, g.micro_batch_size, width, device, tp=tp, pp=pp, dp=dp,
                                    dtype_bytes=dtype_bytes, kernel="flash", params=params,
                                    num_micro_batches=micro_batches, logprob_chunk=g.logprob_chunk_size,
                                    fused_swiglu=True,  # NeMo's megatron_qwen2_config.yaml: bias_activation_fusion
                                    resident_bytes=resident)
        what = (f"NeMo-Aligner actor, {g.micro_batch_size} rows x {width} tokens (max_prompt_length + "
                "max_new_tokens)")
    else:
        # a log-prob chunk is logprob_chunk_size positions of every row: of the one row of a pack, of each padded row
        if g.micro_batch_tokens:
            tokens, what = max(g.micro_batch_tokens, lmax), f"packs of {g.micro_batch_tokens} tokens"
            chunk = memory.logprob_chunk_tokens(g.logprob_chunk_size, 1, tokens)
        else:
            tokens, what = g.micro_batch_size * lmax, f"{g.micro_batch_size} rows of L_max"
            chunk = memory.logprob_chunk_tokens(g.logprob_chunk_size, g.micro_batch_size, lmax)
        kernel = "local" if m.attention == "local" else "flash"
        mp = memory.plan_memory(shape, tokens, device, tp=tp, pp=pp, dtype_bytes=dtype_bytes, kernel=kernel,
                                params=params,
                                reference_on_device=g.kl_beta > 0 and g.reference_on in ("auto", "device"),
                                num_micro_batches=None if g.micro_batch_tokens else micro_batches,  # packs: up to PP
                                logprob_chunk=chunk, seq=lmax,
                                fused_swiglu=True,  # bias_activation_fusion: on for every GPU (kernels.fusion_flags)
                                resident_bytes=resident)
    fixed = "" if g.recompute_layers is None else f"; grpo.recompute_layers = {g.recompute_layers} set"
    card = "H100 80 GB" if float(gpu_memory_gib) == 80.0 else f"{device:g} GiB GPU"
    line = f"{what}: {mp.describe()} ({card}){fixed}"
    if m.source == "nemo":
        line += f"\n                 {mp.breakdown()}"
    return mp, line


def check_engine_beside_training(cfg: Config, mp, engine, kv_fraction: float, device: float) -> None:
    """``rollout.kv_cache_memory_fraction`` against what training leaves: the decode engine may grow its cache up to
    that share of the device (a longer prompt, :meth:`laconic_nemo.rollout.engine.DecodeEngine.generate`), so the
    share, with the engine's buffers and graph pool, must fit beside the least the training step needs (every layer
    recomputed) when the engine stays resident, or beside weights, gradients and optimiser state when it is released
    after each rollout. Raises :class:`LayoutError` naming the key and the largest share that fits."""
    from laconic_nemo.actors import memory

    budget = memory.USABLE_FRACTION * device
    if cfg.rollout.engine_memory == "resident":
        beside, what = mp.peaks_gib[-1] - mp.resident_gib, "the training step with every layer recomputed"
    else:
        beside, what = mp.static_gib, "weights, gradients and optimiser state (rollout.engine_memory = release)"
    extra = (engine.buffers + engine.graph_pool) / memory.GIB
    leaves = budget - beside - extra
    if kv_fraction * device > leaves:
        allowed = max(leaves, 0.0) / device
        _fail("rollout.kv_cache_memory_fraction", kv_fraction,
              f"at most {allowed:.3f}: the cache may grow to {kv_fraction:g} x {device:.1f} GiB = "
              f"{kv_fraction * device:.1f} GiB, but {what} takes {memory.size(beside)} of the "
              f"{memory.size(budget)} a plan may fill, and the engine's buffers and graph pool {memory.size(extra)}")


def _synthetic_context(cfg: Config, max_pos: int) -> None:
    """The synthetic task's longest prompt + L_max, and its longest warm-up example, fit the context window
    (laconic_nemo.data.synthetic: prompt ``Q:`` + 2 tokens per term + newline; a worked answer 5 tokens per
    term + 9, after up to max_filler 5-token filler phrases, + EOS)."""
    syn = cfg.data.synthetic
    prompt = 2 + 2 * int(syn.max_terms) + 1
    lmax = cfg.rollout.max_new_tokens
    if prompt + lmax > max_pos:
        _fail("rollout.max_new_tokens", lmax, f"at most model.max_position_embeddings - the longest prompt = "
              f"{max_pos} - {prompt} = {max_pos - prompt} (data.synthetic.max_terms = {syn.max_terms})")
    if cfg.warmup.num_steps > 0:
        longest = prompt + 5 * int(syn.max_terms) + 9 + 5 * int(syn.max_filler) + 1
        if longest > max_pos:
            _fail("data.synthetic.max_filler", int(syn.max_filler), f"the longest warm-up example ({longest} tokens "
                  f"with max_terms = {syn.max_terms}) must fit model.max_position_embeddings = {max_pos}: allowed "
                  f"max_filler <= {(max_pos - prompt - 5 * int(syn.max_terms) - 10) // 5}")


