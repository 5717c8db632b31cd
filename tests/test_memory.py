"""The activation-memory model (laconic_nemo.actors.memory) against what autograd keeps in megatron-core's own
GPTModel (the bridge's Qwen2 layer: RMSNorm, GQA with RoPE, QKV bias, SwiGLU) on a packed sequence, the recompute
setting through megatron's TransformerBlock, the choice of the recompute that fits, and what `plan` prints."""

from __future__ import annotations

import pytest
import torch

from laconic_nemo.actors import memory

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
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
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
    for i in range(arch.num_layers):
        expect = memory.layer_bytes_per_token(shape, tp=1, dtype_bytes=4, kernel=kernel, seq=S, fused_swiglu=fused)
        assert saved[f"layer{i}"] == expect * S
    # outside the layers: embedding indices, final norm, output layer (the logits are kept by the log-prob chunks)
    head = memory.head_bytes_per_token(shape, tp=1, dtype_bytes=4) - 3 * 4 * shape.vocab
    assert saved["other"] == head * S
    # the parameter count the static memory is computed from
    assert memory.params_per_rank(shape, tied=False) == sum(p.numel() for p in model.parameters())


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
    for tokens in (16384, 131072):
        assert main(["plan", qwen3, "--nodes", "4", "--skip-path-checks", f"grpo.micro_batch_tokens={tokens}"]) == 0
        out = capsys.readouterr().out
        (line,) = [x for x in out.splitlines() if x.startswith("train memory")]
        lines[tokens] = line
    assert "packs of 16384 tokens" in lines[16384] and "no recompute" in lines[16384]
    assert "recompute" in lines[131072] and "no recompute" not in lines[131072]
    # the NeMo-Aligner actor (NeMo's own activation checkpointing) gets no such line
    deepseek = str(Path(__file__).resolve().parent.parent / "recipes" / "deepseek_1.5b_b1500.yaml")
    assert main(["plan", deepseek, "--nodes", "2", "--skip-path-checks"]) == 0
    assert "train memory" not in capsys.readouterr().out
