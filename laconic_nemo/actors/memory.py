"""Training memory of either actor on one GPU, and the activation recompute that fits: one model for the
megatron-core actor (:func:`plan_memory`) and the NeMo-Aligner actor (:func:`nemo_actor_plan`, the same terms with
NeMo's micro-batches, optimiser and logits), with the decode engine's resident memory beside them
(:func:`engine_bytes`).

The activation memory follows the method of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198), section 4.1: count, tensor by tensor, what each transformer layer keeps for
its backward pass. Their total, ``s b h (34 + 5 a s / h)`` bytes for a 16-bit GPT-3 layer, is for LayerNorm, a
GeLU MLP of 4h, multi-head attention with materialised scores and dropout; the same count for the layer this
project builds (megatron-core's local spec: RMSNorm, grouped-query attention with RoPE, SwiGLU, no dropout), in
bytes per token and layer, at activation width ``d`` bytes (2 for bf16) and tensor parallelism ``t`` (no
sequence parallelism: the tensors of width ``h`` are replicated over the TP ranks)::

    d (6 h + 2 + 4 hd + 4 f / t) + attention

    6 h    the two RMSNorms keep their input and their normalised output (4 h), the QKV and fc1 linears
           their input (2 h)
    2      the two norms' 1 / rms
    4 hd   RoPE's cos and sin for q and for k (one head wide)
    4 f/t  fc1's output (gate and up, 2 f), the SwiGLU output and fc2's input (f each); 3 f / t with megatron's
           fused SwiGLU (``bias_activation_fusion``, on GPU: ``fusions/fused_bias_swiglu.py`` keeps only its
           input); 2 f / t for a plain, ungated MLP

and the attention term by kernel (q = heads x hd, kv = query groups x hd, np = heads, s = tokens of the
micro-batch's sequence)::

    flash-like (flex, TransformerEngine, SDPA's fused kernels):  d (4 q + 3 kv) / t + 8 np / t
        the QKV output (q + 2 kv, v is a view of it), q and k after RoPE, the output (q), its copy for the
        out-projection (q; flex returns [1, np, s, hd], the projection reads [s, np hd]), log-sum-exp and
        max scores (float32)
    dense (CPU packed mask, ``packed_attention(kernel="dense")``): d (4 q + 3 kv) / t + 4 np / t + 4 s
        as flash-like but the output is a view (no copy, no max scores), plus the [s, s] mask as float32
    local (megatron's unfused DotProductAttention):  d (4 q + np s) / t + s
        q after RoPE, k and v expanded to np heads, the output copy, the softmax probabilities [np, s, s]
        and the bool mask [s, s]

A layer recomputed in backward (``recompute_granularity=full``) keeps only its input, ``d h`` per token, and
rebuilds the rest while its backward runs (one layer's activations at a time). Outside the layers: the final
norm and the output layer keep ``d (3 h + 1)`` per token (the embedding its int64 indices, 8); of the logits
``[s, V/t]`` two copies exist at once, ``2 d V / t`` per token: the logits and their gradient while the log-prob
backward runs (the chunked log-probs keep the logits, not their float32 softmax, and write each chunk's gradient
into the one gradient, ``megatron_logprobs.ChunkedLogprobs``; a slice of the logits per chunk added a third, a
zero-filled gradient per chunk), then the gradient and its transposed contiguous copy in the output layer's
backward (megatron's ``[s, b]`` layout; the logits are freed by then); the float32
workspace of one log-prob chunk is ``3 x 4 x chunk x V / t``, ``chunk`` its tokens: ``grpo.logprob_chunk_size``
positions of each row of a padded micro-batch (the megatron-core actor), of the one row of a pack
(:func:`logprob_chunk_tokens`).

tests/test_memory.py checks the per-layer counts against the bytes autograd actually keeps in a forward of
megatron-core's own GPTModel (``torch.autograd.graph.saved_tensors_hooks``) for the dense and local kernels and
for recomputed layers; the flash-like term follows the tensors flex attention saves
(``torch/_higher_order_ops/flex_attention.py``, ``FlexAttentionAutogradOp.forward``: query, key, value, out,
logsumexp, max_scores) and is pending a GPU measurement.

Static memory per parameter: bf16 weights with megatron's mixed-precision optimizer keep the bf16 weight (2),
the float32 main gradient (4, ``grad_reduce_in_fp32``), the float32 master copy (4) and Adam's two moments
(4 + 4): 18 bytes; float32 weights 4 + 4 + 4 + 4 = 16 bytes; a reference policy kept on the device adds one
copy of the weights. The NeMo-Aligner actor's ``distributed_fused_adam`` (NeMo 2.2.1
``megatron_base_model.py:805-833``: a contiguous gradient buffer, float32 optimiser state, master weights as
16-bit remainders of the bf16 weights) keeps the weight (2) and the float32 gradient buffer (4) on every rank and
shards the rest over the ``D`` data-parallel ranks: the float32 gradient shard, the remainders (counted as 4) and
the two moments, ``16 / D`` (apex's ``DistributedFusedAdam``, inferred: apex is not installed here).

The NeMo-Aligner actor (:func:`nemo_actor_plan`): NeMo-Aligner cuts a minibatch into micro-batches of
``grpo.micro_batch_size`` rows at its full width (``megatron_gpt_reinforce_actor.py:165-184``): prompt + response
of the longest row, at most ``rollout.max_prompt_length + rollout.max_new_tokens``. Its log-probs are the chunked
ones of the megatron-core actor (:func:`laconic_nemo.actors.megatron_logprobs.chunked_token_logprobs`) over the
GPTModel's 16-bit logits (the model is called inside megatron's ``Float16Module``, whose float32 copy of the
``[b, s, V/t]`` logits, ``megatron/core/transformer/module.py:175-181``, is never made), so the head term is the
megatron-core actor's; a chunk holds about ``grpo.logprob_chunk_size`` tokens (``chunk / b`` positions of ``b``
rows).

The decode engine (:func:`engine_bytes`): with ``rollout.engine_memory = resident`` its KV cache, per-row buffers
and CUDA-graph pool stay allocated through the training step and count in its peak; with ``release`` they are
freed after every rollout and only bound the rollout (weights, gradient buffers and the cache together).

Pipeline parallelism: with the 1F1B schedule stage ``i`` of ``p`` holds the activations of up to ``p - i``
micro-batches (Korthikanti et al. 2022, section 4.2.3); the first stage is the fullest.

No torch here: ``plan`` uses it without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

GIB = float(2**30)
# what a memory plan may fill of the device (inferred: the CUDA context, cuBLAS / NCCL workspaces and the caching
# allocator's fragmentation take the rest; to be calibrated against the peak benchmarks/gpu_step.py measures)
USABLE_FRACTION = 0.92
H100_GIB = 79.1  # torch.cuda.get_device_properties(...).total_memory of an H100 80 GB, in GiB (what plan assumes)
KERNELS = ("flash", "dense", "local")


@dataclass(frozen=True)
class LayerShape:
    """What the memory of one transformer layer depends on (global sizes; TP divides them)."""

    hidden: int  # h
    heads: int  # np (query heads)
    groups: int  # query groups (key / value heads)
    head_dim: int  # hd
    ffn: int  # f (SwiGLU: fc1 is 2 f wide)
    layers: int  # all layers of the model
    vocab: int  # padded vocabulary
    gated: bool = True  # SwiGLU (fc1 2 f wide); False: fc1 f wide, one activation

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.groups * self.head_dim


def layer_shape_of(config: Any, vocab: int) -> LayerShape:
    """The :class:`LayerShape` of a megatron ``TransformerConfig`` (global sizes) with the padded vocabulary
    ``vocab``: what both actors plan their memory with."""
    c = config
    return LayerShape(hidden=c.hidden_size, heads=c.num_attention_heads,
                      groups=c.num_query_groups or c.num_attention_heads, head_dim=c.kv_channels,
                      ffn=c.ffn_hidden_size, layers=c.num_layers, vocab=int(vocab), gated=bool(c.gated_linear_unit))


def choose_recompute(setting: int | None, per_stage: int, on_gpu: bool,
                     plan: Callable[[], "MemoryPlan"]) -> tuple[int, "MemoryPlan | None"]:
    """Layers per pipeline stage to recompute in backward, and the plan they were chosen by: ``setting``
    (``grpo.recompute_layers``) capped at the stage's ``per_stage`` layers; None: none off a GPU, else the fewest
    the memory model ``plan()`` lets fit (all of the stage's when none does). Both actors choose by it."""
    if setting is not None:
        return min(setting, per_stage), None
    if not on_gpu:
        return 0, None
    chosen = plan()
    return (per_stage if chosen.recompute_layers is None else chosen.recompute_layers), chosen


def layer_bytes_per_token(shape: LayerShape, tp: int = 1, dtype_bytes: int = 2, kernel: str = "flash",
                          seq: int = 0, fused_swiglu: bool = True, glu_offset_sum: bool = False) -> float:
    """Bytes one layer keeps for backward per token of a micro-batch whose sequence has ``seq`` tokens (the
    dense and local kernels grow with it). ``glu_offset_sum``: the unfused gated MLP keeps one more tensor of its
    width (megatron-core 0.16 on, runtime/megatron_compat.glu_keeps_offset_sum). See the module docstring."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    d, t = dtype_bytes, tp
    mlp = (3 if fused_swiglu else 4 + int(glu_offset_sum)) if shape.gated else 2
    common = d * (6 * shape.hidden + 2 + 4 * shape.head_dim + mlp * shape.ffn / t)
    if kernel == "flash":
        attn = d * (4 * shape.q + 3 * shape.kv) / t + 8 * shape.heads / t
    elif kernel == "dense":
        attn = d * (3 * shape.q + 3 * shape.kv) / t + 4 * shape.heads / t + 4 * seq
    else:
        attn = d * (4 * shape.q + shape.heads * seq) / t + seq
    return common + attn


def recomputed_layer_bytes_per_token(shape: LayerShape, dtype_bytes: int = 2) -> float:
    """A layer under full recompute keeps only its input hidden state."""
    return dtype_bytes * shape.hidden


def head_bytes_per_token(shape: LayerShape, tp: int = 1, dtype_bytes: int = 2) -> float:
    """Embedding indices, final norm, output layer and two logit-sized tensors (the logits and their gradient, or the
    gradient and its transposed copy), per token."""
    d = dtype_bytes
    return 8 + d * (3 * shape.hidden + 1) + 2 * d * shape.vocab / tp


def static_bytes(params: int, dtype_bytes: int = 2, reference_on_device: bool = False,
                 optimizer_shards: int = 1) -> float:
    """Weights, float32 main gradients, optimiser state (and a device-resident reference policy) of ``params``
    parameters (this rank's). ``optimizer_shards``: data-parallel ranks the optimiser state and the gradient shard
    are spread over (NeMo's ``distributed_fused_adam``: 2 + 4 + 16 / D bytes for bf16); 1: megatron's optimizer
    (18 bytes for bf16, 16 for float32)."""
    if optimizer_shards > 1:
        per = dtype_bytes + 4 + 16 / optimizer_shards
    else:
        per = 18 if dtype_bytes == 2 else 16
    return params * (per + (dtype_bytes if reference_on_device else 0))


@dataclass(frozen=True)
class EngineMemory:
    """The decode engine's memory on one rank (bytes): the KV cache, the per-row buffers, the CUDA-graph pool."""

    cache: float
    buffers: float
    graph_pool: float

    @property
    def total(self) -> float:
        return self.cache + self.buffers + self.graph_pool

    def describe(self) -> str:
        return (f"{size(self.total / GIB)} (KV cache {size(self.cache / GIB)}, buffers {size(self.buffers / GIB)}, "
                f"graph pool {size(self.graph_pool / GIB)})")


def engine_bytes(kv_cache_bytes: float, rows: int, positions: int, vocab: int, hidden: int, tp: int = 1,
                 dtype_bytes: int = 2, graphs: bool = True) -> EngineMemory:
    """The decode engine's memory on one rank (:mod:`laconic_nemo.rollout.engine`) for a cache of ``rows`` rows x
    ``positions`` positions of ``kv_cache_bytes``: its per-row buffers (:class:`laconic_nemo.rollout.slots.Slots`:
    float32 logits ``[R, V/t]``, two ``[R, h]`` hidden states, int64 tokens and float32 log-probs ``[R+1, S+1]``)
    and, with CUDA graphs, their memory pool: the largest step's temporaries, the device sampler's over ``[R, V/t]``
    (``draw_on_device``: float32 softmax, sorted probabilities and int64 order, cumulative sums; 32 bytes an
    entry, inferred from that code and pending a GPU measurement)."""
    R, S, V = int(rows), int(positions), vocab / tp
    buffers = 4 * R * V + 2 * dtype_bytes * R * hidden + 12 * (R + 1) * (S + 1)
    return EngineMemory(cache=float(kv_cache_bytes), buffers=float(buffers), graph_pool=32.0 * R * V if graphs else 0.0)


def params_per_rank(shape: LayerShape, tp: int = 1, pp: int = 1, qkv_bias: bool = True, tied: bool = True) -> int:
    """Parameters on the fullest rank (first stage: the embedding; with PP = 1 and untied weights also the
    output layer), from the shape alone."""
    h = shape.hidden
    mlp = (3 if shape.gated else 2) * h * shape.ffn
    layer = (h * (shape.q + 2 * shape.kv) + (shape.q + 2 * shape.kv) * qkv_bias + shape.q * h + mlp) / tp
    layer += 2 * h
    n = shape.layers // pp * layer + shape.vocab * h / tp
    if pp == 1:
        n += h + (0 if tied else shape.vocab * h / tp)
    return int(n)


def live_engine_bytes(engine) -> float:
    """What a built decode engine (:class:`laconic_nemo.rollout.engine.DecodeEngine`) holds on the device now
    (:func:`engine_bytes` of its allocated cache; 0 when it has none, e.g. released after a rollout)."""
    cache = getattr(engine, "cache", None) if engine is not None else None
    if cache is None:
        return 0.0
    s = cache.shape
    itemsize = s.nbytes // max(1, s.numel)
    return engine_bytes(s.nbytes, s.rows, s.positions, engine.vocab_size, engine.hidden, dtype_bytes=itemsize,
                        graphs=bool(engine.runner.capture)).total


# bytes of one value of a model of each ``model.precision`` (schema.py): weights, activations, logits, KV cache
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def precision_bytes(precision: str) -> int:
    """Bytes per value at ``model.precision`` (``fp32`` 4, ``bf16`` and ``fp16`` 2): what the memory model counts
    for the weights, activations and logits and the KV cache alike."""
    if precision not in PRECISION_BYTES:
        raise ValueError(f"model.precision = {precision!r} is invalid: allowed one of {', '.join(PRECISION_BYTES)}")
    return PRECISION_BYTES[precision]


MEGATRON_REMEDY = "lower grpo.micro_batch_tokens"


@dataclass
class MemoryPlan:
    """Peak training memory of the fullest rank for one micro-batch size, and the recompute that fits."""

    tokens: int  # tokens of the largest micro-batch
    activation_gib: float  # activations of one micro-batch without recompute (all layers of the stage + head)
    static_gib: float  # weights, gradients, optimiser state (and a device-resident reference policy)
    in_flight: int  # micro-batches whose activations the first stage holds at once
    recompute_layers: int | None  # layers per stage to recompute (0: none); None: does not fit even with all
    peak_gib: float  # predicted peak with that setting (with every layer recomputed when nothing fits)
    device_gib: float
    layers_per_stage: int
    peaks_gib: list[float]  # predicted peak with n = 0 .. layers_per_stage layers recomputed
    resident_gib: float = 0.0  # kept beside training: the decode engine when it stays resident
    head_gib: float = 0.0  # the logits and their gradients, the output layer's inputs (per micro-batch)
    logprob_gib: float = 0.0  # float32 workspace of one log-prob chunk
    layer_gib: float = 0.0  # one layer's activations without recompute (per micro-batch)
    recomputed_gib: float = 0.0  # one recomputed layer's kept input (per micro-batch)
    remedy: str = MEGATRON_REMEDY  # what to change when nothing fits (the keys)

    @property
    def fits(self) -> bool:
        return self.recompute_layers is not None

    @property
    def budget_gib(self) -> float:
        """What a plan may fill of the device."""
        return USABLE_FRACTION * self.device_gib

    def describe(self) -> str:
        dev = f"{self.device_gib:.1f} GiB"
        if self.recompute_layers is None:
            setting = (f"does not fit even with every layer recomputed ({size(self.peak_gib)} > "
                       f"{USABLE_FRACTION:.0%} of {dev}): {self.remedy}")
        elif self.recompute_layers == 0:
            setting = f"no recompute (fits: {size(self.peak_gib)} of {dev})"
        else:
            setting = (f"recompute {self.recompute_layers}/{self.layers_per_stage} layers per stage (peak "
                       f"{size(self.peak_gib)} of {dev})")
        resident = f", decode engine {size(self.resident_gib)} resident" if self.resident_gib else ""
        return (f"activations {size(self.activation_gib)} per micro-batch of {self.tokens} tokens, static "
                f"{size(self.static_gib)}{resident} -> {setting}")

    def breakdown(self) -> str:
        """The terms of the peak: logits and their gradients, the log-prob chunk, the layers at the chosen setting,
        weights / gradients / optimiser, the resident engine."""
        n = self.layers_per_stage if self.recompute_layers is None else self.recompute_layers
        layers = (self.layers_per_stage - n) * self.layer_gib + n * self.recomputed_gib + (self.layer_gib if n else 0)
        return (f"logits + gradients {size(self.head_gib)}, log-prob chunk {size(self.logprob_gib)}, layers "
                f"{size(self.in_flight * layers)} ({size(self.layer_gib)} a layer, {size(self.recomputed_gib)} "
                f"recomputed), weights + grads + optimiser {size(self.static_gib)}, engine {size(self.resident_gib)}")


def size(gib: float) -> str:
    """``gib`` as GiB with one decimal, or MiB below 1 GiB."""
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"


def plan_memory(shape: LayerShape, tokens: int, device_gib: float, tp: int = 1, pp: int = 1, dtype_bytes: int = 2,
                kernel: str = "flash", params: int | None = None, reference_on_device: bool = False,
                num_micro_batches: int | None = None, logprob_chunk: int = 1024, seq: int | None = None,
                fused_swiglu: bool = True, optimizer_shards: int = 1, resident_bytes: float = 0.0,
                remedy: str = MEGATRON_REMEDY, glu_offset_sum: bool = False) -> MemoryPlan:
    """The fewest layers per pipeline stage to recompute so that the fullest rank stays within
    ``USABLE_FRACTION`` of ``device_gib``, for micro-batches of ``tokens`` tokens (``seq``: the longest sequence
    inside one, for the kernels whose memory grows with it; default ``tokens``, a single sequence).
    ``params``: this rank's parameter count (default :func:`params_per_rank`); ``fused_swiglu``: megatron's
    ``bias_activation_fusion`` (on by default on GPU, :func:`laconic_nemo.runtime.kernels.fusion_flags`);
    ``glu_offset_sum``: see :func:`layer_bytes_per_token`;
    ``logprob_chunk``: tokens of one log-prob chunk (:func:`logprob_chunk_tokens`); ``optimizer_shards``: see :func:`static_bytes`;
    ``resident_bytes``: kept on the device beside training (the decode engine, :func:`engine_bytes`);
    ``remedy``: the keys to change, quoted when nothing fits."""
    L = shape.layers // pp
    seq = tokens if seq is None else seq
    n_params = params if params is not None else params_per_rank(shape, tp, pp)
    static = static_bytes(n_params, dtype_bytes, reference_on_device, optimizer_shards)
    layer = layer_bytes_per_token(shape, tp, dtype_bytes, kernel, seq, fused_swiglu, glu_offset_sum) * tokens
    kept = recomputed_layer_bytes_per_token(shape, dtype_bytes) * tokens
    in_flight = pp if num_micro_batches is None else max(1, min(pp, num_micro_batches))
    # PP = 1: the only stage also holds the head; PP > 1: the first stage holds more micro-batches, the last the head
    logits = head_bytes_per_token(shape, tp, dtype_bytes) * tokens
    chunk = 12 * logprob_chunk * shape.vocab / tp
    head = logits + chunk
    resident = float(resident_bytes)

    def peak(n: int) -> float:
        acts = (L - n) * layer + n * kept + (layer if n else 0)  # + one recomputed layer rebuilt during backward
        first = static + resident + in_flight * acts + (head if pp == 1 else 0)
        last = static + resident + acts + head
        return max(first, last)

    budget = USABLE_FRACTION * device_gib * GIB
    choice = next((n for n in range(L + 1) if peak(n) <= budget), None)
    return MemoryPlan(tokens=int(tokens), activation_gib=(L * layer + head) / GIB, static_gib=static / GIB,
                      in_flight=in_flight, recompute_layers=choice, peak_gib=peak(L if choice is None else choice) / GIB,
                      device_gib=float(device_gib), layers_per_stage=L, peaks_gib=[peak(n) / GIB for n in range(L + 1)],
                      resident_gib=resident / GIB, head_gib=logits / GIB, logprob_gib=chunk / GIB,
                      layer_gib=layer / GIB, recomputed_gib=kept / GIB, remedy=remedy)


def memory_prediction(plan: MemoryPlan | None, last_shape: tuple | None, make_plan: Callable[..., MemoryPlan],
                      device: Any, device_gib: float | None = None) -> tuple[MemoryPlan | None, str | None]:
    """The memory model's prediction for an actor's last training step, which the out-of-memory line quotes
    (:class:`laconic_nemo.grpo.trainer.TrainingOutOfMemory`); both actors give theirs by it.

    plan: the plan the step's recompute was chosen by (None: a fixed ``grpo.recompute_layers``, or off a GPU);
    last_shape: the step's micro-batch shape, the arguments of ``make_plan`` (None before the first step);
    make_plan: the actor's plan for a shape, with ``device_gib=``; device: the actor's torch device: off a GPU,
    without ``device_gib``, the plan is for the host's memory. Returns the plan (made now when there was none) and
    its line, ``describe(); breakdown()``; (None, None) before the first step."""
    if plan is None and last_shape is not None:
        if device_gib is None and device.type != "cuda":
            from laconic_nemo.rollout.kv_cache import device_memory_bytes

            device_gib = device_memory_bytes(device) / GIB
        plan = make_plan(*last_shape, device_gib=device_gib)
    if plan is None:
        return None, None
    return plan, f"{plan.describe()}; {plan.breakdown()}"


NEMO_REMEDY = ("lower grpo.micro_batch_size (rows of a micro-batch) or rollout.max_prompt_length + "
               "rollout.max_new_tokens (its width), or free the decode engine for training "
               "(rollout.engine_memory = release)")


def logprob_chunk_positions(chunk_tokens: int, rows: int) -> int:
    """Positions of one log-prob chunk of a padded micro-batch of ``rows`` rows holding about ``chunk_tokens``
    tokens (``grpo.logprob_chunk_size``); at least one."""
    return max(1, int(chunk_tokens) // max(1, int(rows)))


def logprob_chunk_tokens(positions: int, rows: int, width: int) -> int:
    """Tokens of the largest log-prob chunk of a micro-batch of ``rows`` rows of ``width`` positions (a pack: one
    row of its tokens), in chunks of ``positions`` positions
    (:func:`laconic_nemo.actors.megatron_logprobs.chunked_token_logprobs` cuts the sequence dimension):
    ``rows x min(positions, width)``."""
    return max(1, int(rows)) * max(1, min(int(positions), int(width)))


def nemo_actor_plan(shape: LayerShape, rows: int, width: int, device_gib: float, tp: int = 1, pp: int = 1,
                    dp: int = 1, dtype_bytes: int = 2, kernel: str = "flash", params: int | None = None,
                    num_micro_batches: int | None = None, logprob_chunk: int = 1024, fused_swiglu: bool = True,
                    resident_bytes: float = 0.0, remedy: str = NEMO_REMEDY, glu_offset_sum: bool = False) -> MemoryPlan:
    """The NeMo-Aligner actor's training peak for micro-batches of ``rows`` rows of ``width`` tokens (the
    minibatch's width; see the module docstring): :func:`plan_memory` with NeMo's distributed optimiser sharded
    over ``dp``, log-prob chunks of :func:`logprob_chunk_positions` x ``rows`` tokens (at most the width), the engine's
    ``resident_bytes``."""
    chunk = logprob_chunk_tokens(logprob_chunk_positions(logprob_chunk, rows), rows, width)
    return plan_memory(shape, int(rows) * int(width), device_gib, tp=tp, pp=pp, dtype_bytes=dtype_bytes, kernel=kernel,
                       params=params, reference_on_device=False, num_micro_batches=num_micro_batches,
                       logprob_chunk=chunk, seq=int(width), fused_swiglu=fused_swiglu,
                       optimizer_shards=max(1, int(dp)), resident_bytes=resident_bytes, remedy=remedy,
                       glu_offset_sum=glu_offset_sum)
