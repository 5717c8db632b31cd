"""Bridge HF <-> megatron-core GPTModel, single process (TP=1, PP=1) and pure layout functions."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from bridge_common import BASE, hf_checkpoint_tensors, megatron_logits, tiny_hf_model  # noqa: E402

from laconic_nemo.bridge import (  # noqa: E402
    LazySafetensors,
    ModelArch,
    actor_kwargs,
    arch_from_hf_config,
    export_hf_state_dict,
    hf_names,
    hf_shapes,
    load_hf_state_dict,
    load_safetensors_dir,
    model_provider,
    padded_vocab_size,
    save_hf_checkpoint,
    save_safetensors_dir,
)
from laconic_nemo.bridge.mapping import fuse_fc1, fuse_qkv, shard, split_fc1, split_qkv  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dist1():
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    info = init_distributed(1, 1, seed=0)
    yield info
    destroy_distributed()


# ---------------------------------------------------------------------------------------------- arch


def test_arch_from_transformers_configs():
    cfg, _ = tiny_hf_model("qwen2")
    a = arch_from_hf_config(cfg)
    assert (a.model_type, a.qkv_bias, a.qk_norm, a.head_dim, a.num_kv_heads, a.heads_per_group) == \
        ("qwen2", True, False, 16, 2, 2)
    cfg, _ = tiny_hf_model("qwen3")
    a = arch_from_hf_config(cfg)
    assert (a.qkv_bias, a.qk_norm, a.head_dim) == (False, True, 24)
    cfg, _ = tiny_hf_model("qwen2_tied")
    assert arch_from_hf_config(cfg).tie_word_embeddings


def test_arch_from_hub_style_json(tmp_path):
    # config.json as published for DeepSeek-R1-Distill-Qwen-1.5B (classic top-level rope_theta)
    cfg = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
           "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936, "rope_theta": 10000,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 131072,
           "hidden_act": "silu", "use_sliding_window": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    a = arch_from_hf_config(str(tmp_path))
    assert (a.hidden_size, a.num_layers, a.head_dim, a.heads_per_group, a.rope_theta) == (1536, 28, 128, 6, 10000.0)
    # Llama 3.1 style rope scaling
    llama = dict(cfg, model_type="llama", rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert arch_from_hf_config(llama).rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("bad, match", [
    ({"model_type": "gpt2"}, "not supported"),
    ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "sliding"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
])
def test_arch_rejects_unsupported(bad, match):
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=100)
    cfg.update(bad)
    with pytest.raises(NotImplementedError, match=match):
        arch_from_hf_config(cfg)


def test_padded_vocab_size():
    assert padded_vocab_size(151936, 1) == 151936  # already a multiple of 128
    assert padded_vocab_size(151936, 2) == 152064  # next multiple of 256
    assert padded_vocab_size(100, 2) == 256
    with pytest.raises(ValueError):
        padded_vocab_size(100, 0)


# ---------------------------------------------------------------------------------------------- layouts


def _arch(heads=6, kv=2, d=3):
    return ModelArch("llama", hidden_size=heads * d, num_layers=1, num_attention_heads=heads, num_kv_heads=kv,
                     head_dim=d, ffn_hidden_size=8, vocab_size=10, max_position_embeddings=16, rope_theta=1e4,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False, qk_norm=False)


def test_fused_qkv_is_per_group_interleaved():
    arch = _arch(heads=6, kv=2, d=3)  # 3 query heads per group
    # label every row by (tensor, head): q rows 100+head, k rows 200+head, v rows 300+head
    q = torch.tensor([100 + h for h in range(6) for _ in range(3)], dtype=torch.float32)
    k = torch.tensor([200 + h for h in range(2) for _ in range(3)], dtype=torch.float32)
    v = torch.tensor([300 + h for h in range(2) for _ in range(3)], dtype=torch.float32)
    fused = fuse_qkv(q, k, v, arch)
    heads_in_order = fused.reshape(-1, 3)[:, 0].tolist()
    assert heads_in_order == [100, 101, 102, 200, 300, 103, 104, 105, 201, 301]
    # TP=2 gives each rank one whole group
    assert shard(fused, "qkv", 2, 1).reshape(-1, 3)[:, 0].tolist() == [103, 104, 105, 201, 301]
    w = torch.randn(6 * 3, 5), torch.randn(2 * 3, 5), torch.randn(2 * 3, 5)
    for a, b in zip(split_qkv(fuse_qkv(*w, arch), arch), w):
        assert torch.equal(a, b)


def test_fc1_shards_are_gate_then_up():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    full = fuse_fc1(gate, up, tp=2)
    assert torch.equal(shard(full, "fc1", 2, 0), torch.cat([gate[:4], up[:4]]))
    assert torch.equal(shard(full, "fc1", 2, 1), torch.cat([gate[4:], up[4:]]))
    g2, u2 = split_fc1(full, 2)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    # tp=1 is the plain [gate; up]
    assert torch.equal(fuse_fc1(gate, up, 1), torch.cat([gate, up]))


@pytest.mark.parametrize("family", ["qwen2", "qwen2_tied", "qwen3", "llama"])
def test_hf_names_and_shapes_match_transformers(family):
    cfg, model = tiny_hf_model(family)
    arch = arch_from_hf_config(cfg)
    ref = hf_checkpoint_tensors(model, arch.tie_word_embeddings)
    assert sorted(hf_names(arch)) == sorted(ref)
    assert hf_shapes(arch) == {k: tuple(v.shape) for k, v in ref.items()}


# ---------------------------------------------------------------------------------------------- model


@pytest.mark.parametrize("family", ["qwen2", "qwen2_tied", "qwen3", "llama"])
def test_logits_match_transformers_and_round_trip(dist1, family):
    cfg, hf = tiny_hf_model(family)
    arch = arch_from_hf_config(cfg)
    model = model_provider(arch, cpu=True)(True, True).eval()
    used = load_hf_state_dict([model], hf.state_dict(), arch)
    assert sorted(used) == sorted(hf_names(arch))
    ids = torch.randint(0, arch.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    out = megatron_logits(model, ids)
    assert out.shape == (2, 12, padded_vocab_size(arch.vocab_size, 1))
    torch.testing.assert_close(out[..., : arch.vocab_size], ref, atol=2e-5, rtol=1e-5)
    # the padded vocabulary rows are zero, so their logits are exactly 0
    assert torch.count_nonzero(out[..., arch.vocab_size:]) == 0
    # export -> HF tensors bit-exact, then import of the export -> same parameters bit-exact
    exported = export_hf_state_dict([model], arch)
    ref_sd = hf_checkpoint_tensors(hf, arch.tie_word_embeddings)
    assert sorted(exported) == sorted(ref_sd)
    for k, v in ref_sd.items():
        assert torch.equal(exported[k], v), k
    model2 = model_provider(arch, cpu=True)(True, True)
    load_hf_state_dict([model2], exported, arch)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), model2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_llama3_rope_scaling_matches_transformers(dist1):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg, hf = tiny_hf_model("llama", rope_parameters={**scaling, "rope_theta": 500000.0},
                            max_position_embeddings=16384)
    arch = arch_from_hf_config(cfg)
    assert arch.rope_scaling is not None and arch.rope_theta == 500000.0
    model = model_provider(arch, cpu=True)(True, True).eval()
    load_hf_state_dict([model], hf.state_dict(), arch)
    ids = torch.randint(0, arch.vocab_size, (1, 400), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(megatron_logits(model, ids)[..., : arch.vocab_size], ref, atol=2e-5, rtol=1e-5)


def test_load_reports_missing_tensor(dist1):
    cfg, hf = tiny_hf_model("qwen3")
    arch = arch_from_hf_config(cfg)
    model = model_provider(arch, cpu=True)(True, True)
    sd = dict(hf.state_dict())
    del sd["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match="k_norm"):
        load_hf_state_dict([model], sd, arch)


def test_safetensors_dir_round_trip_and_transformers_reload(dist1, tmp_path):
    import transformers

    cfg, hf = tiny_hf_model("qwen2")
    arch = arch_from_hf_config(cfg)
    model = model_provider(arch, cpu=True)(True, True).eval()
    load_hf_state_dict([model], hf.state_dict(), arch)
    # sharded write (tiny shard limit) through the bridge, lazy read back
    out = tmp_path / "ckpt"
    save_hf_checkpoint([model], arch, str(out), config=cfg.to_dict())
    state = export_hf_state_dict([model], arch)
    files = save_safetensors_dir(str(tmp_path / "sharded"), state, config=cfg.to_dict(), max_shard_bytes=40_000)
    assert len(files) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    lazy = LazySafetensors(str(tmp_path / "sharded"))
    assert sorted(lazy) == sorted(state)
    for k in state:
        assert torch.equal(lazy[k], state[k])
    assert all(torch.equal(v, state[k]) for k, v in load_safetensors_dir(str(out)).items())
    # transformers loads the exported directory and computes the same logits
    hf2 = transformers.Qwen2ForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, arch.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(hf2(input_ids=ids).logits, hf(input_ids=ids).logits)
    assert BASE["vocab_size"] == arch.vocab_size


def test_actor_kwargs_share_one_config(dist1):
    cfg, hf = tiny_hf_model("qwen3")
    arch = arch_from_hf_config(cfg)
    kw = actor_kwargs(arch, tp=1, pp=1, cpu=True)
    model = kw["model_provider"](True, True)
    assert model.config is kw["transformer_config"]  # settings the actor puts on the config reach the model
    assert (kw["vocab_size"], kw["padded_vocab_size"]) == (100, 128)
    assert model.embedding.word_embeddings.weight.shape[0] == kw["padded_vocab_size"]


def test_synthetic_gpt_takes_the_shape_of_a_config_json(dist1, tmp_path):
    """model.shape_from: the synthetic GPT with the architecture and vocabulary of a Hugging Face config.json (the
    bridge's layer, megatron's random initialisation, nothing loaded); a vocabulary smaller than the synthetic
    task's ids is refused naming the key. The one-GPU check's shape is gpu_step's DeepSeek-R1-Distill-Qwen-1.5B."""
    import sys
    from pathlib import Path

    from laconic_nemo.actors.megatron_build import model_parts
    from laconic_nemo.config import load_config
    from laconic_nemo.runtime.megatron_env import parallel_info

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "benchmarks"))
    from gpu_common import SHAPES, hf_config

    assert arch_from_hf_config(root / "recipes" / "shapes" / "deepseek-r1-distill-qwen-1.5b") == \
        ModelArch(**SHAPES["deepseek-1.5b"])
    arch = ModelArch(**SHAPES["tiny-untied"])
    (tmp_path / "config.json").write_text(json.dumps(hf_config(arch)))
    cfg = load_config(root / "recipes" / "tiny_cpu.yaml", [f"model.shape_from={tmp_path}", "model.vocab_size=36"])
    parts = model_parts(cfg.model, parallel_info(1, 1))
    model = parts.model_provider(True, True)
    assert parts.hf_path is None and parts.vocab_size == arch.vocab_size == 512
    assert parts.transformer_config.gated_linear_unit and parts.transformer_config.num_query_groups == 2
    assert model.rotary_pos_emb.inv_freq[1].item() == pytest.approx(arch.rope_theta ** (-2 / arch.head_dim))
    assert sum(p.numel() for p in model.parameters()) != sum(
        p.numel() for p in model_parts(load_config(root / "recipes" / "tiny_cpu.yaml").model,
                                       parallel_info(1, 1)).model_provider(True, True).parameters())
    with pytest.raises(ValueError, match="model.shape_from"):
        model_parts(load_config(root / "recipes" / "tiny_cpu.yaml",
                                [f"model.shape_from={tmp_path}", "model.vocab_size=600"]).model, parallel_info(1, 1))
