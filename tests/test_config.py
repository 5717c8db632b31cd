"""Recipe loading: defaults chain, overrides, unknown keys and range errors name the key."""

from pathlib import Path

import pytest

from laconic_nemo.config import ConfigError, load_config

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def test_tiny_recipe_composes_with_base_and_overrides():
    cfg = load_config(RECIPES / "tiny_cpu.yaml", ["laconic.budget=25", "run.name=x"])
    assert cfg.laconic.budget == 25 and cfg.run.output_dir == "results/x"  # interpolation resolved after override
    assert cfg.grpo.clip_eps == 0.2  # inherited from base
    assert cfg.parallel.tensor_model_parallel_size == 2


@pytest.mark.parametrize(
    "override, key",
    [
        ("laconic.budgte=3", "laconic.budgte"),
        ("laconic.budget=0", "laconic.budget"),
        ("laconic.budget=200", "laconic.budget"),  # L_max = 96 must exceed B
        ("grpo.group_size=1", "grpo.group_size"),
        ("grpo.minibatch_size=7", "grpo.minibatch_size"),
        ("laconic.shaper=foo", "laconic.shaper"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("laconic.ceiling=-1", "laconic.ceiling"),
        ("laconic.lambda_init=1.5", "laconic.lambda_init"),   # above the ceiling 1.0
        ("laconic.lambda_init=-0.1", "laconic.lambda_init"),
        ("grpo.clip_dual=1.0", "grpo.clip_dual"),
        ("grpo.advantage_std=sample", "grpo.advantage_std"),
        ("laconic.count_eos=maybe", "laconic.count_eos"),
        ("reward.format=xml", "reward.format"),
        ("rollout.batch_buckets=[8,4]", "rollout.batch_buckets"),      # decode engine: strictly increasing
        ("rollout.batch_buckets=[]", "rollout.batch_buckets"),
        ("rollout.kv_block=0", "rollout.kv_block"),
        ("rollout.prefill_tokens=0", "rollout.prefill_tokens"),
        ("rollout.max_prompt_length=0", "rollout.max_prompt_length"),
        ("rollout.kv_cache_rows=0", "rollout.kv_cache_rows"),
        ("rollout.kv_cache_memory_fraction=0", "rollout.kv_cache_memory_fraction"),
        ("rollout.kv_cache_memory_fraction=1.5", "rollout.kv_cache_memory_fraction"),
        ("model.num_query_groups=3", "model.num_query_groups"),        # must divide the 4 heads
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPES / "tiny_cpu.yaml", [override])
    assert key in str(err.value)


def test_unknown_key_in_a_recipe_file(tmp_path):
    (tmp_path / "base.yaml").write_text((RECIPES / "base.yaml").read_text())
    (tmp_path / "r.yaml").write_text("defaults: [base]\ngrpo:\n  groupsize: 4\n")
    with pytest.raises(ConfigError, match="grpo.groupsize"):
        load_config(tmp_path / "r.yaml")
    (tmp_path / "c.yaml").write_text("defaults: [c]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "c.yaml")


def test_lambda_init_below_floor_is_valid():
    """The authors' scripts: lambda_len_init 0 with lambda_floor 1e-5 (clipped by the first dual step)."""
    cfg = load_config(RECIPES / "tiny_cpu.yaml", ["laconic.floor=1e-5", "laconic.lambda_init=0.0"])
    assert (cfg.laconic.floor, cfg.laconic.lambda_init) == (1e-5, 0.0)


def test_export_hf_needs_a_hugging_face_model():
    load_config(RECIPES / "tiny_cpu.yaml", ["checkpoint.export_hf=false"])
    with pytest.raises(ConfigError, match=r"checkpoint.export_hf = True is invalid: allowed false with model.source "
                                          r"= synthetic \(only hf runs have a Hugging Face architecture\)"):
        load_config(RECIPES / "tiny_cpu.yaml", ["checkpoint.export_hf=true"])
    cfg = load_config(RECIPES / "tiny_cpu.yaml", ["checkpoint.export_hf=true", "model.source=hf", "model.path=/m"])
    assert cfg.checkpoint.export_hf is True


def test_base_yaml_is_generated_from_the_schema():
    """recipes/base.yaml (what users read) is the rendering of the dataclasses: defaults are written once."""
    from omegaconf import OmegaConf

    from laconic_nemo.config import Config, render_base_yaml

    assert (RECIPES / "base.yaml").read_text() == render_base_yaml(), "run: python -m laconic_nemo.config > " \
                                                                      "recipes/base.yaml"
    assert OmegaConf.to_container(OmegaConf.load(RECIPES / "base.yaml")) == \
        OmegaConf.to_container(OmegaConf.structured(Config))


def test_values_are_typed_and_unknown_keys_are_named():
    cfg = load_config(RECIPES / "tiny_cpu.yaml", ["laconic.ceiling=1", "rollout.top_p=1"])
    assert isinstance(cfg.laconic.budget, float) and cfg.laconic.budget == 34.0  # a number key holds a float
    assert isinstance(cfg.laconic.ceiling, float) and isinstance(cfg.rollout.top_p, float)
    assert isinstance(cfg.grpo.group_size, int)
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.vllm\.colocte'"):
        load_config(RECIPES / "tiny_cpu.yaml", ["rollout.vllm.colocte=true"])
    with pytest.raises(ConfigError, match=r"unknown config key 'logging\.plt'"):
        load_config(RECIPES / "tiny_cpu.yaml", ["logging.plt=false"])
    with pytest.raises(Exception, match="colocte"):  # the typed config refuses new keys after loading too
        cfg.rollout.vllm.colocte = True


@pytest.mark.parametrize("overrides,dp,key", [
    (["grpo.num_prompts_per_step=15", "grpo.minibatch_size=120"], 2, "grpo.num_prompts_per_step"),
    (["grpo.minibatch_size=8"], 16, "grpo.minibatch_size"),
    (["grpo.micro_batch_size=48"], 2, "grpo.micro_batch_size"),
    (["warmup.batch_size=63"], 2, "warmup.batch_size"),
])
def test_check_layout_names_the_key(overrides, dp, key):
    from laconic_nemo.config import check_layout

    cfg = load_config(RECIPES / "tiny_cpu.yaml", overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_layout(cfg, dp)
    check_layout(load_config(RECIPES / "tiny_cpu.yaml"), 2)
