"""The activation-memory model (laconic_nemo.actors.memory) against what autograd keeps in megatron-core's own
GPTModel (the bridge's Qwen2 layer: RMSNorm, GQA with RoPE, QKV bias, SwiGLU) on a packed sequence, the recompute
setting through megatron's TransformerBlock, the choice of the recompute that fits, and what `plan` prints."""

from __future__ import annotations

import pytest
import torch

from laconic_nemo.actors import memory
from laconic_nemo.runtime import megatron_compat as compat

ARCH = dict(model_type="qwen2", hidden_size=96, num_layers=3, num_attention_heads=6, num_kv_heads=2, head_dim=16,
            ffn_hidden_size=160, vocab_size=300, max_position_embeddings=512, rope_theta=1e4, rms_norm_eps=1e-6,
            tie_word_embeddings=False, qkv_bias=True, qk_norm=False)


@pytest.fixture(scope="module")
def mp_state():
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    init_distributed(1, 1, backend="gloo", seed=0)
    yield
    destroy_distributed()


def _shape(arch, vocab: int) -> memory.LayerShape:
    return memory.LayerShape(hidden=arch.hidden_size, heads=arch.num_attention_heads, groups=arch.num_kv_heads,
                             head_dim=arch.head_dim, ffn=arch.ffn_hidden_size, layers=arch.num_layers, vocab=vocab)


def _saved_bytes(model, lengths: list[int]) -> dict[str, int]:
    """Bytes of the distinct storages autograd keeps during one training forward of a packed sequence of rows of
    ``lengths`` tokens, by the transformer layer that saved them ("other": embedding, final norm, output layer,
    the recompute checkpoints of the block); parameters excluded."""
    from laconic_nemo.runtime.kernels import packed_seq_params

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, str]] = {}
    where = ["other"]

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.data_ptr() not in seen:
            seen[st.data_ptr()] = (st.nbytes(), where[0])
        return t

    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, f"layer{i}"))
        layer.register_forward_hook(lambda m, a, o: where.__setitem__(0, "other"))
    S = sum(lengths)
    tok = torch.randint(0, 300, (1, S), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(lengths), 0).tolist())
    model.train()
    # megatron's fused SwiGLU is torch.compile'd (megatron/core/jit.py); its autograd.Function saves the same tensors
    # eager, so it runs eager here: compiling it on CPU in a process that had run the earlier test files aborted
    # the interpreter (megatron-core 0.16.1, torch 2.13.0, in fused_bias_swiglu.py:234)
    with torch.compiler.set_stance("force_eager"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tok, pos, None, packed_seq_params=packed_seq_params(cu, max(lengths)))
    out: dict[str, int] = {}
    for nbytes, w in seen.values():
        out[w] = out.get(w, 0) + nbytes
    return out


@pytest.fixture(scope="module")
def models(mp_state):
    from laconic_nemo.bridge import ModelArch
    from laconic_nemo.bridge.megatron import build_gpt_model, transformer_config

    arch = ModelArch(**ARCH)
    out = {}
    for attention, fused in (("local", False), ("sdpa", False), ("sdpa", True)):
        torch.manual_seed(0)
        # bias_activation_fusion: megatron's fused SwiGLU (torch.jit, runs on CPU too), on by default on GPU
        cfg = transformer_config(arch, 1, 1, cpu=True, bias_activation_fusion=fused)
        out[(attention, fused)] = build_gpt_model(arch, cfg, attention=attention)
    return arch, out


@pytest.mark.parametrize("attention,kernel,fused", [("sdpa", "dense", False), ("local", "local", False),
                                                    ("sdpa", "dense", True)])
