"""laconic_nemo.integrations.common, what the TRL / verl / NeMo-RL plug-ins share: the Lagrangian reward of a batch,
the dual step, the multipliers' checkpoint format (exact JSON round trip, a checkpoint with fewer multipliers than
the run), the settings' errors; and the packaging rules: the base install pulls no framework, importing the
package imports none, only ``common`` imports the core. Torch only: these run in the main CI run."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest
import torch

from laconic_nemo.core import DualController
from laconic_nemo.integrations.common import (
    LENGTH,
    LENGTH_LO,
    STATE_FORMAT,
    LaconicSettings,
    LaconicState,
    dual_shapers,
)
from tests.test_architecture import PKG, project_imports

ROOT = Path(__file__).resolve().parent.parent


def ref_lagrangian(r, L, lam, B, linear=False, cap=None, hit=0.0, L_max=None):
    """float64 reference, written out: r - min(lam * c, cap) - hit * 1[L >= L_max]."""
    c = (L - B) / B if linear else max((L - B) / B, 0.0)
    pen = lam * c
    if cap is not None:
        pen = min(pen, cap)
    if hit and L_max is not None and L >= L_max:
        pen += hit
    return r - pen


def ref_dual(lam, mean, B, eta, floor, ceiling):
    return min(max(lam + eta * (mean / B - 1.0), floor), ceiling)


def test_the_lagrangian_reward_and_the_dual_step_match_a_float64_reference():
    s = LaconicState(LaconicSettings(budget=10, eta=0.25, ceiling=0.7, lambda_init=0.3))
    r, L = [1.0, 0.0, 1.0, 0.5], [4, 12, 25, 10]
    shaped, metrics = s.lagrangian_reward(r, L)
    assert shaped.dtype == torch.float64
    assert shaped.tolist() == [ref_lagrangian(ri, Li, 0.3, 10) for ri, Li in zip(r, L)]
    assert metrics["mean_length"] == sum(L) / 4 and metrics["frac_over_budget"] == 0.5
    lam, means = 0.3, [25.0, 18.0, 2.0, 4.0, 30.0]  # rises, hits the ceiling 0.7, falls, is clipped at floor 0
    for m in means:
        lam = ref_dual(lam, m, 10, 0.25, 0.0, 0.7)
        assert s.dual_step(m) == lam
    assert s.num_steps == len(means)
    assert 0.0 in [ref_dual(0.0, 4.0, 10, 0.25, 0.0, 0.7)]  # the path above does reach the floor


def test_linear_shaper_penalty_cap_and_hit_cap_follow_the_reference():
    s = LaconicState(LaconicSettings(budget=8, eta=0.1, lambda_init=0.5, shaper="linear"))
    shaped, _ = s.lagrangian_reward([1.0, 1.0], [4, 16])
    assert shaped.tolist() == [ref_lagrangian(1.0, 4, 0.5, 8, linear=True), ref_lagrangian(1.0, 16, 0.5, 8,
                                                                                             linear=True)]
    s = LaconicState(LaconicSettings(budget=8, eta=0.1, lambda_init=0.9, ceiling=2.0, max_length=32,
                                     penalty_cap=0.4, hit_cap=0.25))
    r, L = [1.0, 1.0, 1.0], [12, 24, 32]
    shaped, _ = s.lagrangian_reward(r, L)  # truncated=None: L >= L_max counts as truncated
    assert shaped.tolist() == [ref_lagrangian(1.0, x, 0.9, 8, cap=0.4, hit=0.25, L_max=32) for x in L]
    shaped, _ = s.lagrangian_reward(r, L, torch.tensor([True, False, False]))  # explicit flags win
    assert shaped.tolist() == [1.0 - 0.4 - 0.25, 1.0 - 0.4, 1.0 - 0.4]


def test_the_state_round_trips_through_json_bit_for_bit():
    a = LaconicState(LaconicSettings(budget=7, eta=0.013, ceiling=1.0))
    for m in (9.1, 11.3, 8.7):
        a.dual_step(m)
    text = json.dumps(a.state_dict())
    b = LaconicState(LaconicSettings(budget=7, eta=0.013, ceiling=1.0))
    assert b.load_state_dict(json.loads(text)) == [LENGTH]
    assert b.lam == a.lam and b.num_steps == 3 and json.loads(text)["format"] == STATE_FORMAT
    assert b.dual_step(10.0) == a.dual_step(10.0)


def test_a_checkpoint_with_one_multiplier_resumes_a_run_with_two():
    """More than one multiplier can be added without breaking resume of a checkpoint that holds one."""
    old = LaconicState(LaconicSettings(budget=5, eta=0.1))
    old.dual_step(9.0)
    saved = json.loads(json.dumps(old.state_dict()))
    new = LaconicState(LaconicSettings(budget=5, eta=0.1))
    new.multipliers["tail"] = DualController(budget=20, eta=0.05, init=0.2)  # a constraint added later
    assert new.load_state_dict(saved) == [LENGTH]
    assert new.lam == old.lam and new.multipliers["tail"].value == 0.2
    # the other way round: a checkpoint holding a multiplier this run lacks is refused by name, or ignored
    new.multipliers["tail"].update(30.0)
    two = json.loads(json.dumps(new.state_dict()))
    one = LaconicState(LaconicSettings(budget=5, eta=0.1))
    with pytest.raises(ValueError, match="multiplier 'tail' that this run does not define"):
        one.load_state_dict(two)
    assert one.load_state_dict(two, strict=False) == [LENGTH] and one.lam == old.lam


def test_a_resume_with_other_settings_or_another_format_is_refused_by_name():
    a = LaconicState(LaconicSettings(budget=5, eta=0.1))
    a.dual_step(9.0)
    b = LaconicState(LaconicSettings(budget=5, eta=0.2))
    with pytest.raises(ValueError, match="multiplier 'length': dual state mismatch on 'eta'.*strict=False"):
        b.load_state_dict(a.state_dict())
    b.load_state_dict(a.state_dict(), strict=False)
    assert b.lam == a.lam
    with pytest.raises(ValueError, match="not a LACONIC multiplier state"):
        b.load_state_dict({"shaper": "laconic", "dual": a.multipliers[LENGTH].state_dict()})


@pytest.mark.parametrize("values, message", [
    ({"budget": 5, "eta": 0.1, "shaper": "efficient"}, "laconic.shaper must be one of laconic, linear"),
    ({"budget": 5, "eta": -1.0}, "laconic.eta must be a finite number >= 0"),
    ({"budget": 0, "eta": 0.1}, "laconic.budget must be"),
    ({"budget": 5, "eta": 0.1, "ceiling": 0.5, "lambda_init": 0.9}, "laconic.lambda_init must be in"),
    ({"budget": 5, "eta": 0.1, "penalty_cap": -1}, "laconic.penalty_cap"),
    ({"budget": 5, "eta": 0.1, "budgte": 3}, "unknown config key 'laconic.budgte'"),
    ({"eta": 0.1}, "config key 'laconic.budget' is required"),
])
def test_bad_settings_are_refused_naming_the_key(values, message):
    with pytest.raises(ValueError, match=message):
        LaconicSettings.from_mapping(values)
    with pytest.raises(ValueError, match=message.replace("laconic.", "algorithm.laconic.")):
        LaconicSettings.from_mapping(values, where="algorithm.laconic")


def test_the_plug_ins_offer_the_dual_shapers():
    assert set(dual_shapers()) == {"laconic", "linear"}
    assert math.isinf(LaconicSettings(budget=5, eta=0.1).controller_for().ceiling)


def test_only_common_imports_the_core_and_each_plug_in_only_common():
    unit = PKG / "integrations"
    for f in sorted(unit.glob("*.py")):
        names = {n for _, n in project_imports(f)}
        if f.stem == "common":
            assert names and all(n.startswith("core") for n in names), names
        else:
            assert all(n.startswith("integrations.common") for n in names), (f.name, names)


def module_level_imports(path: Path) -> set[str]:
    """Root names of the modules a file imports at module level (what importing it imports)."""
    roots = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_base_install_pulls_no_framework_and_importing_the_package_imports_none():
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S).group(1)
    base = [re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].lower() for d in re.findall(r'"([^"]+)"', block)]
    frameworks = {"trl", "verl", "nemo_rl", "accelerate", "ray", "transformers"}
    assert base and not set(base) & (frameworks | {"nemo-rl"}), base
    assert re.search(r'^trl = \["trl==', text, re.M) and re.search(r'^verl = \["verl==', text, re.M)
    unit = PKG / "integrations"
    imports = {f.stem: module_level_imports(f) for f in unit.glob("*.py")}
    for name in ("__init__", "common", "nemo_rl"):  # importable without any framework (NeMo-RL is imported lazily)
        assert not imports[name] & frameworks, (name, imports[name])
    assert {"accelerate", "transformers"} <= imports["trl"] and "verl" in imports["verl"]
    assert "nemo_rl" not in {r for f in unit.glob("*.py") for r in module_level_imports(f)}


def test_the_docs_show_the_lines_the_examples_run_and_the_readme_links_them():
    docs = (ROOT / "docs" / "integrations.md").read_text()
    assert "docs/integrations.md" in (ROOT / "README.md").read_text()
    trl_block = docs.split("The lines a TRL user adds to a GRPO script:", 1)[1].split("```python", 1)[1].split("```")[0]
    example = (ROOT / "examples" / "integrations" / "trl_grpo_laconic.py").read_text()
    for line in ("from laconic_nemo.integrations.trl import Laconic", "reward_funcs=[laconic.reward(",
                 "callbacks=[laconic.callback],", "laconic = Laconic(budget="):
        assert line in trl_block and line in example, line
    nemo = (ROOT / "examples" / "integrations" / "nemo_rl_grpo_laconic.py").read_text()
    attach = "LaconicRewardShaping.from_config(master_config, logger=logger).attach(master_config, checkpointer, grpo_state)"
    assert attach in docs and attach in nemo
    verl_lines = re.findall(r"^\s+(\+?algorithm\.[\w.]+=\S+|trainer\.checkpoint_callback_class=\S+)", docs, re.M)
    script = (ROOT / "examples" / "integrations" / "verl_laconic.sh").read_text()
    assert len(verl_lines) == 6 and all(x in script for x in verl_lines), verl_lines


def test_the_band_is_a_lower_bound_multiplier_on_the_mean_length_against_a_float64_reference():
    """laconic.band in a plug-in: ``length_lo`` beside ``length``, both moved by the global mean length, the reward
    ``r - lambda max((L - B)/B, 0) - lambda_lo max((B_lo - L)/B_lo, 0)`` with B_lo = rho B."""
    s = LaconicState(LaconicSettings(budget=10, eta=0.25, ceiling=0.7, lambda_init=0.3, band=0.8))
    assert set(s.multipliers) == {LENGTH, LENGTH_LO} and s.band.ceiling == 0.7 and s.band.eta == 0.25
    lam, lo = 0.3, 0.0
    r, L = [1.0, 0.0, 1.0, 0.5, 1.0], [4, 12, 25, 10, 7]
    for m in (4.0, 3.0, 9.0, 25.0):  # below B_lo = 8 twice (lambda_lo rises), in the band, over B
        shaped, metrics = s.lagrangian_reward(r, L)
        want = [ri - lam * max((Li - 10) / 10, 0.0) - lo * max((8 - Li) / 8, 0.0) for ri, Li in zip(r, L)]
        assert shaped.tolist() == pytest.approx(want, abs=1e-15)
        assert metrics["lambda_lo"] == lo and metrics["mean_band_penalty"] == pytest.approx(
            sum(lo * max((8 - Li) / 8, 0.0) for Li in L) / 5, abs=1e-15)
        lam = ref_dual(lam, m, 10, 0.25, 0.0, 0.7)
        lo = min(max(lo + 0.25 * (1.0 - (m / 10) / 0.8), 0.0), 0.7)
        assert s.dual_step(m) == lam and s.band.value == pytest.approx(lo, abs=1e-15)
    assert s.multipliers[LENGTH_LO].num_updates == 4 and s.band.value == 0.0 and lo == 0.0
    # the state: one more multiplier in the same format; a checkpoint without it resumes with lambda_lo at 0
    state = json.loads(json.dumps(s.state_dict()))
    assert state["multipliers"][LENGTH_LO]["bound"] == "lower"
    again = LaconicState(LaconicSettings(budget=10, eta=0.25, ceiling=0.7, lambda_init=0.3, band=0.8))
    assert again.load_state_dict(state) == [LENGTH, LENGTH_LO] and again.band.value == s.band.value
    plain = LaconicState(LaconicSettings(budget=10, eta=0.25, ceiling=0.7, lambda_init=0.3))
    plain.dual_step(20.0)
    banded = LaconicState(LaconicSettings(budget=10, eta=0.25, ceiling=0.7, lambda_init=0.3, band=0.8))
    assert banded.load_state_dict(plain.state_dict()) == [LENGTH] and banded.band.value == 0.0
    # without the band: the paper's one multiplier, the reward unchanged, no band metric
    _, metrics = plain.lagrangian_reward(r, L)
    assert LENGTH_LO not in plain.multipliers and "lambda_lo" not in metrics
    for values, message in (({"band": 1.0}, "laconic.band must be a number in"),
                            ({"band": 0.9, "band_eta": -1}, "laconic.band_eta must be"),
                            ({"band": 0.9, "band_ceiling": "x"}, "laconic.band_ceiling must be")):
        with pytest.raises(ValueError, match=message):
            LaconicSettings.from_mapping({"budget": 5, "eta": 0.1, **values})
