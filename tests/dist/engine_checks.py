"""Decode-engine checks at TP 2, PP 2 and DP 2 (TP 1), run inside tests/dist/actor_checks.py's processes (one
launch per layout for all the actor and engine checks); the assertions are in tests/test_megatron_actor.py.

Reference: today's sampler on the same actor (tests/dist/reference_loop.py ``actor_reference``: the
``InferenceParams`` step through megatron's pipeline schedule, tokens broadcast from TP rank 0 of the last stage).
"""

from __future__ import annotations

import torch

from laconic_nemo.grpo.interfaces import SamplingParams

FIELDS = ("tokens", "prompt_lengths", "response_lengths", "lengths", "truncated")


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in FIELDS)


def _prompts(vocab: int, eos: int, seed: int = 21, n_unique: int = 6, G: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_unique):
        n = int(torch.randint(2, 9, (1,), generator=g))
        p = [int(x) for x in torch.randint(0, vocab, (n,), generator=g)]
        out += [[t if t != eos else eos + 1 for t in p]] * G
    return out


def run_checks(actor, eos: int, res: dict) -> None:
    """Engine vs today's sampler on ``actor`` (both samplers, compaction into small buckets, top-p < 1, a second
    pass), log-probs vs the model's full forward (through the actor's ``logprobs``); TP 2 also builds a
    TransformerEngine-layout model and checks the engine's embedding lookup against megatron's."""
    from reference_loop import actor_reference

    from laconic_nemo.grpo.interfaces import TrainBatch

    V = actor.vocab_size
    prompts = _prompts(V, eos)
    sp = SamplingParams(temperature=2.0, top_p=0.95, max_new_tokens=32, eos_id=eos, seed=17)
    engine = actor.decode_engine()
    s = engine.settings
    saved = (s.batch_buckets, s.kv_block, s.kv_cache_rows, actor.sampler, actor.sync_every, actor.compact_rows)
    s.batch_buckets, s.kv_block = (2, 4, 6, 8, 10, 12), 8
    actor.sync_every, actor.compact_rows = 3, True
    eng: dict = {"fused": engine.fused}  # the fused decode step, its TP collectives / PP hand-offs
    for sampler in ("exact", "device"):
        actor.sampler = sampler
        out = actor.generate(prompts, sp)
        ref = actor_reference(actor, prompts, sp, sampler=sampler, sync_every=3)
        eng[f"{sampler}_equal"] = _same(out, ref)
        eng[f"{sampler}_compactions"] = engine.stats.compactions
        eng[f"{sampler}_eos_and_truncated"] = bool(out.truncated.any() and (~out.truncated).any())
        eng[f"{sampler}_tokens"] = out.tokens
    engine.free()
    s.kv_cache_rows = 5  # a cache of 5 rows: passes of 5 rows, the same tokens (the device sampler's rollout)
    passes = actor.generate(prompts, sp)
    eng["passes"] = engine.stats.passes
    eng["passes_equal"] = _same(passes, out)
    engine.free()
    s.kv_cache_rows = saved[2]
    # log-probs of the engine's forward vs the training forward (actor.logprobs), at the sampling temperature
    actor.sampler = "device"
    out = engine.generate(prompts, sp, stream=actor.dp_rank, pad_id=actor.pad_id, return_logprobs=True)
    n, T = out.tokens.shape
    j = torch.arange(T - 1).unsqueeze(0)
    p, r = out.prompt_lengths.unsqueeze(1), out.response_lengths.unsqueeze(1)
    inside = (j >= p - 1) & (j < p + r - 1)
    batch = TrainBatch(out.tokens, out.prompt_lengths, out.response_lengths, inside.float())
    train_lp = actor.logprobs(batch, temperature=sp.temperature)
    eng["logprob_mismatch"] = float((out.logprobs - train_lp)[inside].abs().max())
    s.batch_buckets, s.kv_block = saved[0], saved[1]
    actor.sampler, actor.sync_every, actor.compact_rows = saved[3], saved[4], saved[5]
    if actor.info.tp_size > 1:
        eng.update(_tp_checks(engine, eos))
    res["engine"] = eng


def _tp_checks(engine, eos: int) -> dict:
    """TP 2: the engine's capture-safe embedding lookup equals megatron's VocabParallelEmbedding; a model of the
    TransformerEngine layout (norms fused into linear_qkv / linear_fc1) generates the same tokens as today's
    sampler and the same log-probs as its own full forward."""
    from engine_models import build_model, full_forward_logprobs, response_positions, tiny_arch
    from reference_loop import model_reference

    from laconic_nemo.rollout.engine import DecodeEngine, EngineSettings

    out: dict = {}
    tok = torch.randint(0, engine.vocab_size, (3, 5), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(5).expand(3, 5)
    with torch.no_grad():
        mine = engine.stage.embed(tok, pos)
        theirs = engine.model.embedding(input_ids=tok, position_ids=pos)
    out["embedding_equal"] = torch.equal(mine, theirs)
    arch = tiny_arch()
    model = build_model(arch, "te", seed=3)
    prompts = _prompts(arch.vocab_size, eos, seed=4)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=20, eos_id=eos, seed=5)
    te_engine = DecodeEngine(model, arch.vocab_size, EngineSettings(sampler="exact", sync_every=3,
                                                                    batch_buckets=(2, 4, 8), kv_block=8))
    got = te_engine.generate(prompts, sp, return_logprobs=True)
    ref = model_reference(model, arch.vocab_size, prompts, sp, sampler="exact", sync_every=3)
    out["te_equal"] = _same(got, ref)
    out["te_fused"] = te_engine.fused
    inside = response_positions(got)
    full = full_forward_logprobs(model, arch.vocab_size, got.tokens)
    out["te_logprob_err"] = float((got.logprobs - full)[inside].abs().max())
    out["te_has_fused_norm"] = hasattr(model.decoder.layers[0].self_attention.linear_qkv, "layer_norm_weight")
    return out
