"""`laconic-nemo plan`: the resolved layout, and bad layouts / keys rejected with the key named (exit 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from laconic_nemo.cli import main
from laconic_nemo.config import ConfigError, load_config
from laconic_nemo.plan.layout import LayoutError, plan_layout

ROOT = Path(__file__).resolve().parent.parent
DEEPSEEK = str(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml")
QWEN3 = str(ROOT / "recipes" / "qwen3_8b_b1000.yaml")


def test_layout_numbers_qwen3_four_nodes():
    p = plan_layout(load_config(QWEN3), 4, 8, check_paths=False)
    assert (p.tp, p.pp, p.dp) == (4, 2, 4)
    assert (p.samples_per_rank, p.micro_batches_per_step) == (128, 32)
    assert p.actor == "megatron_core"


def test_derived_sizes_are_properties_of_the_config():
    """The rollout batch and its share per rank come from the config (GRPOConfig), equal to the plan's."""
    cfg = load_config(QWEN3)
    g, p = cfg.grpo, plan_layout(cfg, 4, 8, check_paths=False)
    assert g.rollout_batch == g.num_prompts_per_step * g.group_size == p.rollout_batch
    assert g.rollout_per_rank(p.dp) == p.samples_per_rank == 128
    assert g.minibatch_per_rank(p.dp) * p.dp == g.minibatch_size


def test_scaling_by_nodes_keeps_the_global_batch():
    cfg = load_config(DEEPSEEK)
    one, two = plan_layout(cfg, 1, 8, check_paths=False), plan_layout(cfg, 2, 8, check_paths=False)
    assert one.rollout_batch == two.rollout_batch
    assert one.samples_per_rank == 2 * two.samples_per_rank


@pytest.mark.parametrize("recipe,nodes,overrides,key", [
    (DEEPSEEK, 2, ["parallel.tensor_model_parallel_size=3"], "parallel.tensor_model_parallel_size"),
    (DEEPSEEK, 2, ["parallel.tensor_model_parallel_size=16"], "parallel.tensor_model_parallel_size"),
    (QWEN3, 4, ["parallel.pipeline_model_parallel_size=5"], "parallel.pipeline_model_parallel_size"),
    (QWEN3, 4, ["parallel.pipeline_model_parallel_size=8"], "parallel.pipeline_model_parallel_size"),  # 36 layers
    (DEEPSEEK, 2, ["parallel.tensor_model_parallel_size=8"], "parallel.tensor_model_parallel_size"),  # 12 heads
    (DEEPSEEK, 2, ["grpo.num_prompts_per_step=100", "grpo.minibatch_size=200"], "grpo.num_prompts_per_step"),
    (DEEPSEEK, 2, ["grpo.minibatch_size=128", "grpo.micro_batch_size=3"], "grpo.micro_batch_size"),
    (DEEPSEEK, 3, [], "grpo.num_prompts_per_step"),  # DP 24 does not divide 128 prompts
    (str(ROOT / "recipes" / "qwen_math_1.5b_b550.yaml"), 2, ["rollout.max_new_tokens=4096"],
     "rollout.max_new_tokens"),
    (DEEPSEEK, 2, ["rollout.engine=vllm"], "rollout.engine"),  # NeMo-Aligner actor: megatron or nemo
    (DEEPSEEK, 2, ["rollout.kv_cache_memory_fraction=0.05"], "rollout.kv_cache_memory_fraction"),  # 6.6 of 80 GiB
    (QWEN3, 4, ["rollout.max_prompt_length=60000"], "rollout.kv_cache_memory_fraction"),
])
def test_bad_layout_names_the_key(recipe, nodes, overrides, key, capsys):
    with pytest.raises(LayoutError, match=key.replace(".", r"\.")):
        plan_layout(load_config(recipe, overrides), nodes, 8, check_paths=False)
    rc = main(["plan", recipe, "--nodes", str(nodes), "--skip-path-checks", *overrides])
    assert rc == 2
    assert key in capsys.readouterr().err


def test_unknown_key_exit_2(capsys):
    assert main(["plan", DEEPSEEK, "--nodes", "2", "--skip-path-checks", "grpo.groupsize=4"]) == 2
    assert "grpo.groupsize" in capsys.readouterr().err


def test_cross_field_config_error_exit_2(capsys):
    assert main(["plan", DEEPSEEK, "--nodes", "2", "--skip-path-checks", "laconic.budget=5000"]) == 2
    assert "laconic.budget" in capsys.readouterr().err


