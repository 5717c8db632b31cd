"""The rollout sections of ``gpu_step.py``: Hugging Face ``generate``, the megatron loop before the decode engine,
the decode engine at its row counts (with ``--profile``, its kernels per step beside the plain step of
``plain_decode.py``), the window schedule of the paper's draw and the DeepSeek-shaped rollout with the projected
500-step run (``gpu_step.py``'s docstring says what each measures)."""

from __future__ import annotations

import time

import torch
from gpu_common import (
    PAPER_GPUS,
    PAPER_OPT_STEPS,
    PAPER_ROWS_PER_GPU,
    PAPER_STEPS,
    SHAPES,
    bound_tok_s,
    build_actor,
    free,
    gb,
    params_count,
    sync,
)
from gpu_train import time_train


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


def time_hf_generate(hf, prompts, new_tokens, device) -> tuple[float, int]:
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    sync(device)
    t = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    sync(device)
    return time.perf_counter() - t, int((out.shape[1] - ids.shape[1]) * ids.shape[0])


def engine_section(actor, arch, prompts, prompt_len, new_tokens, engine_rows, eos_id, device, hf_tps, tbs, add,
                   cpu: bool, profile: bool) -> None:
    """The decode engine at each of ``engine_rows`` (the prompts repeated, as GRPO's groups), its share of the
    bandwidth bound, and the rollout / training log-prob mismatch on the first row count's rollout."""
    from laconic_nemo.grpo.interfaces import TrainBatch, response_mask
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
            inside = response_mask(out.prompt_lengths, out.response_lengths, out.tokens.shape[1])
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
    from laconic_nemo.grpo.interfaces import TrainBatch, response_mask
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
    mask = response_mask(out.prompt_lengths, out.response_lengths, T)
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
