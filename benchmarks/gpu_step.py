"""One-GPU benchmark of the megatron-core actor: rollout and training throughput at the paper's shapes.

    python benchmarks/gpu_step.py --device cuda                 # Qwen2.5-1.5B shapes, bf16 (about 10 minutes)
    python benchmarks/gpu_step.py --device cuda --profile       # + kernels per decode step beside a plain step
    python benchmarks/gpu_step.py --device cuda --shape small   # a 0.1B model with the same layout
    python benchmarks/gpu_step.py --device cpu                  # tiny shapes, fp32: keeps the script alive in CI

Builds a random-weight model from a config written here (no download) through the bridge, once as a
megatron-core GPTModel (the actor) and once as the Hugging Face model with the same weights, and prints:

1. rollout tokens/s on the same weights and batch (64 prompts of 200 tokens, 1024 new tokens, temperature 1,
   EOS = the last vocabulary id, rarely hit by random weights): Hugging Face ``generate``; today's megatron
   loop before the decode engine (``megatron_sampler.sample_on_device`` over megatron's ``InferenceParams``
   cache, tests/dist/reference_loop.py; and the host float64 loop for a few tokens); the decode engine
   (``laconic_nemo/rollout/engine.py``, device sampler, CUDA graphs, compaction on) at 64 and 256 rows. Each as
   tok/s, the ratio to ``generate`` and the share of the bandwidth bound computed in the run (every decode step
   reads the weights once plus each row's cached keys / values: rows x bandwidth / (weight bytes + rows x mean
   cached tokens x KV bytes per token); bandwidth: the H100 data sheet's 3.35 TB/s on an H100, else a
   device-to-device copy measured in the run);
2. the log-prob mismatch: the largest |log p| difference between the engine's forward (the sampled tokens'
   log-probs it returns) and the training forward (``actor.logprobs``) on the same rollout;
3. a DeepSeek-shaped rollout (DeepSeek-R1-Distill-Qwen-1.5B: Qwen2 1.5B, untied output): 48 rows per GPU as in
   the flagship layout (768 responses over DP 16), up to 4,096 new tokens, response lengths geometric with mean
   ~3,000 capped at 4,096 (inferred from the paper's start-of-training lengths): the output layer is zeroed so
   the engine's draws are uniform over its first ``1/h`` token ids (``vocab_size`` of the engine), which ends a
   row on EOS (id 0) with probability h per token; the output matmul still runs over the whole vocabulary;
4. the projected wall time of the paper's 500-step run on 16 H100 (2 x 8, DP 16): per step one rank's rollout
   (3.) + old and reference log-probs of its 48 responses + 4 optimiser steps of 12 responses (packed, the
   default),
   each measured here on that rollout's tokens; not measured (listed in the output): the DP gradient all-reduce,
   reward grading, checkpoints;
5. one GRPO optimiser step at the paper's shapes (prompts ~200 tokens, responses of 300-4096 tokens):
   tokens/s, MFU against the device's bf16 peak (the data-sheet value, and a bf16 matmul measured in the same
   run), peak memory, and the share of processed tokens that are padding, for the packed micro-batches (the
   default, ``grpo.micro_batch_tokens``: rows concatenated, document-causal attention) beside today's padded
   micro-batches of ``--micro-batch`` rows, length-sorted (``grpo.sort_by_length``) and not; attention sdpa vs
   megatron's local one. Every training row also prints the activation memory per micro-batch that
   ``laconic_nemo.actors.memory`` predicts, the recompute setting it picks for the device, and its predicted
   peak for the setting used (on CPU: for an H100 80 GB).
6. the chunked log-prob backward of both actors: seconds and peak memory before (per-chunk slices of the logits)
   and after (one gradient buffer), and that their gradients are identical (``benchmarks/logprob_backward.py``).

``--profile``: at each engine row count, the kernels per decode step (CUDA: ``torch.profiler``, prefill excluded;
CPU: operators counted at the dispatcher, ``laconic_nemo/rollout/opcount.py``) of the engine's fused step, of the
engine through the model's modules (``EngineSettings.fused = False``) and of the plain graphed decode step of
``benchmarks/plain_decode.py`` at the same shape, rows and mean KV length, measured in the same process; then a
ratio row (kernels, and speed: the plain step's ms per step over the engine's). The engine rows print the first
rollout's graph captures and their seconds. The ``deepseek`` section also prints the window schedule of the
paper's 48-row draw for three bucket lists (``schedule`` rows: graphs, compactions, KV positions read) and, on its
rollout, what reading each row's own KV length (``varlen_attn``'s ``seqused_k``) would save.
Out-of-memory in one configuration is reported in its row and the script goes on.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "dist"))  # reference_loop: today's loop, the baseline of the engine rows

SHAPES = {
    # Qwen2.5-1.5B (config.json of Qwen/Qwen2.5-1.5B): 1.54 B parameters, tied embeddings, GQA 12/2 heads
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, num_layers=28, num_attention_heads=12,
                         num_kv_heads=2, head_dim=128, ffn_hidden_size=8960, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, qkv_bias=True, qk_norm=False),
    # the same layout at ~0.1 B parameters
    "small": dict(model_type="qwen2", hidden_size=512, num_layers=8, num_attention_heads=8, num_kv_heads=2,
                  head_dim=64, ffn_hidden_size=2048, vocab_size=151936, max_position_embeddings=32768,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True, qk_norm=False),
    # DeepSeek-R1-Distill-Qwen-1.5B (its config.json: Qwen2, untied output, rope_theta 10000)
    "deepseek-1.5b": dict(model_type="qwen2", hidden_size=1536, num_layers=28, num_attention_heads=12,
                          num_kv_heads=2, head_dim=128, ffn_hidden_size=8960, vocab_size=151936,
                          max_position_embeddings=131072, rope_theta=1e4, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, qkv_bias=True, qk_norm=False),
    # CPU smoke shapes
    "tiny-untied": dict(model_type="qwen2", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                        head_dim=16, ffn_hidden_size=128, vocab_size=512, max_position_embeddings=2048,
                        rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True, qk_norm=False),
    "tiny": dict(model_type="qwen2", hidden_size=64, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                 head_dim=16, ffn_hidden_size=128, vocab_size=512, max_position_embeddings=2048,
                 rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True, qk_norm=False),
}
H100_BF16_PEAK = 989e12  # H100 SXM dense bf16, data sheet
H100_HBM_TBS = 3.35  # H100 SXM HBM3, data sheet (../shared/gpu/README.md)
PAPER_STEPS, PAPER_GPUS, PAPER_ROWS_PER_GPU, PAPER_OPT_STEPS = 500, 16, 48, 4  # deepseek_1.5b_b1500.yaml, DP 16


def hf_config(arch) -> dict:
    """The Hugging Face config.json of ``arch`` (qwen2)."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": arch.hidden_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
        "intermediate_size": arch.ffn_hidden_size, "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_position_embeddings, "rope_theta": arch.rope_theta,
        "rms_norm_eps": arch.rms_norm_eps, "tie_word_embeddings": arch.tie_word_embeddings,
        "hidden_act": "silu", "use_sliding_window": False, "attention_dropout": 0.0,
    }


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def params_count(arch) -> int:
    h, f, v, L = arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size, arch.num_layers
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    attn = h * (q + 2 * kv) + (q + 2 * kv) * arch.qkv_bias + q * h
    layer = attn + 3 * h * f + 2 * h
    return L * layer + v * h * (1 if arch.tie_word_embeddings else 2) + h