def test_paths_checked_and_conversion_planned(tmp_path):
    data = tmp_path / "train.json"
    data.write_text(json.dumps([{"problem": "1+1", "answer": 2}]))  # an empty file is refused
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"num_attention_heads": 12, "num_key_value_heads": 2,
                                                "num_hidden_layers": 28, "max_position_embeddings": 131072}))
    nemo = tmp_path / "model.nemo"
    base = [f"data.train_files=[{data}]", f"model.path={nemo}"]
    with pytest.raises(LayoutError, match="model.path"):
        plan_layout(load_config(DEEPSEEK, base), 2, 8)                      # no .nemo and nothing to convert
    p = plan_layout(load_config(DEEPSEEK, base), 2, 8, hf_model=str(hf))    # converted by the prepare step
    assert p.conversion_needed
    nemo.write_text("x")
    assert not plan_layout(load_config(DEEPSEEK, base), 2, 8, hf_model=str(hf)).conversion_needed
    with pytest.raises(LayoutError, match="data.train_files"):
        plan_layout(load_config(DEEPSEEK, [f"data.train_files=[{tmp_path / 'missing.json'}]", f"model.path={nemo}"]),
                    2, 8)


def test_checkpoint_config_overrides_recipe_shape(tmp_path):
    """The HF config.json, when readable, is the truth: 14 heads do not split over TP 4."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"num_attention_heads": 14, "num_key_value_heads": 2,
                                                "num_hidden_layers": 28}))
    cfg = load_config(QWEN3, [f"model.path={hf}", "parallel.pipeline_model_parallel_size=1"])
    with pytest.raises(LayoutError, match=r"attention heads \(14\)"):
        plan_layout(cfg, 1, 8, check_paths=False)


def test_hf_config_read_by_the_bridge_and_named_by_plan_as_a_layout_error(tmp_path):
    """The model folder's config.json is read below plan/ (laconic_nemo.bridge.hf_folder); a broken one is named
    with its line (and, not UTF-8, its column), and plan_layout still raises it as a LayoutError."""
    from laconic_nemo.bridge.hf_folder import HFConfigError, hf_config

    hf = tmp_path / "hf"
    hf.mkdir()
    assert hf_config(str(hf)) is None and hf_config(None) is None
    (hf / "config.json").write_text(json.dumps({"num_attention_heads": 14}))
    assert hf_config(str(hf)) == hf_config(str(hf / "model.safetensors")) == {"num_attention_heads": 14}
    (hf / "config.json").write_bytes(b'{\n  "a": "\xe9"}')
    with pytest.raises(HFConfigError, match=r"config.json line 2, column 9: byte 0xe9 is not UTF-8 text"):
        hf_config(str(hf))
    (hf / "config.json").write_text("[1, 2]")
    with pytest.raises(HFConfigError, match="a JSON object expected"):
        hf_config(str(hf))
    (hf / "config.json").write_text('{\n  "a": }')
    cfg = load_config(QWEN3, [f"model.path={hf}"])
    with pytest.raises(LayoutError, match=r"config.json line 2: invalid JSON"):
        plan_layout(cfg, 1, 8, check_paths=False)


def test_cli_json_and_commands(capsys):
    rc = main(["plan", DEEPSEEK, "--nodes", "2", "--skip-path-checks", "--json", "--container", "img.sqsh",
               "--hf-model", "/checkpoints/hf/x", "laconic.budget=1200"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dp"] == 16 and out["budget"] == 1200
    plan_cmd, prepare_cmd, train_cmd = out["commands"]
    assert "laconic.budget=1200" in train_cmd and "--container-image=img.sqsh" in train_cmd
    assert "--nodes=2 --ntasks-per-node=8" in train_cmd
    assert "--prepare --hf-model=/checkpoints/hf/x" in prepare_cmd
    assert " plan " in plan_cmd


def test_config_error_is_layout_error_base():
    assert issubclass(LayoutError, ConfigError)


# --------------------------------------------------------------------------------------------------------------
# `plan` builds what the trainer builds before step 1 (laconic_nemo.plan.step_one.build_step_one), for every recipe
# --------------------------------------------------------------------------------------------------------------
ALL_RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if p.stem != "base")


def _layout_for(recipe: Path) -> tuple[int, int]:
    """(nodes, GPUs per node): the launch script's node count; tiny CPU recipes: one node of TP x PP ranks."""
    for script in (ROOT / "launch").glob("*.sh"):
        text = script.read_text()
        if f"RECIPE=recipes/{recipe.name}\n" in text:
            return int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1)), 8
    cfg = load_config(recipe)
    return 1, int(cfg.parallel.tensor_model_parallel_size) * int(cfg.parallel.pipeline_model_parallel_size)


