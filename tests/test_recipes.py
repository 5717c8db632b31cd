"""The paper-run recipes compose, carry the paper's numbers, and each has a launch script whose node
count passes `plan`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from laconic_nemo.config import load_config, to_dict
from laconic_nemo.plan.layout import plan_layout

ROOT = Path(__file__).resolve().parent.parent
# the cluster recipes: not the defaults, the CPU demos, nor the one-GPU check of the paper's step (benchmarks/paper_step.py)
RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml")
                 if p.stem != "base" and not p.stem.startswith(("tiny_cpu", "gpu_check")))
LAUNCH = ROOT / "launch"


def launch_scripts() -> dict[str, tuple[Path, int]]:
    """recipe stem -> (launch script, #SBATCH --nodes) for every per-recipe script."""
    out = {}
    for script in LAUNCH.glob("*.sh"):
        text = script.read_text()
        recipe = re.search(r"^RECIPE=recipes/(\S+)\.yaml$", text, re.M)
        if recipe:
            nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
            out[recipe.group(1)] = (script, nodes)
    return out


def test_every_paper_run_has_a_recipe():
    stems = {p.stem for p in RECIPES}
    for name in ("deepscaler_1.5b_b2000", "deepseek_1.5b_b1500", "qwen3_8b_b1000", "qwen_math_1.5b_b550",
                 "qwen_math_1.5b_b550_linear", "ablation_budget_b1000", "ablation_budget_b1500",
                 "ablation_budget_b1750", "ablation_eta_0.001", "ablation_eta_0.01", "ablation_ceiling_0.3",
                 "ablation_ceiling_0.15", "ablation_fixed_lambda_0.001", "ablation_fixed_lambda_0.01",
                 "ablation_fixed_lambda_0.05", "ablation_linear_cost", "baseline_grpo", "baseline_l1_exact",
                 "baseline_l1_max", "baseline_efficient", "baseline_overlong", "baseline_thinkprune_4k"):
        assert name in stems, name


# (recipe, B, steps, L_max, shaper, G): DESIGN.md section 1 and the authors' scripts (docs/recipes.md)
PAPER = [
    ("deepscaler_1.5b_b2000", 2000, 300, 4096, "laconic", 4),
    ("deepseek_1.5b_b1500", 1500, 500, 4096, "laconic", 6),
    ("deepseek_1.5b_b1500_paper", 1500, 500, 4096, "laconic", 6),
    ("qwen3_8b_b1000", 1000, 150, 4096, "laconic", 4),
    ("qwen_math_1.5b_b550", 550, 350, 2048, "laconic", 3),
    ("qwen_math_1.5b_b550_linear", 550, 350, 2048, "linear", 3),
]


@pytest.mark.parametrize("name,budget,steps,lmax,shaper,G", PAPER)
def test_paper_numbers(name, budget, steps, lmax, shaper, G):
    cfg = load_config(ROOT / "recipes" / f"{name}.yaml")
    assert float(cfg.laconic.budget) == budget
    assert int(cfg.run.num_steps) == steps
    assert int(cfg.rollout.max_new_tokens) == lmax
    assert cfg.laconic.shaper == shaper
    assert int(cfg.grpo.group_size) == G and int(cfg.grpo.num_prompts_per_step) == 128
    # EasyR1 v0.3.2.dev0 settings the authors inherit: global_batch_size 32 prompts x n -> 4 updates per rollout,
    # clip 0.2 / 0.3 + dual-clip 3.0, low-var KL 1e-2, token-mean, temperature 1.0, unbiased group std
    g = cfg.grpo
    assert int(g.minibatch_size) == 32 * G
    assert (g.clip_eps, g.clip_eps_high, g.clip_dual, g.kl_beta) == (0.2, 0.3, 3.0, 0.01)
    assert (g.loss_aggregation, g.advantage_std, cfg.rollout.temperature) == ("token_mean", "unbiased", 1.0)


# (recipe, eta, floor, ceiling, penalty_cap, hit_cap, count_eos, format_weight, format): the authors' scripts;
# the paper form of the DeepSeek run for comparison
KNOBS = [
    ("deepscaler_1.5b_b2000", 0.002, 1e-5, 0.1, 0.4, 0.1, True, 0.1, "think_boxed"),
    ("deepseek_1.5b_b1500", 0.002, 0.0, 0.1, 0.4, 0.1, True, 0.1, "think_boxed"),
    ("qwen3_8b_b1000", 0.002, 0.0, 1.0, 0.4, 0.1, True, 0.1, "think_boxed"),
    ("qwen_math_1.5b_b550", 0.01, 0.0, 10.0, 0.4, 0.1, True, 0.1, "think_boxed"),
    ("deepseek_1.5b_b1500_paper", 0.002, 0.0, None, None, 0.0, False, 0.0, "boxed"),
]


@pytest.mark.parametrize("name,eta,floor,ceiling,cap,hit,count_eos,fw,fmt", KNOBS)
def test_laconic_knobs_as_the_authors_scripts(name, eta, floor, ceiling, cap, hit, count_eos, fw, fmt):
    cfg = load_config(ROOT / "recipes" / f"{name}.yaml")
    lc = cfg.laconic
    assert (lc.eta, lc.floor, lc.ceiling, lc.penalty_cap, lc.hit_cap, lc.count_eos) == (eta, floor, ceiling, cap, hit,
                                                                                       count_eos)
    assert lc.lambda_init == 0.0  # every script: lambda_len_init 0
    assert (cfg.reward.format_weight, cfg.reward.format) == (fw, fmt)


def _flat(cfg) -> dict:
    out = {}

    def walk(node, prefix):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v
    walk(to_dict(cfg), "")
    return out


@pytest.mark.parametrize("name,changed", [
    ("ablation_budget_b1000", {"laconic.budget": 1000}),
    ("ablation_eta_0.001", {"laconic.budget": 1500, "laconic.eta": 0.001, "laconic.ceiling": 0.3}),
    ("ablation_eta_0.01", {"laconic.budget": 1500, "laconic.eta": 0.01, "laconic.ceiling": 0.15}),
    ("ablation_ceiling_0.3", {"laconic.budget": 1500, "laconic.ceiling": 0.3}),
    ("ablation_ceiling_0.15", {"laconic.budget": 1500, "laconic.ceiling": 0.15}),
    ("ablation_fixed_lambda_0.05", {"laconic.shaper": "fixed", "laconic.budget": 1000, "laconic.lambda_init": 0.05,
                                    "laconic.floor": 0.0}),
    ("ablation_linear_cost", {"laconic.shaper": "linear", "laconic.budget": 1500}),
    ("baseline_efficient", {"laconic.shaper": "efficient", "laconic.alpha": 0.1}),
])
def test_ablation_changes_only_its_knob(name, changed):
    """An ablation differs from the DeepScaleR run in the knobs the paper names for it (plus its name / output
    folder): its own knob, and the budget the paper ran it at."""
    ref = _flat(load_config(ROOT / "recipes" / "deepscaler_1.5b_b2000.yaml"))
    abl = _flat(load_config(ROOT / "recipes" / f"{name}.yaml"))
    diff = {k: abl[k] for k in abl if abl[k] != ref[k] and k not in ("run.name", "run.output_dir")}
    assert diff == changed


def test_the_band_variant_of_the_stated_run_changes_only_the_band():
    """deepseek_1.5b_stated_band.yaml is deepseek_1.5b_stated.yaml with laconic.band (its multiplier's eta and
    ceiling the class's own: the [script-ds] dual_lr and lambda_ceil), and builds one lower bound per stated budget."""
    from laconic_nemo.grpo.constraints import build_constraints

    ref = _flat(load_config(ROOT / "recipes" / "deepseek_1.5b_stated.yaml"))
    cfg = load_config(ROOT / "recipes" / "deepseek_1.5b_stated_band.yaml")
    band = _flat(cfg)
    diff = {k: band[k] for k in band if band[k] != ref[k] and k not in ("run.name", "run.output_dir")}
    assert diff == {"laconic.band": cfg.laconic.band} and 0 < cfg.laconic.band < 1
    classes = build_constraints(cfg, cfg.data.stated_budgets()).classes
    assert [(lo.rho, lo.eta, lo.ceiling) for lo in classes.lower] == [(cfg.laconic.band, 0.002, 0.1)] * 6


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_has_launch_script_and_fits_its_nodes(recipe):
    cfg = load_config(recipe)
    assert cfg.run.name == recipe.stem, "launch/submit.sh derives the log folder from the recipe file name"
    assert cfg.run.output_dir == f"/results/{recipe.stem}"
    scripts = launch_scripts()
    assert recipe.stem in scripts, f"no launch script for {recipe.name}"
    _, nodes = scripts[recipe.stem]
    plan = plan_layout(cfg, nodes, 8, check_paths=False)
    assert plan.world_size == nodes * 8
    if recipe.stem.startswith("qwen3_8b"):
        assert plan.tp > 1 and plan.pp > 1, "the 8B run uses tensor and pipeline parallelism"
    else:
        assert (plan.tp, plan.pp) == (1, 1), "1.5B runs are pure data parallel"
    assert cfg.model.precision == "bf16"


def test_every_launch_script_names_an_existing_recipe_and_converts_when_needed():
    scripts = launch_scripts()
    assert len(scripts) == len(RECIPES)
    for stem, (script, _) in scripts.items():
        assert (ROOT / "recipes" / f"{stem}.yaml").is_file(), script.name
        cfg = load_config(ROOT / "recipes" / f"{stem}.yaml")
        text = script.read_text()
        chained = str(cfg.model.path).startswith("/results/")  # ThinkPrune stages start from the previous policy
        if cfg.model.source == "nemo" and not chained:
            assert "HF_MODEL=" in text, f"{script.name}: a .nemo recipe needs the HF checkpoint to convert"
        else:
            assert "HF_MODEL=" not in text, script.name