@pytest.mark.parametrize("lengths", [[40, 30, 26], [100, 92]])
def test_layer_formula_is_what_autograd_keeps(models, attention, kernel, fused, lengths):
    arch, built = models
    model = built[(attention, fused)]
    shape = _shape(arch, model.vocab_size)
    saved = _saved_bytes(model, lengths)
    S = sum(lengths)
    # the unfused gated MLP keeps x_linear + glu_linear_offset too on megatron-core 0.16.1 and 0.19.2 (mlp.py:219-226,
    # :324-331), not on 0.11.0 (mlp.py:119-121): the adapter reads which from the model's config
    offset_sum = compat.glu_keeps_offset_sum(model.config)
    assert offset_sum == (compat.installed_release() != "0.11.0")
    for i in range(arch.num_layers):
        expect = memory.layer_bytes_per_token(shape, tp=1, dtype_bytes=4, kernel=kernel, seq=S, fused_swiglu=fused,
                                              glu_offset_sum=offset_sum)
        assert saved[f"layer{i}"] == expect * S
    # outside the layers: embedding indices, final norm, output layer (the logits are kept by the log-prob chunks)
    head = memory.head_bytes_per_token(shape, tp=1, dtype_bytes=4) - 2 * 4 * shape.vocab
    assert saved["other"] == head * S
    # the parameter count the static memory is computed from
    assert memory.params_per_rank(shape, tied=False) == sum(p.numel() for p in model.parameters())