@pytest.mark.parametrize("recipe", ALL_RECIPES, ids=lambda p: p.stem)
def test_every_recipe_passes_plan_and_builds_step_one(recipe, capsys):
    nodes, gpus = _layout_for(recipe)
    rc = main(["plan", str(recipe), "--nodes", str(nodes), "--gpus-per-node", str(gpus), "--skip-path-checks",
               "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    built = json.loads(out.out)["build"]
    lc = load_config(recipe).laconic
    assert built["lambda_init"] == (0.0 if lc.shaper not in ("laconic", "linear", "fixed") else float(lc.lambda_init))
    if lc.per_prompt_budget:  # one multiplier per budget class instead of lambda
        assert built["dual"] is None and any("classes, one multiplier each" in c for c in built["constraints"])
    elif lc.shaper in ("laconic", "linear"):
        assert built["dual"]["floor"] == float(lc.floor) and built["dual"]["eta"] == float(lc.eta)


def test_plan_reports_constructor_failures_before_launch(capsys):
    """A failure of a step-one constructor that config validation does not see exits 2 with the key named."""
    rc = main(["plan", DEEPSEEK, "--nodes", "2", "--skip-path-checks", "laconic.shaper=l1_exact"])
    assert rc == 2
    assert "data.target_length_range" in capsys.readouterr().err


def test_deepseek_authors_run_g6_layout():
    """The authors' DeepSeek run: G = 6, 128 x 6 = 768 responses, 48 per rank (8 whole groups) on DP 16, 4
    optimiser steps of 32 prompts x 6 = 192 responses, 3 micro-batches of 4 per rank per step."""
    p = plan_layout(load_config(DEEPSEEK), 2, 8, check_paths=False)
    assert (p.world_size, p.tp, p.pp, p.dp) == (16, 1, 1, 16)
    assert (p.group_size, p.rollout_batch, p.prompts_per_rank, p.samples_per_rank) == (6, 768, 8, 48)
    assert (p.minibatch_size, p.steps_per_rollout, p.micro_batches_per_step) == (192, 4, 3)
    assert p.max_generated_tokens_per_step == 768 * 4096 and p.budget_tokens_per_step == 768 * 1500
    assert p.actor == "nemo_aligner"
    # G = 6 with a minibatch that splits groups over DP x micro-batches is rejected with the key named
    with pytest.raises(LayoutError, match="grpo.micro_batch_size"):
        plan_layout(load_config(DEEPSEEK, ["grpo.micro_batch_size=5"]), 2, 8, check_paths=False)


def test_plan_loads_tokenizer_and_renders_first_row(tmp_path, capsys):
    """With the paths present, `plan` loads the tokenizer, renders row 0 through the template and warns when the
    template is not the checkpoint's own chat template for the same turn."""
    from tests.hf_fixtures import char_tokenizer

    hf = tmp_path / "hf"
    tok = char_tokenizer()
    tok.save_pretrained(str(hf))
    (hf / "config.json").write_text(json.dumps({"num_attention_heads": 32, "num_key_value_heads": 8,
                                                "num_hidden_layers": 36, "max_position_embeddings": 40960}))
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "  What is 2+3?\n", "answer": "5"}) + "\n")
    rc = main(["plan", QWEN3, "--nodes", "4", "--json", f"model.path={hf}", f"data.train_files=[{data}]"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    res = json.loads(out.out)
    preview = res["build"]["prompt_preview"]
    assert preview.startswith("<|im_start|>user\nWhat is 2+3? You FIRST think about the reasoning process")
    assert preview.endswith(f"[{len(preview.split('   [')[0])} tokens]")  # char tokenizer: one id per char
    assert f"from {hf} ({len(tok)} tokens, eos '<eos>')" in res["build"]["tokenizer"]
    assert any("data.prompt_template = qwen3_easyr1_math differs" in w for w in res["warnings"])


# ---------------------------------------------------------------------------------------------- model folder checks
def _deepseek_like_folder(tmp_path, with_weights=True, tokenizer=True, arch="Qwen2ForCausalLM"):
    """A tiny Qwen2 checkpoint whose tokenizer is a byte-level BPE with DeepSeek-R1-Distill's chat tokens,
    shipped as tokenizer.json + tokenizer_config.json only (tests/hf_fixtures.py)."""
    from tests.hf_fixtures import DEEPSEEK_R1_DISTILL_SPECIALS, save_bpe_tokenizer_json_only, save_tiny_qwen2

    hf = Path(save_tiny_qwen2(tmp_path / "hf"))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (hf / f).unlink(missing_ok=True)
    if tokenizer:
        save_bpe_tokenizer_json_only(hf, DEEPSEEK_R1_DISTILL_SPECIALS, DEEPSEEK_R1_DISTILL_SPECIALS[0])
    if not with_weights:
        for w in hf.glob("*.safetensors"):
            w.unlink()
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
    data = tmp_path / "train.json"
    data.write_text(json.dumps([{"problem": "What is 2+3?", "answer": "5"}]))
    return hf, [f"data.train_files=[{data}]", f"model.path={tmp_path / 'missing.nemo'}", "rollout.max_new_tokens=1000",
                "laconic.budget=500"]


def test_plan_loads_the_tokenizer_and_lists_single_token_end_strings(tmp_path, capsys):
    hf, ov = _deepseek_like_folder(tmp_path)
    assert main(["plan", DEEPSEEK, "--nodes", "1", "--hf-model", str(hf), "--json", *ov]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["conversion_needed"] and out["tokenizer"] == str(hf)
    assert out["end_strings"] == ["<|endoftext|>", "<｜end▁of▁sentence｜>"]  # no <|im_end|>: not a token here


@pytest.mark.parametrize("skip_path_checks", [False, True])
def test_plan_loads_the_tokenizer_once(tmp_path, capsys, monkeypatch, skip_path_checks):
    """The folder checks (end strings) and the step-one build (prompt preview) share one tokenizer: `plan` loads
    it from the HF folder once, counted at transformers' loader that both go through; with the path checks
    skipped the build still loads it, once."""
    import transformers

    hf, ov = _deepseek_like_folder(tmp_path)
    real = transformers.AutoTokenizer.from_pretrained
    loads = []

    def counting(path, *args, **kwargs):
        loads.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    skip = ["--skip-path-checks"] if skip_path_checks else []
    assert main(["plan", DEEPSEEK, "--nodes", "1", "--hf-model", str(hf), "--json", *skip, *ov]) == 0
    out = json.loads(capsys.readouterr().out)
    assert loads == [str(hf)]
    assert f" from {hf} (" in out["build"]["tokenizer"]
    assert out["build"]["prompt_preview"].endswith(" tokens]")
    assert out["end_strings"] == (None if skip_path_checks else ["<|endoftext|>", "<｜end▁of▁sentence｜>"])


def test_plan_refuses_a_multi_token_end_string(tmp_path, capsys):
    hf, ov = _deepseek_like_folder(tmp_path)
    rc = main(["plan", DEEPSEEK, "--nodes", "1", "--hf-model", str(hf), *ov,
               'nemo.model.reinforce.sampling_params.end_strings=["<|endoftext|>","<|im_end|>"]'])
    err = capsys.readouterr().err
    assert rc == 2 and "'<|im_end|>' is not a single token" in err
    assert "nemo.model.reinforce.sampling_params.end_strings" in err


@pytest.mark.parametrize("broken, named", [
    (dict(with_weights=False), "*.safetensors"),
    (dict(tokenizer=False), "tokenizer.json"),
    (dict(arch="Qwen3ForCausalLM"), "config.json"),
])
def test_plan_refuses_a_folder_the_converter_cannot_read(tmp_path, capsys, broken, named):
    hf, ov = _deepseek_like_folder(tmp_path, **broken)
    assert main(["plan", DEEPSEEK, "--nodes", "1", "--hf-model", str(hf), *ov]) == 2
    assert named in capsys.readouterr().err


def test_plan_refuses_vllm_on_separate_gpus(capsys):
    assert main(["plan", QWEN3, "--nodes", "4", "--skip-path-checks", "rollout.vllm.colocate=false"]) == 2
    assert "rollout.vllm.colocate" in capsys.readouterr().err


def test_vllm_rollouts_refused_with_pipeline_parallelism(capsys):
    """With the vLLM engine every pipeline stage owns a whole engine and samples on its own:
    ``MegatronCoreActor._generate_with_engine`` returns each stage's own ``engine.generate`` output, with no
    broadcast across stages (the megatron sampler broadcasts from the last stage), so at PP > 1 the stages could
    train on different rollouts. Refused by the config checks (every entry point) and so by ``plan``."""
    assert load_config(QWEN3).parallel.pipeline_model_parallel_size == 2
    with pytest.raises(ConfigError, match="rollout.engine = 'vllm' is invalid: allowed megatron with "
                                          "parallel.pipeline_model_parallel_size = 2"):
        load_config(QWEN3, ["rollout.engine=vllm"])
    assert main(["plan", QWEN3, "--nodes", "4", "--skip-path-checks", "rollout.engine=vllm"]) == 2
    assert "rollout.engine" in capsys.readouterr().err
    cfg = load_config(QWEN3, ["rollout.engine=vllm", "parallel.pipeline_model_parallel_size=1"])  # PP 1: allowed
    assert cfg.rollout.engine == "vllm"


def test_plan_prints_the_rollout_engine_and_its_kv_cache(capsys):
    """The flagship recipe generates with the decode engine; plan names it and the KV cache it allocates per GPU:
    DeepSeek-R1-Distill-Qwen-1.5B, 28 layers x 2 kv heads x 128, bf16, 48 responses per DP rank x (1024 + 4096)
    positions = 2 x 28 x 48 x 5120 x 2 x 128 x 2 bytes."""
    p = plan_layout(load_config(DEEPSEEK), 2, 8, check_paths=False)
    assert p.rollout_engine == "megatron" and p.kv_cache_bytes == 2 * 28 * 48 * 5120 * 2 * 128 * 2
    assert main(["plan", DEEPSEEK, "--nodes", "2", "--skip-path-checks"]) == 0
    out = capsys.readouterr().out
    assert "rollout engine   megatron: the decode engine" in out
    assert "KV cache         [28 layers x 2 x 48 rows x 5120 positions x 2 kv heads x 128] bfloat16 = 6.56 GiB" in out
    # CUDA graphs: batch buckets 8, 16, 32, 48 (<= 48 rows) and ceil(5120 / 256) = 20 KV lengths; a pass's keys form
    # a staircase (bucket down, KV length up): <= 4 + 20 - 1, and <= 4 x 20 over every rollout
    assert (p.decode_graphs_per_pass, p.decode_graphs_in_all) == (23, 80)
    assert "decode graphs    <= 23 captures per rollout pass (4 batch buckets <= 48 rows + 20 KV lengths - 1)" in out
    # Qwen3-8B, TP 4 x PP 2: 18 layers and 8 / 4 kv heads per GPU, 128 responses per DP rank
    q = plan_layout(load_config(QWEN3), 4, 8, check_paths=False)
    assert q.kv_cache_bytes == 2 * 18 * 128 * 5120 * 2 * 128 * 2
    # NeMo's own generation: no KV cache of ours
    n = plan_layout(load_config(DEEPSEEK, ["rollout.engine=nemo"]), 2, 8, check_paths=False)
    assert n.rollout_engine == "nemo" and n.kv_cache is None


def test_plan_of_the_one_gpu_check_reads_the_shape_and_names_the_packed_kernel(capsys):
    """recipes/gpu_check_1.5b.yaml: the synthetic GPT with DeepSeek-R1-Distill-Qwen-1.5B's architecture
    (model.shape_from): plan sizes the KV cache and the training memory from that shape (28 layers, 2 kv heads x
    128, 48 rows x (64 + 4096) positions, bf16; SwiGLU) and, planned for this machine (the one-GPU check runs
    without a container: --container none), names the packed-attention kernel of this torch."""
    from laconic_nemo.runtime.kernels import torch_varlen_attn, transformer_engine_available, varlen_form

    recipe = ROOT / "recipes" / "gpu_check_1.5b.yaml"
    p = plan_layout(load_config(recipe), 1, 1, image="none")
    assert p.kv_cache_bytes == 2 * 28 * 48 * 4160 * 2 * 128 * 2
    assert p.steps_per_rollout == 4 and p.samples_per_rank == 48
    kind = "varlen: torch.nn.attention.varlen.varlen_attn" if varlen_form(torch_varlen_attn()) else "flex:"
    assert p.packed_attention.startswith(kind)
    te = plan_layout(load_config(recipe, ["model.attention=te"]), 1, 1, image="none").packed_attention
    assert te.startswith("te: TransformerEngine" if transformer_engine_available() else "none: model.attention=te")
    assert main(["plan", str(recipe), "--nodes", "1", "--gpus-per-node", "1", "--container", "none"]) == 0
    assert f"packed attention {p.packed_attention}" in capsys.readouterr().out
    # the shape keys alone (no shape_from) would give another model: the shape is read, not the keys
    plain = plan_layout(load_config(recipe, ["model.shape_from=null", "model.max_position_embeddings=8192"]), 1, 1)
    assert plain.kv_cache_bytes != p.kv_cache_bytes
    with pytest.raises(LayoutError, match="model.shape_from"):
        plan_layout(load_config(recipe, ["model.shape_from=/nonexistent/shape"]), 1, 1)
    with pytest.raises(ConfigError, match="model.shape_from"):
        load_config(recipe, ["model.source=hf", "model.path=/x"])