def train_flops(arch, lengths: list[int]) -> float:
    """Model FLOPs of forward + backward for sequences of ``lengths`` tokens: 6 x (non-embedding params +
    output layer) per token, plus causal attention 6 x 2 x L x s^2/2 x heads x head_dim per sequence."""
    n_dense = params_count(arch) - arch.vocab_size * arch.hidden_size  # the embedding lookup is no matmul
    n_dense += arch.vocab_size * arch.hidden_size  # the output projection is
    tokens = sum(lengths)
    attn = sum(6 * 2 * arch.num_layers * (s * s / 2) * arch.num_attention_heads * arch.head_dim for s in lengths)
    return 6.0 * n_dense * tokens + attn


def matmul_tflops(device) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12


def size(gib: float) -> str:
    from laconic_nemo.actors.memory import size as _size

    return _size(gib)


def build_actor(arch, attention: str, device, dtype, args):
    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.bridge.megatron import actor_kwargs
    from laconic_nemo.runtime.megatron_env import init_distributed

    info = init_distributed(1, 1, backend="auto", seed=0)
    kw = actor_kwargs(arch, 1, 1, cpu=device.type != "cuda", dtype=dtype, attention=attention)
    return MegatronCoreActor(info, **kw, lr=1e-6, micro_batch_size=args.micro_batch, kl_beta=0.0,
                             sampler="device", sort_by_length=True, micro_batch_tokens=args.micro_batch_tokens)


def recompute_setting(setting: str, num_layers: int) -> int | None:
    """``grpo.recompute_layers`` for a command-line setting: ``auto`` (None: chosen by memory), ``all`` or N."""
    if setting == "auto":
        return None
    return num_layers if setting == "all" else int(setting)


def recompute_label(layers: int, num_layers: int, setting: int | None) -> str:
    how = "by memory: " if setting is None else ""
    return f"{how}no recompute" if layers == 0 else f"{how}recompute {layers}/{num_layers} layers"


def free(*objs):
    for o in objs:
        del o
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_rollout(actor, prompts, new_tokens, sampler: str, eos_id: int, device) -> tuple[float, int]:
    """Today's loop before the decode engine (``megatron_sampler`` over an ``InferenceParams`` cache)."""
    from reference_loop import actor_reference

    from laconic_nemo.grpo.interfaces import SamplingParams

    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, eos_id=eos_id, seed=1)
    sync(device)
    t = time.perf_counter()
    out = actor_reference(actor, prompts, sp, sampler=sampler, sync_every=8)
    sync(device)
    return time.perf_counter() - t, int(out.response_lengths.sum())


def engine_settings(cpu: bool, prompt_len: int, new_tokens: int, **kw):
    from laconic_nemo.rollout.engine import DEFAULT_BUCKETS, EngineSettings

    base = dict(sampler="device", sync_every=8, compact=True, cuda_graphs=True, kv_cache_rows=None,
                max_prompt_length=prompt_len, max_new_tokens=new_tokens, kv_block=16 if cpu else 256,
                batch_buckets=(2, 4, 8, 16, 32, 64) if cpu else DEFAULT_BUCKETS)
    return EngineSettings(**{**base, **kw})


def time_engine(engine, prompts, new_tokens: int, eos_id: int, device, logprobs: bool = False, seed: int = 1):
    """One engine rollout after a warm-up rollout of the same shape (the warm-up captures the CUDA graphs):
    (seconds, the output, seconds of the warm-up, the warm-up's EngineStats: its captures and their seconds)."""
    from laconic_nemo.grpo.interfaces import SamplingParams

    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, eos_id=eos_id, seed=seed)
    sync(device)
    t = time.perf_counter()
    engine.generate(prompts, sp, return_logprobs=logprobs)
    sync(device)
    warm, warm_stats = time.perf_counter() - t, engine.stats
    t = time.perf_counter()
    out = engine.generate(prompts, sp, return_logprobs=logprobs)
    sync(device)
    return time.perf_counter() - t, out, warm, warm_stats