def test_two_logit_sized_tensors_live_at_once_as_the_head_term_counts(mp_state):
    """A training forward and backward of megatron-core's GPTModel (CPU, fp32, 2 rows of 96 positions, a vocabulary
    of 4,096: nothing else is the logits' size) through the chunked log-probs (chunks of 8 positions): at most two
    tensors of the logits' size are alive at once (the host allocator's events, traced from before the forward), as
    many as the head term counts per token (``2 d V / t``). A slice of the logits per chunk made it three: the
    logits, their gradient and a zero-filled gradient per chunk."""
    import dataclasses

    from laconic_nemo.actors.megatron_logprobs import chunked_token_logprobs
    from laconic_nemo.bridge import ModelArch
    from laconic_nemo.bridge.megatron import build_gpt_model, transformer_config
    from laconic_nemo.runtime.host_memory import host_allocations

    arch = ModelArch(**{**ARCH, "hidden_size": 32, "num_attention_heads": 4, "head_dim": 8, "ffn_hidden_size": 64,
                        "vocab_size": 4096})
    torch.manual_seed(0)
    model = build_gpt_model(arch, transformer_config(arch, 1, 1, cpu=True), attention="sdpa").train()
    b, s = 2, 96
    tokens = torch.randint(0, arch.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    with host_allocations() as trace:
        logits = model(tokens, torch.arange(s).expand(b, s), None)
        full, vocab = logits.nbytes, logits.shape[-1]
        logp = chunked_token_logprobs(logits, torch.roll(tokens, -1, 1), 8, vocab, 0)
        del logits
        logp.sum().backward()
    live = most = 0
    for change in trace.changes:
        if abs(change) == full:
            live += 1 if change > 0 else -1
            most = max(most, live)
    shape = _shape(arch, vocab)
    per_token = memory.head_bytes_per_token(shape, 1, 4) - memory.head_bytes_per_token(
        dataclasses.replace(shape, vocab=0), 1, 4)
    assert most == per_token / (4 * vocab) == 2

@pytest.mark.parametrize("layers", [1, 3])
def test_recomputed_layers_keep_only_their_input(models, layers):
    """megatron's full recompute (set as the actor sets it) of the first ``layers`` layers: each keeps d h per token,
    and nothing else (a packed micro-batch's RoPE angles ride on packed_seq_params to the core attention, not
    through the block's checkpoint: runtime/kernels.py rotate_packed_rows)."""
    from laconic_nemo.actors.megatron_step import set_recompute

    arch, built = models
    model = built[("sdpa", False)]
    shape, lengths = _shape(arch, model.vocab_size), [40, 30, 26]
    S = sum(lengths)
    plain = _saved_bytes(model, lengths)
    assert set_recompute(model.config, layers, arch.num_layers) == layers
    try:
        saved = _saved_bytes(model, lengths)
    finally:
        set_recompute(model.config, 0, arch.num_layers)
    for i in range(arch.num_layers):
        assert saved.get(f"layer{i}", 0) == (0 if i < layers else plain[f"layer{i}"])
    kept = memory.recomputed_layer_bytes_per_token(shape, dtype_bytes=4) * S * layers
    assert saved["other"] == plain["other"] + kept
    assert model.config.recompute_granularity is None  # set back


QWEN_1_5B = memory.LayerShape(hidden=1536, heads=12, groups=2, head_dim=128, ffn=8960, layers=28, vocab=151936)


def test_recompute_choice_is_the_fewest_layers_that_fit():
    """A device just large enough for the peak with n layers recomputed picks exactly n; a little smaller, more."""
    shape, tokens = QWEN_1_5B, 16384
    assert memory.plan_memory(shape, tokens, 1e6).recompute_layers == 0
    nothing = memory.plan_memory(shape, tokens, 1.0)
    assert nothing.recompute_layers is None and "lower grpo.micro_batch_tokens" in nothing.describe()
    peaks = [_peak_with(shape, tokens, n) for n in range(shape.layers + 1)]
    assert all(a > b for a, b in zip(peaks[1:], peaks[2:]))  # each recomputed layer lowers the peak
    for n in (0, 5, 17, 28):
        device = peaks[n] / memory.USABLE_FRACTION / memory.GIB * (1 + 1e-9)
        assert memory.plan_memory(shape, tokens, device).recompute_layers == n
        smaller = memory.plan_memory(shape, tokens, device * 0.999).recompute_layers
        assert smaller is None if n == shape.layers else smaller > n


def _peak_with(shape, tokens, n, dtype_bytes=2) -> float:
    """Peak bytes with n of the layers recomputed at PP 1, written out from the module docstring's terms."""
    layer = memory.layer_bytes_per_token(shape, 1, dtype_bytes, "flash", tokens, fused_swiglu=True) * tokens
    kept = dtype_bytes * shape.hidden * tokens
    acts = (shape.layers - n) * layer + n * kept + (layer if n else 0)
    head = memory.head_bytes_per_token(shape, 1, dtype_bytes) * tokens + 12 * 1024 * shape.vocab
    return memory.static_bytes(memory.params_per_rank(shape), dtype_bytes) + acts + head


def test_plan_prints_the_training_memory_of_the_megatron_core_actor(capsys):
    from pathlib import Path

    from laconic_nemo.cli import main

    qwen3 = str(Path(__file__).resolve().parent.parent / "recipes" / "qwen3_8b_b1000.yaml")
    lines = {}
    for tokens in (8192, 65536):
        assert main(["plan", qwen3, "--nodes", "4", "--skip-path-checks", f"grpo.micro_batch_tokens={tokens}"]) == 0
        out = capsys.readouterr().out
        (line,) = [x for x in out.splitlines() if x.startswith("train memory")]
        lines[tokens] = line
    assert "packs of 8192 tokens" in lines[8192] and "no recompute" in lines[8192]
    assert "recompute" in lines[65536] and "no recompute" not in lines[65536]
    assert "decode engine 11.4 GiB resident" in lines[8192]  # its KV cache (11.25 GiB) counts in the peak
    # packs that cannot fit even with every layer recomputed: refused before launch, naming the key
    assert main(["plan", qwen3, "--nodes", "4", "--skip-path-checks", "grpo.micro_batch_tokens=131072"]) == 2
    err = capsys.readouterr().err
    assert "does not fit even with every layer recomputed" in err and "lower grpo.micro_batch_tokens" in err


ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
DEEPSEEK = str(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml")
# DeepSeek-R1-Distill-Qwen-1.5B (config.json): untied output layer, qkv bias
DS_PARAMS = memory.params_per_rank(QWEN_1_5B, tied=False)


def _nemo_peak_with(n: int, rows: int = 4, width: int = 5120, dp: int = 16, micro_batches: int = 3,
                    engine: float = 0.0) -> float:
    """The NeMo-Aligner actor's peak with n layers recomputed, written out from the module docstring's terms:
    bf16 weights, a float32 gradient buffer, 16 / DP bytes of sharded state; the layers at the rows x width tokens
    of a micro-batch; two 16-bit logit-sized tensors (2 x 2 V bytes a token: the logits and their gradient, then the
    gradient and its transposed copy; no
    float32 copy of them); one log-prob chunk of 1024 // rows positions x rows; the resident engine."""
    shape, tokens = QWEN_1_5B, rows * width
    static = DS_PARAMS * (2 + 4 + 16 / dp)
    layer = memory.layer_bytes_per_token(shape, 1, 2, "flash", width, fused_swiglu=True) * tokens
    acts = (shape.layers - n) * layer + n * 2 * shape.hidden * tokens + (layer if n else 0)
    logits = (8 + 2 * (3 * shape.hidden + 1) + 2 * 2 * shape.vocab) * tokens
    chunk = 12 * (1024 // rows) * rows * shape.vocab
    return static + engine + acts + logits + chunk


def test_nemo_actor_peak_hand_worked():
    """The NeMo-Aligner actor's terms for the flagship shape (4 rows x 5120 tokens, DP 16, the decode engine's 48-row
    cache resident), against the peak written out term by term; the engine's memory: cache + Slots buffers + graph
    pool by hand."""
    kv = 2 * 28 * 48 * 5120 * 2 * 128 * 2
    eng = memory.engine_bytes(kv, 48, 5120, QWEN_1_5B.vocab, QWEN_1_5B.hidden)
    assert eng.buffers == 4 * 48 * QWEN_1_5B.vocab + 2 * 2 * 48 * 1536 + 12 * 49 * 5121
    assert eng.graph_pool == 32 * 48 * QWEN_1_5B.vocab and eng.total == kv + eng.buffers + eng.graph_pool
    mp = memory.nemo_actor_plan(QWEN_1_5B, 4, 5120, memory.H100_GIB, dp=16, params=DS_PARAMS, num_micro_batches=3,
                                resident_bytes=eng.total)
    for n in (0, 9, 28):
        assert mp.peaks_gib[n] * memory.GIB == pytest.approx(_nemo_peak_with(n, engine=eng.total), rel=1e-12)
    n = mp.recompute_layers
    assert n is not None and mp.peaks_gib[n] <= mp.budget_gib < mp.peaks_gib[n - 1]
    # NeMo-Aligner's own loss (from_parallel_logits_to_logprobs on the float32 logits of megatron's Float16Module):
    # logits 4 V a token, its float32 log-softmax and clone 8 V, the one-hot and softmax gradient of its backward:
    # above the device before any layer is counted
    old_head = (4 + 8 + 8 + 4) * QWEN_1_5B.vocab * 4 * 5120
    assert (old_head + DS_PARAMS * 7 + eng.total) / memory.GIB > mp.budget_gib


def test_plan_prints_the_nemo_actors_training_memory_and_the_flagships_fit(capsys):
    """`plan` prints the NeMo-Aligner actor's memory line (rows x width, the terms, the recompute that fits) and the
    flagship recipes fit an 80 GB H100 by it, with the decode engine resident."""
    from laconic_nemo.cli import main

    for recipe in ("deepseek_1.5b_b1500", "deepscaler_1.5b_b2000"):
        assert main(["plan", str(ROOT / "recipes" / f"{recipe}.yaml"), "--nodes", "2", "--skip-path-checks"]) == 0
        out = capsys.readouterr().out
        (i, line), = [(i, x) for i, x in enumerate(out.splitlines()) if x.startswith("train memory")]
        terms = out.splitlines()[i + 1]
        assert "NeMo-Aligner actor, 4 rows x 5120 tokens" in line and "does not fit" not in line
        assert "layers per stage (peak" in line or "no recompute" in line
        for term in ("logits + gradients", "log-prob chunk", "layers", "weights + grads + optimiser", "engine"):
            assert term in terms
    from laconic_nemo.config import load_config
    from laconic_nemo.plan.layout import plan_layout

    p = plan_layout(load_config(DEEPSEEK), 2, 8, check_paths=False)
    assert "recompute 5/28 layers per stage" in p.training_memory and "decode engine 6.8 GiB resident" in p.training_memory


@pytest.mark.parametrize("overrides,named", [
    # 12 rows x 7168 tokens: 49 GiB of logits and their gradient alone
    (["grpo.micro_batch_size=12", "rollout.max_new_tokens=6144"], "grpo.micro_batch_size"),
    (["rollout.kv_cache_memory_fraction=0.6"], "rollout.kv_cache_memory_fraction"),
])
def test_a_nemo_recipe_that_cannot_fit_is_refused_before_launch(capsys, overrides, named):
    """A setting that cannot fit one GPU is refused by `plan` (the launch's first step, exit 2) before anything is
    allocated, naming the keys to change: the training step's peak even with every layer recomputed, or a KV-cache
    share that leaves the training step too little (the engine may grow its cache up to that share)."""
    from laconic_nemo.cli import main

    assert main(["plan", DEEPSEEK, "--nodes", "2", "--skip-path-checks", *overrides]) == 2
    err = capsys.readouterr().err
    assert named in err
    if named == "grpo.micro_batch_size":
        assert "does not fit even with every layer recomputed" in err and "rollout.engine_memory = release" in err
    else:
        assert "at most 0.55" in err and "the training step with every layer recomputed" in err
    # off the cluster (`train` on this machine), the line is printed, not enforced against an H100
    from laconic_nemo.config import load_config
    from laconic_nemo.plan.layout import plan_layout

    plan_layout(load_config(DEEPSEEK, overrides), 2, 8, check_paths=False, cluster=False)


# ---------------------------------------------------------------------------------------------- log-prob chunks
def _planned_chunk_tokens(mp: memory.MemoryPlan, vocab: int, tp: int = 1) -> float:
    """The tokens of the log-prob chunk a plan counts (its float32 workspace: 12 bytes x chunk x V / tp)."""
    return mp.logprob_gib * memory.GIB / (12 * vocab / tp)


@pytest.mark.parametrize("budget", [0, 64])
def test_the_memory_prediction_counts_the_logprob_chunk_the_actor_computes(mp_state, monkeypatch, budget):
    """The megatron-core actor's training step on CPU (padded micro-batches of 3 rows with micro_batch_tokens = 0;
    packs of <= 64 tokens) with log-prob chunks of 5 positions: the largest chunk its loss computes (rows x positions
    of the logits each chunk's log-softmax is taken over) is the chunk its memory prediction counts. A padded
    micro-batch's chunk is 5 positions of each of its 3 rows, 15 tokens; a pack's 5 of its one row."""
    from laconic_nemo.actors import megatron_logprobs
    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.bridge import ModelArch
    from laconic_nemo.bridge.megatron import actor_kwargs
    from laconic_nemo.grpo.interfaces import TrainBatch
    from laconic_nemo.grpo.loss import make_grpo_loss_fn
    from laconic_nemo.runtime.megatron_env import parallel_info

    torch.manual_seed(0)
    kw = actor_kwargs(ModelArch(**ARCH), 1, 1, cpu=True, dtype=torch.float32, attention="sdpa")
    actor = MegatronCoreActor(parallel_info(1, 1), **kw, lr=1e-3, micro_batch_size=3, kl_beta=0.0,
                              micro_batch_tokens=budget, logprob_chunk_size=5)
    chunks, real = [], megatron_logprobs._chunk_logprobs

    def recorded(logits, *args):
        chunks.append((logits.shape[0] * logits.shape[1], logits.shape[-1]))
        return real(logits, *args)

    monkeypatch.setattr(megatron_logprobs, "_chunk_logprobs", recorded)
    g = torch.Generator().manual_seed(1)
    n, T = 6, 20
    prompt, resp = torch.full((n,), 3), torch.randint(10, T - 3 + 1, (n,), generator=g)
    mask = torch.zeros(n, T - 1)
    for i in range(n):
        mask[i, 2 : 2 + int(resp[i])] = 1.0
    batch = TrainBatch(torch.randint(0, ARCH["vocab_size"], (n, T), generator=g), prompt, resp, mask,
                       advantages=torch.randn(n, generator=g), old_logprobs=-3.0 * mask)
    actor.train_step(batch, make_grpo_loss_fn(0.2, 0.28, 0.0, "token_mean", float(mask.sum()), float(n)))
    assert actor.memory_prediction() is not None
    computed = max(c for c, _ in chunks)
    assert computed == (15 if budget == 0 else 5)
    assert _planned_chunk_tokens(actor.stepper.memory_plan, chunks[0][1]) == pytest.approx(computed, rel=1e-12)


@pytest.mark.parametrize("overrides, rows", [(["grpo.micro_batch_tokens=0", "grpo.micro_batch_size=4"], 4),
                                             (["grpo.micro_batch_tokens=256"], 1)])
def test_plan_counts_a_padded_micro_batchs_logprob_chunk_over_all_its_rows(overrides, rows):
    """`plan`'s training memory (the megatron-core actor) with log-prob chunks of 8 positions: 8 positions of each
    of the 4 rows of a padded micro-batch (32 tokens), of the one row of a pack (8 tokens)."""
    from laconic_nemo.config import load_config
    from laconic_nemo.plan.layout import layer_shape, training_memory

    cfg = load_config(ROOT / "recipes" / "tiny_cpu.yaml", [*overrides, "grpo.logprob_chunk_size=8"])
    mp, _ = training_memory(cfg, None, 1, 1, 1, 1)
    assert _planned_chunk_tokens(mp, layer_shape(cfg, None, 1).vocab) == pytest.approx(8 * rows, rel=1e-12)


# ---------------------------------------------------------------------------------------------- precision, prediction
def test_plan_counts_fp16_as_two_bytes_for_training_as_for_the_cache():
    """model.precision = fp16 (NeMo's precision 16 with megatron_amp_O2: 16-bit weights, activations and logits,
    the NeMo-Aligner actor's ``weight.element_size()`` = 2) plans the training memory and the decode engine's cache
    of bf16; fp32 counts 4 bytes in both."""
    from laconic_nemo.config import load_config
    from laconic_nemo.plan.layout import plan_layout

    plans = {p: plan_layout(load_config(DEEPSEEK, [f"model.precision={p}"]), 2, 8, check_paths=False, cluster=False)
             for p in ("bf16", "fp16", "fp32")}
    assert plans["fp16"].training_memory == plans["bf16"].training_memory
    assert plans["fp16"].kv_cache_bytes == plans["bf16"].kv_cache_bytes == plans["fp32"].kv_cache_bytes / 2
    assert plans["fp32"].training_memory != plans["bf16"].training_memory
    assert [memory.precision_bytes(p) for p in ("fp32", "bf16", "fp16")] == [4, 2, 2]
    with pytest.raises(ValueError, match="model.precision = 'fp8' is invalid"):
        memory.precision_bytes("fp8")


def test_both_actors_predict_the_out_of_memory_line_by_one_function(monkeypatch):
    """The prediction the out-of-memory line quotes, of the megatron-core actor's training part and of the
    NeMo-Aligner actor, comes from ``memory.memory_prediction``: off a GPU with a fixed recompute setting, the plan
    of the last step's shape for the host's memory (described and broken down); nothing before the first step."""
    from laconic_nemo.actors.megatron_step import TrainStep
    from laconic_nemo.actors.nemo_aligner import NemoAlignerActor
    from laconic_nemo.rollout.kv_cache import device_memory_bytes

    calls = []
    real = memory.memory_prediction

    def spy(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(memory, "memory_prediction", spy)
    host = device_memory_bytes(torch.device("cpu")) / memory.GIB
    megatron = object.__new__(TrainStep)
    megatron.memory_plan, megatron.last_shape, megatron.device = None, None, torch.device("cpu")
    megatron.plan_memory = lambda tokens, seq, mbs, device_gib: memory.plan_memory(
        QWEN_1_5B, tokens, device_gib, seq=seq, num_micro_batches=mbs)
    nemo = object.__new__(NemoAlignerActor)
    nemo.memory_plan, nemo._last_shape = None, None
    nemo.plan_memory = lambda rows, width, mbs, device_gib: memory.nemo_actor_plan(
        QWEN_1_5B, rows, width, device_gib, dp=16, num_micro_batches=mbs)
    assert megatron.memory_prediction() is None and nemo.memory_prediction() is None  # before the first step
    megatron.last_shape, nemo._last_shape = (16384, 4096, 1), (4, 5120, 3)
    expected = {"megatron": memory.plan_memory(QWEN_1_5B, 16384, host, seq=4096, num_micro_batches=1),
                "nemo": memory.nemo_actor_plan(QWEN_1_5B, 4, 5120, host, dp=16, num_micro_batches=3)}
    for name, actor in (("megatron", megatron), ("nemo", nemo)):
        plan = expected[name]
        assert actor.memory_prediction() == f"{plan.describe()}; {plan.breakdown()}"
        assert actor.memory_plan == plan
    assert calls == [None, None, (16384, 4096, 1), (4, 5120, 3)]
