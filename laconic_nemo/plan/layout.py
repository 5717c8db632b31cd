"""The layout of a launch: whether a recipe fits ``nodes`` x ``gpus_per_node`` GPUs (:func:`plan_layout`).

World size = nodes x GPUs per node divisible by TP x PP, groups of G responses whole on each data-parallel rank,
the global rollout batch divisible into optimiser minibatches and those into DP x micro-batches, attention heads
divisible by TP, layers by PP, L_max inside the context window, which data goes with which model, the data and
checkpoint paths present (or created by the conversion step), the decode engine's KV cache within the GPU's
memory and the training memory of the megatron-core actor. Nothing is allocated: no torch.distributed, no
model, no GPU. A bad layout or key raises :class:`~laconic_nemo.config.LayoutError` naming the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from laconic_nemo.config import Config, LayoutError, check_layout


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
    training_memory: str | None = None    # megatron-core actor: activations per micro-batch, the recompute that fits
    packed_attention: str | None = None   # megatron-core actor, packed micro-batches: the GPU kernel in this environment


ROLLOUT_ENGINES = {
    "megatron": "megatron: the decode engine (laconic_nemo/rollout/engine.py; static KV cache, CUDA-graphed steps)",
    "vllm": "vllm (colocated, weights refitted every step)",
    "nemo": "nemo: NeMo-Aligner's native generation",
}


def _fail(key: str, value, allowed: str) -> None:
    raise LayoutError(f"{key} = {value!r} does not fit the layout: {allowed}")


def _invalid(key: str, value, allowed: str) -> None:
    raise LayoutError(f"{key} = {value!r} is invalid: allowed {allowed}")


def hf_config(path: str | None) -> dict | None:
    """The HF ``config.json`` next to (or inside) ``path`` when it is here, else None. A ``config.json`` that is
    not a JSON object raises LayoutError naming the file and the line."""
    if not path:
        return None
    p = Path(path)
    for cand in (p / "config.json", p.parent / "config.json"):
        if cand.is_file():
            try:
                data = json.loads(cand.read_bytes().decode("utf-8"))
            except UnicodeDecodeError as exc:
                from laconic_nemo.config import not_utf8

                raise LayoutError(f"{cand} {not_utf8(cand, exc)}") from None
            except ValueError as exc:
                line = f" line {exc.lineno}" if hasattr(exc, "lineno") else ""
                raise LayoutError(f"{cand}{line}: invalid JSON ({getattr(exc, 'msg', exc)}); the model folder's "
                                  "config.json must be the checkpoint's JSON configuration") from None
            except OSError as exc:
                raise LayoutError(f"{cand}: unreadable ({exc.strerror})") from None
            if not isinstance(data, dict):
                raise LayoutError(f"{cand}: a JSON object expected (the checkpoint's configuration)")
            return data
    return None


def plan_layout(cfg: Config, nodes: int, gpus_per_node: int, recipe: str = "", hf_model: str | None = None,
                check_paths: bool = True, cluster: bool = True, gpu_memory_gib: float = 80.0) -> Plan:
    """Check ``cfg`` against ``nodes`` x ``gpus_per_node`` GPUs and return the resolved :class:`Plan`.

    hf_model: the HF checkpoint the launch converts to ``model.path`` when that .nemo is missing.
    check_paths: verify data files and checkpoints exist, and every data row (off for planning away from
    the cluster).
    cluster: a GPU cluster launch (``plan``); False for ``train`` on this machine (gloo allowed).
    gpu_memory_gib: memory of one GPU; on a cluster the decode engine's KV cache must fit
    ``rollout.kv_cache_memory_fraction`` of it.
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
    prompts, G = int(g.num_prompts_per_step), int(g.group_size)
    rollout = prompts * G
    mini, mbs = int(g.minibatch_size), int(g.micro_batch_size)

    m = cfg.model
    hf = hf_config(hf_model if m.source == "nemo" else (m.shape_from if m.source == "synthetic" else m.path))
    if m.shape_from and check_paths and hf is None:
        _fail("model.shape_from", m.shape_from, "a Hugging Face config.json (or its folder) that exists")
    heads = int(hf["num_attention_heads"]) if hf else int(m.num_attention_heads)
    layers = int(hf["num_hidden_layers"]) if hf else int(m.num_layers)
    kv_heads = int(hf.get("num_key_value_heads", heads)) if hf else m.num_query_groups
    hidden = int(hf.get("hidden_size", m.hidden_size)) if hf else int(m.hidden_size)
    head_dim = int(hf.get("head_dim") or hidden // heads) if hf else hidden // heads
    max_pos = int(hf.get("max_position_embeddings", m.max_position_embeddings)) if hf else int(m.max_position_embeddings)
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
    actor = "nemo_aligner" if m.source == "nemo" else "megatron_core"
    engine = str(cfg.rollout.engine)
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
                check_fits(kv, float(cfg.rollout.kv_cache_memory_fraction), int(gpu_memory_gib * 2**30),
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
        if not Path(str(m.path)).exists():
            if m.source == "nemo" and hf_model:
                conversion = True
                if not Path(hf_model).exists():
                    _fail("model.path", m.path, f"an existing .nemo, or an existing HF checkpoint to convert "
                          f"(--hf-model {hf_model} does not exist)")
            else:
                _fail("model.path", m.path, "an existing checkpoint" +
                      (" (or pass --hf-model to convert one)" if m.source == "nemo" else ""))
    elif m.source == "nemo" and hf_model:
        conversion = not Path(str(m.path)).exists()
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

    memory = training_memory(cfg, hf, tp, pp, mini // (dp * mbs)) if actor == "megatron_core" else None
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
        packed_attention=packed_kernel_line(cfg) if actor == "megatron_core" and g.micro_batch_tokens else None,
    )


def packed_kernel_line(cfg: Config) -> str:
    """The kernel packed micro-batches run on an sm80+ GPU with this environment's packages, for the recipe's
    ``model.attention`` and precision (:func:`laconic_nemo.runtime.kernels.describe_packed_attention`)."""
    import torch

    from laconic_nemo.runtime.kernels import describe_packed_attention

    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(str(cfg.model.precision), torch.bfloat16)
    return describe_packed_attention(str(cfg.model.attention), dtype)


def decode_graph_bound(cfg: Config, rows: int, positions: int) -> tuple[str, int, int]:
    """The decode engine's CUDA graphs for a cache of ``rows`` x ``positions``: a description and the most captured
    in one rollout pass and in all (one per batch bucket and KV length; :mod:`laconic_nemo.rollout.schedule`). The
    step is fused by hand: nothing is compiled."""
    from laconic_nemo.rollout.schedule import buckets_up_to, captures_in_all, captures_per_pass

    r = cfg.rollout
    buckets, block = list(r.batch_buckets), int(r.kv_block)
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
    import torch

    from laconic_nemo.rollout.kv_cache import KVCacheShape

    r = cfg.rollout
    rows = int(r.kv_cache_rows) if r.kv_cache_rows is not None else int(samples_per_rank)
    positions = min(int(r.max_prompt_length) + int(r.max_new_tokens), int(max_positions))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(cfg.model.precision), torch.float32)
    return KVCacheShape(int(layers_per_stage), rows, positions, int(kv_heads_per_rank), int(head_dim), dtype)


def training_memory(cfg: Config, hf: dict | None, tp: int, pp: int, micro_batches: int) -> str:
    """The megatron-core actor's training memory on one H100 80 GB by :mod:`laconic_nemo.actors.memory`: the
    activations of the largest micro-batch (``grpo.micro_batch_tokens``, or a longer single row up to L_max;
    unpacked: micro_batch_size rows of L_max) and the recompute setting that fits (``grpo.recompute_layers``:
    null chooses it the same way on the device). Shape from the HF config when readable, else from model.*
    (key-value heads then taken = attention heads)."""
    from laconic_nemo.actors import memory

    m, g = cfg.model, cfg.grpo
    hf = hf or {}

    def dim(hf_key: str, recipe_value) -> int:  # the checkpoint's value when it has one, else the recipe's
        return int(hf.get(hf_key) or recipe_value)

    h, heads = dim("hidden_size", m.hidden_size), dim("num_attention_heads", m.num_attention_heads)
    shape = memory.LayerShape(
        hidden=h, heads=heads, groups=dim("num_key_value_heads", heads), head_dim=dim("head_dim", h // heads),
        ffn=dim("intermediate_size", m.ffn_hidden_size), layers=dim("num_hidden_layers", m.num_layers),
        vocab=-(-dim("vocab_size", m.vocab_size) // (128 * tp)) * 128 * tp, gated=m.source != "synthetic" or bool(hf))
    lmax = int(cfg.rollout.max_new_tokens)
    if g.micro_batch_tokens:
        tokens, seq, what = max(int(g.micro_batch_tokens), lmax), lmax, f"packs of {int(g.micro_batch_tokens)} tokens"
    else:
        tokens, seq, what = int(g.micro_batch_size) * lmax, lmax, f"{int(g.micro_batch_size)} rows of L_max"
    tied = bool(hf.get("tie_word_embeddings", False))
    kernel = "local" if m.attention == "local" else "flash"
    mp = memory.plan_memory(shape, tokens, memory.H100_GIB, tp=tp, pp=pp, dtype_bytes=2 if m.precision == "bf16" else 4,
                            kernel=kernel, params=memory.params_per_rank(shape, tp, pp, tied=tied),
                            reference_on_device=float(g.kl_beta) > 0 and g.reference_on in ("auto", "device"),
                            num_micro_batches=None if g.micro_batch_tokens else micro_batches,  # packs: up to PP
                            logprob_chunk=int(g.logprob_chunk_size), seq=seq,
                            fused_swiglu=True)  # bias_activation_fusion: on for every GPU (kernels.fusion_flags)
    fixed = "" if g.recompute_layers is None else f"; grpo.recompute_layers = {int(g.recompute_layers)} set"
    return f"{what}: {mp.describe()} (H100 80 GB){fixed}"


def _synthetic_context(cfg: Config, max_pos: int) -> None:
    """The synthetic task's longest prompt + L_max, and its longest warm-up example, fit the context window
    (laconic_nemo.data.synthetic: prompt ``Q:`` + 2 tokens per term + newline; a worked answer 5 tokens per
    term + 9, after up to max_filler 5-token filler phrases, + EOS)."""
    syn = cfg.data.synthetic
    prompt = 2 + 2 * int(syn.max_terms) + 1
    lmax = int(cfg.rollout.max_new_tokens)
    if prompt + lmax > max_pos:
        _fail("rollout.max_new_tokens", lmax, f"at most model.max_position_embeddings - the longest prompt = "
              f"{max_pos} - {prompt} = {max_pos - prompt} (data.synthetic.max_terms = {syn.max_terms})")
    if int(cfg.warmup.num_steps) > 0:
        longest = prompt + 5 * int(syn.max_terms) + 9 + 5 * int(syn.max_filler) + 1
        if longest > max_pos:
            _fail("data.synthetic.max_filler", int(syn.max_filler), f"the longest warm-up example ({longest} tokens "
                  f"with max_terms = {syn.max_terms}) must fit model.max_position_embeddings = {max_pos}: allowed "
                  f"max_filler <= {(max_pos - prompt - 5 * int(syn.max_terms) - 10) // 5}")