def copy_bandwidth_tbs(device) -> float:
    """A device-to-device copy of 256 MiB (read + write), TB/s."""
    n = 64 * 2**20
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    sync(device)
    return 5 * 2 * a.numel() * 4 / (time.perf_counter() - t) / 1e12


def bound_tok_s(weight_bytes: int, kv_bytes_per_token: int, rows: int, mean_cached: float, tbs: float) -> float:
    """Decode upper bound: each step reads the weights once and every row's cached keys / values."""
    return rows * tbs * 1e12 / (weight_bytes + rows * mean_cached * kv_bytes_per_token)


def hazard_for_mean(mean: float, cap: int) -> float:
    """Per-token EOS probability h whose geometric length, capped at ``cap``, has expectation ``mean``:
    E[min(G, cap)] = (1 - (1 - h)^cap) / h, solved by bisection."""
    lo, hi = 1e-9, 1.0
    for _ in range(200):
        h = (lo + hi) / 2
        if (1 - (1 - h) ** cap) / h > mean:
            lo = h
        else:
            hi = h
    return (lo + hi) / 2


def decode_kernels(engine, prompts, new_tokens: int, eos_id: int, device) -> tuple[float, str]:
    """Kernels (CUDA: torch.profiler) or operators (CPU: counted at the dispatcher, ``opcount``) per decode step of
    the engine, and a note. CUDA: a rollout of ``new_tokens`` minus one of a single token (its prefill) over their
    difference in decode steps, graphs captured beforehand; the host launches per step beside."""
    from laconic_nemo.grpo.interfaces import SamplingParams

    def sp(n):
        return SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=n, eos_id=eos_id, seed=1)

    if device.type != "cuda":
        engine.count_ops = True
        engine.generate(prompts, sp(new_tokens))
        engine.count_ops = False
        ops = engine.stats.step_ops
        return sum(c.kernels for c in ops) / max(1, len(ops)), f"{sum(c.total for c in ops) / max(1, len(ops)):.0f} " \
            "with views"
    from torch.profiler import ProfilerActivity, profile

    engine.generate(prompts, sp(new_tokens))  # warm-up: captures
    counts = []
    for n in (1, new_tokens):
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, sp(n))
            sync(device)
        events = prof.events()
        counts.append((sum(1 for e in events if e.device_type.name == "CUDA"), engine.stats.decode_steps,
                       sum(1 for e in events if e.name in ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel"))))
    steps = max(1, counts[1][1] - counts[0][1])
    return (counts[1][0] - counts[0][0]) / steps, f"{(counts[1][2] - counts[0][2]) / steps:.1f} host launches"


def profile_rows(actor, arch, batch, engine, engine_ms: float, mean_kv: int, prompt_len: int, new_tokens: int,
                 eos_id: int, device, add, cpu: bool) -> None:
    """``--profile`` at one row count: kernels per decode step of the engine (fused step), of the engine through the
    model's modules (``EngineSettings.fused = False``) and of the plain graphed step of ``benchmarks/plain_decode.py``
    at the same shape, rows and mean KV length, in this process; then the ratio row (kernels, and speed: the plain
    step's ms / the engine's ms per decode step, rollout included; target >= 1.0)."""
    from plain_decode import PlainStep

    from laconic_nemo.rollout.engine import DecodeEngine

    rows, n = len(batch), min(new_tokens, 128)
    unit = "operators" if cpu else "GPU kernels"
    per_layer = "" if cpu else " (prefill excluded)"
    fused, note = decode_kernels(engine, batch, n, eos_id, device)
    add("profile", f"engine decode step (fused), {rows} rows", f"{fused:.0f} {unit} per step{per_layer}, {note}",
        f"{engine_ms:.2f} ms/step (rollout / steps)", "-")
    modules = DecodeEngine(actor.model, actor.vocab_size, engine_settings(cpu, prompt_len, new_tokens, fused=False))
    plain_k, note = decode_kernels(modules, batch, n, eos_id, device)
    modules.free()
    add("profile", f"engine decode step, module path (fused=False), {rows} rows", f"{plain_k:.0f} {unit} per step, "
        f"{note}", "-", f"fused / module {fused / plain_k:.2f}")
    dtype = actor.config.params_dtype
    try:
        plain = PlainStep(arch, rows, mean_kv, device, dtype)
        ms, capture = plain.time()
        k = plain.kernels_per_step() if not cpu else plain.ops().kernels
    except torch.cuda.OutOfMemoryError:
        add("profile", f"plain graphed step, {rows} rows", "OOM", "-", "-")
        return
    add("profile", f"plain graphed step (benchmarks/plain_decode.py), {rows} rows, KV {mean_kv}",
        f"{k:.0f} {unit} per step, capture {capture:.2f} s", f"{ms:.2f} ms/step ({1e3 * rows / ms:,.0f} tok/s)", "1.00")
    add("profile", f"engine vs plain step, {rows} rows", f"kernels {fused / k:.2f}x the plain step's",
        f"speed {ms / engine_ms:.2f}x (plain ms / engine ms)", "target >= 1.0 on a GPU")
    del plain
    free()


def seqused_estimate(out, settings, positions: int, weight_bytes: int, kv_bytes_per_token: int) -> str:
    """What reading each row's own length (``varlen_attn(seqused_k=...)``) would save on this rollout: the engine's
    schedule replayed on its response lengths (``rollout.schedule.simulate``, the engine's own windows): KV positions
    attention reads (bucket x KV length per step) against those the live rows hold, and bytes per step with the
    weights read once each step."""
    from laconic_nemo.rollout.schedule import simulate

    s = simulate(out.prompt_lengths.tolist(), out.response_lengths.tolist(), None, positions,
                 int(out.response_lengths.max()), settings.batch_buckets, settings.kv_block, settings.sync_every)
    now = s.decode_steps * weight_bytes + s.kv_read * kv_bytes_per_token
    per_row = s.decode_steps * weight_bytes + s.kv_needed * kv_bytes_per_token
    return (f"KV positions read {s.kv_read / s.kv_needed:.2f}x those held by live rows (rows live "
            f"{100 * s.live_row_steps / s.row_steps:.0f}% of the bucket); bytes per step {gb(now / s.decode_steps)} now, "
            f"{gb(per_row / s.decode_steps)} per-row: {100 * (1 - per_row / now):.1f}% less")


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def time_hf_generate(hf, prompts, new_tokens, device) -> tuple[float, int]:
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    sync(device)
    t = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    sync(device)
    return time.perf_counter() - t, int((out.shape[1] - ids.shape[1]) * ids.shape[0])


def train_batch(arch, n: int, prompt_len: int, max_resp: int, seed: int = 0):
    """A GRPO minibatch: n rows, prompts of ``prompt_len`` tokens, responses of 300..max_resp tokens (uniform),
    right-padded to the longest; random tokens, advantages and old log-probs."""
    from laconic_nemo.grpo.interfaces import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lo = min(300, max_resp // 6)
    resp = torch.randint(lo, max_resp + 1, (n,), generator=g)
    resp[0] = max_resp
    T = prompt_len + max_resp
    tokens = torch.randint(0, arch.vocab_size, (n, T), generator=g)
    mask = torch.zeros(n, T - 1)
    for i in range(n):
        mask[i, prompt_len - 1 : prompt_len - 1 + int(resp[i])] = 1.0
        tokens[i, prompt_len + int(resp[i]) :] = 0
    old = -5.0 * mask
    return TrainBatch(tokens, torch.full((n,), prompt_len), resp, mask, advantages=torch.randn(n, generator=g),
                      old_logprobs=old)


def time_train(actor, batch, device, steps: int) -> dict:
    from laconic_nemo.grpo.loss import make_grpo_loss_fn

    fn = make_grpo_loss_fn(0.2, 0.28, 0.0, "token_mean", float(batch.response_mask.sum()), float(len(batch)))
    actor.train_step(batch, fn)  # warm-up (allocations, kernels)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        actor.train_step(batch, fn)
    sync(device)
    dt = (time.perf_counter() - t) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"s_per_step": dt, "peak_gib": peak}


def reference_placements(actor, arch, prompt_len: int, max_resp: int, device, add) -> None:
    """Reference log-probs (``grpo.kl_beta > 0``) with pi_ref's weights on the device (swapped by pointer),
    in pinned host memory (async copies) and in pageable host memory: seconds per pass over 8 rows, and the
    largest difference to the device placement (0: the same weights, the same computation)."""
    batch = train_batch(arch, 8, prompt_len, max_resp // 2, seed=3)
    placements = ("device", "pinned", "cpu") if device.type == "cuda" else ("device", "cpu")
    first = None
    for where in placements:
        actor.reference_on = where
        actor.reset_reference()
        actor.logprobs(batch, reference=True)  # warm-up
        sync(device)
        t = time.perf_counter()
        lp = actor.logprobs(batch, reference=True)
        sync(device)
        dt = time.perf_counter() - t
        first = lp if first is None else first
        add("reference", f"pi_ref weights on {where}", f"{dt:.2f} s per pass (8 rows)",
            f"max |diff| to {placements[0]} {float((lp - first).abs().max()):.1e}", "-")
    actor.reference.state = None


def packed_padding_share(actor, batch) -> float:
    """Share of the processed positions that are padding with the actor's packed micro-batches (tails padded
    to one size under pipeline parallelism only)."""
    packs = actor.batches.packs(batch)
    return 1.0 - sum(p.real_tokens for p in packs) / sum(p.size for p in packs)


def micro_batch_memory(actor, batch, packed: bool, device) -> tuple[str, list[float]]:
    """The memory model's line for the largest micro-batch of ``batch`` (activations, static, the recompute that
    fits the device; on CPU an H100 80 GB) and its predicted peaks by number of recomputed layers."""
    from laconic_nemo.actors import memory

    if packed:
        packs = actor.batches.packs(batch)
        tokens, seq, n = max(p.size for p in packs), max(p.max_seqlen for p in packs), len(packs)
    else:
        micro, _ = actor.batches.micro_batches(batch, min(actor.micro_batch_size, len(batch)))
        seq = max(mb.tokens.shape[1] for mb in micro)
        tokens, n = seq * min(actor.micro_batch_size, len(batch)), len(micro)
    gib = None if device.type == "cuda" else memory.H100_GIB
    mp = actor.plan_memory(tokens, seq, n, device_gib=gib)
    where = "" if device.type == "cuda" else " [for an H100 80 GB]"
    return mp.describe() + where, mp.peaks_gib


def padding_share(batch, mbs: int, sort: bool) -> float:
    """Share of the processed token positions that are padding, for micro-batches of ``mbs`` rows."""
    ends = (batch.prompt_lengths + batch.response_lengths).tolist()
    order = sorted(range(len(ends)), key=lambda i: -ends[i]) if sort else list(range(len(ends)))
    processed = 0
    for i in range(0, len(order), mbs):
        rows = order[i : i + mbs]
        width = max(ends[r] for r in rows) if sort else batch.tokens.shape[1]
        processed += width * len(rows)
    return 1.0 - sum(ends) / processed


def engine_section(actor, arch, prompts, prompt_len, new_tokens, engine_rows, eos_id, device, hf_tps, tbs, add,
                   cpu: bool, profile: bool) -> None:
    """The decode engine at each of ``engine_rows`` (the prompts repeated, as GRPO's groups), its share of the
    bandwidth bound, and the rollout / training log-prob mismatch on the first row count's rollout."""
    from laconic_nemo.grpo.interfaces import TrainBatch
    from laconic_nemo.rollout.engine import DecodeEngine

    weight_bytes = sum(p.numel() * p.element_size() for p in actor.module.parameters())
    for i, rows in enumerate(engine_rows):
        batch = [prompts[j % len(prompts)] for j in range(rows)]
        engine = DecodeEngine(actor.model, actor.vocab_size, engine_settings(cpu, prompt_len, new_tokens))
        label = f"decode engine, device sampler, {rows} rows"
        try:
            dt, out, warm, ws = time_engine(engine, batch, new_tokens, eos_id, device, logprobs=i == 0)
        except torch.cuda.OutOfMemoryError:
            add("rollout", label, "OOM", "-", "-")
            continue
        ntok = int(out.response_lengths.sum())
        tps = ntok / dt
        kv_tok = engine.cache.shape.bytes_per_token
        mean_cached = float((out.prompt_lengths + out.response_lengths / 2).float().mean())
        bound = bound_tok_s(weight_bytes, kv_tok, rows, mean_cached, tbs)
        ratio = f"{tps / hf_tps:.2f}" if hf_tps else "-"
        ms = 1e3 * dt / max(1, engine.stats.decode_steps)
        add("rollout", label, f"{ntok} tok in {dt:.2f} s ({ms:.2f} ms/step; first run {warm:.1f} s, of it "
            f"{ws.captures} captures in {ws.capture_s:.1f} s; {engine.stats.graphs} graphs)", f"{tps:,.0f} tok/s",
            f"{ratio}; {100 * tps / bound:.1f}% of the bound {bound:,.0f} tok/s")
        if i == 0:
            inside = torch.zeros(out.tokens.shape[0], out.tokens.shape[1] - 1)
            for r in range(len(batch)):
                p, n = int(out.prompt_lengths[r]), int(out.response_lengths[r])
                inside[r, p - 1 : p + n - 1] = 1
            lp = actor.logprobs(TrainBatch(out.tokens, out.prompt_lengths, out.response_lengths, inside),
                                micro_batch_size=4)
            diff = (out.logprobs - lp)[inside.bool()].abs()
            add("rollout", f"log-prob mismatch, engine vs training forward, {rows} rows",
                f"max |diff| {float(diff.max()):.2e}, mean {float(diff.mean()):.2e} over {int(inside.sum())} tokens",
                "-", str(actor.config.params_dtype)[6:])
        if profile:
            w = engine.stats.windows
            mean_kv = round(sum(kv * n for _, kv, n in w) / max(1, sum(n for _, _, n in w)))
            profile_rows(actor, arch, batch, engine, ms, mean_kv, prompt_len, new_tokens, eos_id, device, add, cpu)
        engine.free()


def geometric_lengths(rows: int, cap: int, mean: float, seed: int = 7) -> list[int]:
    """Response lengths (tokens, EOS included) geometric with E[min(G, cap)] = ``mean``, capped at ``cap``."""
    h = hazard_for_mean(mean, cap)
    u = torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (torch.log1p(-u) / torch.log1p(torch.tensor(-h, dtype=torch.float64))).ceil().clamp(1, cap).long().tolist()


def schedule_rows(add) -> None:
    """The engine's window schedule (``rollout.schedule.simulate``, no model) on the DeepSeek-shaped draw at the paper's
    shape - 48 rows (and 256) of 200-token prompts, L_max 4,096, geometric lengths of mean 3,000, DeepSeek-R1-Distill-1.5B's
    bytes (bf16 weights read once per step, 28.7 kB of keys / values per cached token), sync every 8 steps, KV block
    256 - for three bucket lists: graphs captured, compactions, share of bucket rows still live, KV positions read
    against those the live rows hold, and what reading each row's own length (seqused_k) would save per step."""
    from laconic_nemo.bridge import ModelArch
    from laconic_nemo.rollout.engine import DEFAULT_BUCKETS
    from laconic_nemo.rollout.schedule import captures_per_pass, fine_buckets, simulate

    arch = ModelArch(**SHAPES["deepseek-1.5b"])
    weight_bytes = 2 * params_count(arch)
    kv_tok = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
    P, L, positions = 200, 4096, 200 + 4096
    for rows, name, buckets in ((r, name, b) for r in (PAPER_ROWS_PER_GPU, 256) for name, b in (
            ("powers of two", (8, 16, 32, 64, 128, 256, 512)), ("8, multiples of 16 (default)", DEFAULT_BUCKETS),
            ("multiples of 8", fine_buckets(step=8)))):
        s = simulate([P] * rows, geometric_lengths(rows, L, 3000.0), None, positions, L, buckets, 256, 8)
        now = s.decode_steps * weight_bytes + s.kv_read * kv_tok
        per_row = s.decode_steps * weight_bytes + s.kv_needed * kv_tok
        add("schedule", f"DeepSeek shape, {rows} rows, buckets {name}",
            f"{s.captures} graphs (bound {captures_per_pass(rows, positions, buckets, 256)}), {s.compactions} "
            f"compactions, rows live {100 * s.live_row_steps / s.row_steps:.0f}% of the bucket, KV read "
            f"{s.kv_read / s.kv_needed:.2f}x what live rows hold", f"{now / s.decode_steps / 1e9:.2f} GB/step",
            f"per-row KV lengths (seqused_k): {per_row / s.decode_steps / 1e9:.2f} GB/step, "
            f"{100 * (1 - per_row / now):.1f}% less")


def deepseek_section(shape, args, device, dtype, prompt_len, new_tokens, mean, cpu, add) -> None:
    """The DeepSeek-shaped rollout of one rank and the 500-step projection (see the module docstring)."""
    from laconic_nemo.bridge import ModelArch
    from laconic_nemo.grpo.interfaces import TrainBatch
    from laconic_nemo.rollout.engine import DecodeEngine

    arch = ModelArch(**SHAPES[shape])
    actor = build_actor(arch, "sdpa", device, dtype, args)
    with torch.no_grad():
        actor.module.output_layer.weight.zero_()  # uniform draws: the EOS hazard is 1 / the engine's vocabulary
    h = hazard_for_mean(mean, new_tokens)
    v_eff = max(2, min(arch.vocab_size, round(1 / h)))
    rows = args.deepseek_rows
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(1, arch.vocab_size, (rows // 6 or 1, prompt_len), generator=g).tolist()
    batch = [prompts[j // 6 % len(prompts)] for j in range(rows)]  # G = 6 samples per prompt
    engine = DecodeEngine(actor.model, v_eff, engine_settings(cpu, prompt_len, new_tokens))
    label = f"DeepSeek-shaped rollout ({shape}), {rows} rows, L_max {new_tokens}"
    try:
        dt, out, warm, ws = time_engine(engine, batch, new_tokens, 0, device)
    except torch.cuda.OutOfMemoryError:
        add("deepseek", label, "OOM", "-", "-")
        return
    L = out.response_lengths.float()
    ntok = int(L.sum())
    target = " (target <= 15 s on an H100, <= 12 s on an H200)" if shape == "deepseek-1.5b" else ""
    add("deepseek", label, f"{dt:.2f} s{target}; lengths mean {float(L.mean()):.0f} (drawn: geometric mean "
        f"{mean:.0f}, EOS hazard 1/{v_eff}), max {int(L.max())}, {int(out.truncated.sum())} at L_max; "
        f"{engine.stats.compactions} compactions, buckets {sorted({w[0] for w in engine.stats.windows})}",
        f"{ntok / dt:,.0f} tok/s", f"first run {warm:.1f} s, of it {ws.captures} captures in {ws.capture_s:.1f} s "
        "(target <= 10 s)")
    weight_bytes = sum(p.numel() * p.element_size() for p in actor.module.parameters())
    add("deepseek", "per-row KV lengths (varlen_attn seqused_k), estimate on this rollout",
        seqused_estimate(out, engine.settings, engine.cache.shape.positions, weight_bytes,
                         engine.cache.shape.bytes_per_token), "-", "not built (docs/benchmarks.md)")
    engine.free()
    actor.generation.engine = None
    free()

    # the rest of one GRPO step of the paper's run on this rank, on this rollout's tokens
    n, T = out.tokens.shape
    mask = torch.zeros(n, T - 1)
    for r in range(n):
        p, k = int(out.prompt_lengths[r]), int(out.response_lengths[r])
        mask[r, p - 1 : p + k - 1] = 1
    full = TrainBatch(out.tokens, out.prompt_lengths, out.response_lengths, mask,
                      advantages=torch.randn(n, generator=g), old_logprobs=-5.0 * mask)
    try:
        actor.logprobs(full, micro_batch_size=4)  # warm-up
        sync(device)
        t = time.perf_counter()
        actor.logprobs(full, micro_batch_size=4)
        sync(device)
        t_lp = time.perf_counter() - t
        actor.micro_batch_tokens, actor.recompute_setting = args.micro_batch_tokens, None  # the defaults
        mini = full.select(slice(0, max(1, n // PAPER_OPT_STEPS)))
        r = time_train(actor, mini, device, 1)
        t_train = r["s_per_step"]
    except torch.cuda.OutOfMemoryError:
        add("projection", "500 steps on 16 GPUs", "OOM in the training part", "-", "-")
        return
    step = dt + 2 * t_lp + PAPER_OPT_STEPS * t_train
    hours = PAPER_STEPS * step / 3600
    add("projection", f"paper run: {PAPER_STEPS} steps x ({rows} responses per GPU, {PAPER_GPUS} GPUs)",
        f"{step:.1f} s/step = rollout {dt:.1f} + 2 x log-probs {t_lp:.1f} (old, reference) + {PAPER_OPT_STEPS} x "
        f"optimiser step {t_train:.1f} ({len(mini)} rows, packs of <= {args.micro_batch_tokens} tokens, recompute by "
        f"memory)",
        f"{hours:.2f} h", "not measured: DP all-reduce, reward, checkpoints")
    actor = None
    free()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: qwen2.5-1.5b on cuda, tiny on cpu")
    ap.add_argument("--prompts", type=int, default=None, help="rollout batch (default 64; 8 on cpu)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 200; 16 on cpu)")
    ap.add_argument("--new-tokens", type=int, default=None, help="rollout tokens per row (default 1024; 32 on cpu)")
    ap.add_argument("--exact-tokens", type=int, default=16, help="new tokens for the (slow) host float64 sampler")
    ap.add_argument("--train-rows", type=int, default=None, help="rows of the GRPO minibatch (default 16; 8 on cpu)")
    ap.add_argument("--max-response", type=int, default=None, help="longest response (default 4096; 48 on cpu)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="token budget of a packed micro-batch (grpo.micro_batch_tokens; default 16384, 128 on cpu; "
                         "0 skips the packed step)")
    ap.add_argument("--recompute-layers", default="all",
                    help="GPU: comma list of settings to train the padded micro-batches with, each a number of layers "
                         "whose activations are recomputed in backward (all = every layer; 0 = none); e.g. all,14")
    ap.add_argument("--engine-rows", default=None, help="rows of the engine rollouts (default 64,256; 8,32 on cpu)")
    ap.add_argument("--deepseek-rows", type=int, default=PAPER_ROWS_PER_GPU, help="rows of the DeepSeek-shaped "
                    "rollout (default 48: one rank of the flagship layout)")
    ap.add_argument("--deepseek-new-tokens", type=int, default=None, help="its L_max (default 4096; 64 on cpu)")
    ap.add_argument("--deepseek-mean", type=float, default=None,
                    help="its mean response length (default 3000; 0.73 x L_max elsewhere)")
    ap.add_argument("--bandwidth-tbs", type=float, default=None,
                    help="memory bandwidth of the bound (default: 3.35 on an H100, else a copy measured in the run)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler summary of the engine's decode steps")
    ap.add_argument("--packed-recompute", default="auto,0",
                    help="GPU: comma list of recompute settings for the packed step (auto = chosen by the memory "
                         "model, all, or a number of layers)")
    ap.add_argument("--skip", default="",
                    help="comma list of sections to skip: rollout,hf,local,local-rollout,engine,deepseek,train,"
                         "reference,logprob")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_step: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    cpu = device.type == "cpu"
    if cpu:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    shape = args.shape or ("tiny" if cpu else "qwen2.5-1.5b")
    n_prompts = args.prompts or (8 if cpu else 64)
    prompt_len = args.prompt_len or (16 if cpu else 200)
    new_tokens = args.new_tokens or (32 if cpu else 1024)
    train_rows = args.train_rows or (8 if cpu else 16)
    max_resp = args.max_response or (48 if cpu else 4096)
    engine_rows = [int(x) for x in (args.engine_rows or ("8,32" if cpu else "64,256")).split(",")]
    ds_new = args.deepseek_new_tokens or (64 if cpu else 4096)
    ds_mean = args.deepseek_mean or (3000.0 if ds_new == 4096 else 0.73 * ds_new)
    if args.micro_batch_tokens is None:
        args.micro_batch_tokens = 128 if cpu else 16384
    skip = set(filter(None, args.skip.split(",")))
    dtype = torch.float32 if cpu else torch.bfloat16

    from laconic_nemo.bridge import ModelArch, load_hf_state_dict

    arch = ModelArch(**SHAPES[shape])
    dev_name = torch.cuda.get_device_name(0) if not cpu else "cpu"
    peak_meas = matmul_tflops(device)
    copy_tbs = copy_bandwidth_tbs(device)
    if args.bandwidth_tbs:
        tbs, tbs_src = args.bandwidth_tbs, "--bandwidth-tbs"
    elif "H100" in dev_name:
        tbs, tbs_src = H100_HBM_TBS, "H100 data sheet"
    else:
        tbs, tbs_src = copy_tbs, "measured copy"
    print(f"# gpu_step: device {dev_name} | torch {torch.__version__} | shape {shape} "
          f"({params_count(arch) / 1e9:.3f} B params) | {str(dtype).replace('torch.', '')}")
    if peak_meas:
        print(f"# bf16 8192^3 matmul measured: {peak_meas:.0f} TFLOP/s; data-sheet peak {H100_BF16_PEAK / 1e12:.0f}")
    print(f"# memory bandwidth of the bound: {1e3 * tbs:,.0f} GB/s ({tbs_src}); copy measured in this run "
          f"{1e3 * copy_tbs:,.0f} GB/s")
    from laconic_nemo.runtime.kernels import describe_packed_attention

    print(f"# packed attention (sdpa) on a GPU: {describe_packed_attention('sdpa', dtype if not cpu else None)}")

    # the Hugging Face model with random weights, its state dict feeds the megatron actor
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(Qwen2Config(**hf_config(arch)), dtype=dtype,
                                              attn_implementation="sdpa")
    hf.eval()
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(1, arch.vocab_size, (n_prompts, prompt_len), generator=g).tolist()
    eos_id = arch.vocab_size - 1  # a single id of 150k: hit with probability ~1e-5 per token; counted if hit

    rows = []  # (section, variant, measured, throughput, ratio or MFU), printed as they come and as a table

    def add(*row):
        rows.append(row)
        print("  " + " | ".join(row), flush=True)

    hf_tps = None
    if "hf" not in skip and "rollout" not in skip:
        time_hf_generate(hf, [p[:8] for p in prompts[:2]], 4, device)  # warm-up
        dt, ntok = time_hf_generate(hf, prompts, new_tokens, device)
        hf_tps = ntok / dt
        add("rollout", "HF generate (sdpa)", f"{ntok} tok in {dt:.1f} s", f"{hf_tps:,.0f} tok/s", "1.00")
    hf_sd = {k: v.detach().to("cpu", copy=True) for k, v in hf.state_dict().items()}
    hf = None
    free()

    attentions = ["sdpa"] + ([] if "local" in skip else ["local"])
    for attention in attentions:
        actor = build_actor(arch, attention, device, dtype, args)
        load_hf_state_dict(actor.model, hf_sd, arch)
        if hasattr(actor.optimizer, "reload_model_params"):
            actor.optimizer.reload_model_params()
        if "rollout" not in skip and not (attention == "local" and "local-rollout" in skip):
            time_rollout(actor, [p[:8] for p in prompts[:2]], 4, "device", eos_id, device)  # warm-up
            try:
                dt, ntok = time_rollout(actor, prompts, new_tokens, "device", eos_id, device)
                tps = ntok / dt
                ratio = f"{tps / hf_tps:.2f}" if hf_tps else "-"
                add("rollout", f"megatron device sampler, {attention}", f"{ntok} tok in {dt:.1f} s",
                    f"{tps:,.0f} tok/s", ratio)
            except torch.cuda.OutOfMemoryError:
                add("rollout", f"megatron device sampler, {attention}", "OOM", "-", "-")
            if attention == "sdpa":
                n_ex = min(args.exact_tokens, new_tokens)
                dt, ntok = time_rollout(actor, prompts, n_ex, "exact", eos_id, device)
                tps = ntok / dt
                ratio = f"{tps / hf_tps:.2f}" if hf_tps else "-"
                add("rollout", f"megatron host float64 sampler ({n_ex} tok), {attention}",
                    f"{ntok} tok in {dt:.1f} s", f"{tps:,.0f} tok/s", ratio)
            actor.sampler = "device"
        free()
        if attention == "sdpa" and "engine" not in skip:
            engine_section(actor, arch, prompts, prompt_len, new_tokens, engine_rows, eos_id, device, hf_tps, tbs,
                           add, cpu, args.profile)
            actor.generation.engine = None
            free()
        if "train" not in skip:
            batch = train_batch(arch, train_rows, prompt_len, max_resp)
            lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
            flops = train_flops(arch, lengths)
            settings = args.recompute_layers.split(",") if not cpu else ["0"]
            # (packed?, length-sorted?, recompute setting): the packed step first, then today's padded ones
            variants = []
            if attention == "sdpa" and args.micro_batch_tokens > 0:
                packed_settings = args.packed_recompute.split(",") if not cpu else ["auto"]
                variants += [(True, True, st) for st in packed_settings]
            variants += [(False, True, st) for st in (settings if attention == "sdpa" else settings[:1])]
            variants.append((False, False, settings[0]))
            for packed, sort, setting in variants:
                actor.micro_batch_tokens = args.micro_batch_tokens if packed else 0
                actor.sort_by_length = sort
                actor.recompute_setting = recompute_setting(setting, arch.num_layers)
                layout = (f"packed micro-batches of <= {args.micro_batch_tokens} tokens" if packed else
                          f"{'length-sorted' if sort else 'fixed-width'} micro-batches of {args.micro_batch} rows")
                plan_line, peaks = micro_batch_memory(actor, batch, packed, device)
                try:
                    r = time_train(actor, batch, device, args.train_steps)
                except torch.cuda.OutOfMemoryError:
                    add("train", f"GRPO step, {attention}, {layout}, recompute {setting}",
                        f"{train_rows} x <= {prompt_len + max_resp} tok", "OOM", "-")
                    add("memory", f"{attention}, {layout}", plan_line, "-", "-")
                    free()
                    continue
                label = (f"GRPO step, {attention}, {layout}, "
                         f"{recompute_label(actor.recompute_layers, arch.num_layers, actor.recompute_setting)}")
                tps = sum(lengths) / r["s_per_step"]
                mfu = flops / r["s_per_step"] / H100_BF16_PEAK
                extra = f"MFU {100 * mfu:.1f}% (peak 989)"
                if peak_meas:
                    extra += f", {100 * flops / r['s_per_step'] / (peak_meas * 1e12):.1f}% (measured)"
                pad = packed_padding_share(actor, batch) if packed else padding_share(batch, args.micro_batch, sort)
                measured = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] == r["peak_gib"] else "n/a (CPU)"
                add("train", label, f"{r['s_per_step']:.2f} s/step, peak {measured} (predicted "
                    f"{size(peaks[actor.recompute_layers])}), padding {100 * pad:.1f}%",
                    f"{tps:,.0f} tok/s", extra)
                add("memory", f"{attention}, {layout}", plan_line, "-", "-")
                free()
            actor.micro_batch_tokens, actor.recompute_setting = args.micro_batch_tokens, None
        if attention == "sdpa" and "reference" not in skip:
            reference_placements(actor, arch, prompt_len, max_resp, device, add)
        actor = None
        free()

    if "logprob" not in skip:  # the chunked log-prob backward, before / after (benchmarks/logprob_backward.py)
        from logprob_backward import rows as logprob_backward_rows

        logprob_backward_rows(device, dtype, add, repeats=3)
    if "deepseek" not in skip:
        schedule_rows(add)
        deepseek_section("tiny-untied" if cpu else "deepseek-1.5b", args, device, dtype, prompt_len, ds_new,
                         ds_mean, cpu, add)

    print()
    print("| section | variant | measured | throughput | ratio / MFU |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"\n# rollout: {n_prompts} prompts x {prompt_len} tokens, {new_tokens} new tokens (EOS id {eos_id}); "
          f"engine rows {engine_rows} (the prompts repeated); train: {train_rows} rows, prompt {prompt_len}, "
          f"responses {min(300, max_resp // 6)}..{max_resp}, micro-batch {args.micro_batch} rows or packs of <= "
          f"{args.micro_batch_tokens} tokens; bound at {1e3 * tbs:,.0f} GB/s ({tbs_src})")
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
