"""What a resume checks of a checkpoint's state, without running one (the real runs are in
tests/test_resume_constraint_state.py):

* a multiplier outside the range its own saved settings allow (below the floor, above the ceiling; 0 before the
  first update) is a bad value like NaN or a wrong type: named by its whole key path and skipped for the previous
  intact checkpoint;
* lambda's controller where the checkpoint trained with per-prompt budgets (a multiplier per class instead) is
  decided by the same restore in the pre-flight and the ranks: refused naming the classes dropped, unless
  ``lambda:reset`` or ``class:K=lambda`` says where lambda starts;
* a refusal's suggested ``checkpoint.resume_allow_changes`` list passes when applied (no loop), for the config
  differences and the constraint state alike;
* the console line of a step shows the class multipliers and budgets where the run has budget classes.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import pytest

from laconic_nemo.config import load_config, to_dict
from laconic_nemo.core import BudgetClasses, DualController, TailConstraint, shaper_state
from laconic_nemo.grpo.constraints import ResumeRefused, build_constraints, restore_resume_state, run_budgets
from laconic_nemo.grpo.metrics import MetricsWriter, multipliers_text
from laconic_nemo.grpo.resume import ResumeError, choose_checkpoint, state_problem

ROOT = Path(__file__).resolve().parent.parent
STATED = str(ROOT / "recipes" / "tiny_cpu_stated.yaml")
# the stated recipe of the real runs (tests/test_resume_constraint_state.py): classes 22 and 40, a tail constraint
BASE = ["data.target_lengths=[22,40]", "rollout.max_new_tokens=48", "laconic.ceiling=2.0", "laconic.budget=20",
        "laconic.tail_budget=30", "laconic.tail_share=0.2", "laconic.tail_eta=0.3"]


def checkpoint_state(overrides: list[str], moved: float = 0.25) -> dict:
    """The trainer state a run of the stated recipe with ``overrides`` writes after a few steps: its config, the
    shaper entry, and its constraints' state with every multiplier at ``moved`` (one dual step each)."""
    cfg = load_config(STATED, [*BASE, *overrides])
    built = build_constraints(cfg, run_budgets(cfg))
    duals = [*(built.classes.duals if built.classes is not None else []),
             *([built.tail.dual] if built.tail is not None else []), *([built.dual] if built.dual else [])]
    for d in duals:
        d.update(d.budget * (1.0 + moved / d.eta) if d.eta else d.budget)  # lam = 0 + eta (x / B - 1) = moved
    state = {"step": 4, "world_size": 2, "dp_size": 1, "config": to_dict(cfg),
             "shaper": shaper_state(cfg.laconic.shaper, built.dual)}
    if built.state_dict() is not None:
        state["constraints"] = built.state_dict()
    return state


def write_checkpoint(root: Path, step: int, state: dict) -> Path:
    """A complete checkpoint folder holding ``state`` and a manifest that lists it (intact by its files)."""
    ckpt = root / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    data = json.dumps({**state, "step": step}).encode()
    (ckpt / "trainer_state.json").write_bytes(data)
    (ckpt / "manifest.json").write_text(json.dumps({"step": step, "files": {
        "trainer_state.json": {"size": len(data), "crc32": zlib.crc32(data)}}}))
    return ckpt


# ---------------------------------------------------------------- a multiplier outside its range
@pytest.mark.parametrize("where, value, key, allowed", [
    (("classes", "classes", "22", "dual"), -0.5, "constraints.classes.classes.22.dual.lam",
     "a number in [floor, ceiling] = [0.0, 2.0]"),
    (("classes", "classes", "40", "dual"), 5.0, "constraints.classes.classes.40.dual.lam",
     "a number in [floor, ceiling] = [0.0, 2.0]"),
    (("tail", "dual"), -1, "constraints.tail.dual.lam", "a number in [floor, ceiling] = [0.0, 1.0]"),
])
def test_a_multiplier_outside_its_states_range_is_named_by_its_key_and_skipped(tmp_path, where, value, key, allowed):
    """The issue's three probes (a class lam of -0.5 or 5.0 over a ceiling of 2.0, the tail's mu -1) in the newest
    checkpoint: the pre-flight and the ranks (choose_checkpoint) name the file and the whole key path and resume
    the intact checkpoint before it, as for NaN or a wrong type; with none before it, one refusal naming them."""
    state = checkpoint_state([])
    root = tmp_path / "checkpoints"
    older = write_checkpoint(root, 2, state)
    bad = json.loads(json.dumps(state))
    entry = bad["constraints"]
    for part in where:
        entry = entry[part]
    entry["lam"] = value
    newest = write_checkpoint(root, 4, bad)
    assert state_problem(older) is None
    why = f"{newest / 'trainer_state.json'} key {key} = {json.dumps(value)} is invalid: allowed {allowed}"
    assert state_problem(newest).startswith(why)
    assert choose_checkpoint(root) == (older, [f"checkpoint {newest} is damaged and skipped: {state_problem(newest)}",
                                               f"resuming from the previous complete checkpoint {older}"])
    (older / "trainer_state.json").unlink()  # no longer complete: nothing to fall back to
    with pytest.raises(ResumeError, match=re.escape(f"cannot resume: {why}")):
        choose_checkpoint(root)


def test_the_range_is_the_saved_states_own_before_and_after_its_first_update():
    """The range comes from the saved state itself, whatever key path holds it (a class, the tail, lambda, a new
    constraint's controller): [floor, ceiling] after an update, [0, ceiling] before (lambda_init may lie below the
    floor), no upper bound without a ceiling; the pid controller's integral term too."""
    from laconic_nemo.core import dual_state_problem

    d = DualController(20, eta=0.5, ceiling=1.5, floor=0.01, init=0.0)
    fresh = d.state_dict()
    assert dual_state_problem(fresh) is None  # 0 < floor before the first update
    d.update(30)
    moved = d.state_dict()
    assert dual_state_problem(moved) is None
    assert dual_state_problem({**moved, "lam": 0.0})[:2] == ("lam", 0.0)  # below the floor after an update
    assert dual_state_problem({**moved, "lam": 1.5}) is None and dual_state_problem({**moved, "lam": 1.6})[0] == "lam"
    assert dual_state_problem({**fresh, "lam": -0.001})[2].startswith("a number in [0, ceiling] = [0.0, 1.5]")
    assert dual_state_problem({**moved, "ceiling": None, "lam": 1e6}) is None  # no upper clip
    assert dual_state_problem({**moved, "ceiling": 0.005})[0] == "ceiling"  # a ceiling below its floor
    pid = DualController(20, eta=0.5, ceiling=1.5, controller="pid", kp=0.1)
    pid.update(30)
    assert dual_state_problem({**pid.state_dict(), "integral": 2.0})[:2] == ("integral", 2.0)
    # held by any saved constraint: a class of bins, the tail
    classes = BudgetClasses([20, 30], [10, 25, 40], eta=0.5, ceiling=1.5)
    classes.update([40, 60, 1, 1, 0, 2])
    saved = classes.state_dict()
    saved["classes"]["25-40"]["dual"]["lam"] = 9.0
    from laconic_nemo.core import classes_state_problem, tail_state_problem

    assert classes_state_problem(saved)[:2] == ("classes.25-40.dual.lam", 9.0)
    tail = TailConstraint(30, 0.2, 0.3, 1.0).state_dict()
    assert tail_state_problem({**tail, "dual": {**tail["dual"], "lam": -1}})[:2] == ("dual.lam", -1)


# ---------------------------------------------------------------- per-prompt budgets turned off
def test_turning_per_prompt_budgets_off_is_decided_before_launch_with_the_classes_named():
    """The checkpoint trained with per-prompt budgets (classes 22 and 40, no state of lambda's controller); this run
    turns them off: refused (pre-flight and ranks run this same restore) naming the classes dropped and the entry that
    says where lambda starts; ``lambda:reset`` starts it at lambda_init; ``class:K=lambda`` takes class K's multiplier
    (offered for a class holding lambda's budget alone)."""
    state = checkpoint_state([])
    off = ["laconic.per_prompt_budget=false", "laconic.lambda_init=0.125"]
    with pytest.raises(ResumeRefused) as caught:
        restore_resume_state("C", state, load_config(STATED, [*BASE, *off,
                                                               "checkpoint.resume_allow_changes=[laconic]"]))
    msg = str(caught.value)
    assert msg.startswith("cannot resume from C: lambda's controller (budget 20) is new: the checkpoint holds no "
                          "state of it (trained with per-prompt budgets: this run drops the multipliers of its budget "
                          "classes 22, 40)"), msg
    assert caught.value.allow == ["laconic", "lambda:reset"]
    cfg = load_config(STATED, [*BASE, *off, "checkpoint.resume_allow_changes=[laconic,lambda:reset]"])
    built = build_constraints(cfg, run_budgets(cfg))
    restore_resume_state("C", state, cfg, built)
    assert built.dual.value == 0.125 and built.classes is None  # laconic.lambda_init; the classes dropped
    # a class of lambda's own budget: offered, and carried (clipped into lambda's [floor, ceiling])
    state20 = checkpoint_state(["data.target_lengths=[20,40]"], moved=0.25)
    off20 = [*off, "data.target_lengths=[20,40]"]
    with pytest.raises(ResumeRefused) as caught:
        restore_resume_state("C", state20, load_config(STATED, [*BASE, *off20,
                                                                 "checkpoint.resume_allow_changes=[laconic]"]))
    assert caught.value.allow == ["laconic", "class:20=lambda"] and "lambda:reset instead" in str(caught.value)
    saved = {k: v["dual"]["lam"] for k, v in state20["constraints"]["classes"]["classes"].items()}
    assert 0.2 < saved["20"] < 0.3 and saved["40"] > 0.2
    for key in ("20", "40"):
        cfg = load_config(STATED, [*BASE, *off20, f"checkpoint.resume_allow_changes=[laconic,class:{key}=lambda]"])
        built = build_constraints(cfg, run_budgets(cfg))
        restore_resume_state("C", state20, cfg, built)
        assert built.dual.value == saved[key]
    cfg = load_config(STATED, [*BASE, *off20, "laconic.ceiling=0.1", "laconic.lambda_init=0.0",
                               "checkpoint.resume_allow_changes=[laconic,class:20=lambda]"])
    built = build_constraints(cfg, run_budgets(cfg))
    restore_resume_state("C", state20, cfg, built)
    assert built.dual.value == 0.1  # clipped into this run's ceiling


# ---------------------------------------------------------------- a suggestion that passes
SUGGESTED = re.compile(r"checkpoint\.resume_allow_changes=\[([^\]]*)\]")


@pytest.mark.parametrize("checkpoint, run, allow", [
    ([], ["data.target_lengths=[25,40]"], "[data.target_lengths,class:22=26]"),  # the loop
    ([], ["data.target_lengths=[25,40]"], "[]"),  # the config refusal names the carry-over too
    ([], ["data.target_lengths=[25,40]", "run.seed=9"], "[run.seed]"),  # what was allowed stays allowed
    ([], ["data.target_lengths=[25,36]"], "[data.target_lengths]"),  # two new, two gone
    ([], ["data.target_lengths=[22,40,44]"], "[data.target_lengths,class:99=44]"),
    ([], ["laconic.tail_budget=32"], "[]"),
    ([], ["laconic.tail_budget=null"], "[]"),
    (["laconic.tail_budget=null"], [], "[laconic.tail_budget,tail:carry]"),  # nothing to carry: reset
    ([], ["laconic.per_prompt_budget=false"], "[]"),
    ([], ["laconic.per_prompt_budget=false"], "[laconic.per_prompt_budget,class:99=lambda]"),
])
def test_a_refusals_suggested_list_passes_when_applied(checkpoint, run, allow):
    """Apply the list a refusal suggests and the resume is accepted (the pre-flight's and the ranks' check,
    restore_resume_state): a carry-over entry that cannot apply is left out of it, the entries allowed before are
    kept, and a refused config change names the carry-over entries it needs at once."""
    state = checkpoint_state(checkpoint)
    with pytest.raises(ResumeError) as caught:
        restore_resume_state("C", state, load_config(STATED, [*BASE, *run, f"checkpoint.resume_allow_changes={allow}"]))
    (suggested,) = SUGGESTED.findall(str(caught.value))
    given = [e for e in allow.strip("[]").split(",") if e]
    assert [e for e in given if e in suggested.split(",")] == [e for e in given if "99" not in e and "26" not in e
                                                                and not (e == "tail:carry" and checkpoint)]
    cfg = load_config(STATED, [*BASE, *run, f"checkpoint.resume_allow_changes=[{suggested}]"])
    restore_resume_state("C", state, cfg)  # accepted


# ---------------------------------------------------------------- the console line with budget classes
def test_the_step_line_shows_the_class_multipliers_and_their_budgets(tmp_path, capsys):
    row = {"step": 1, "lambda": 0.0, "budget": 31.0, "mean_response_length": 28.125, "task_reward": 0.5,
           "frac_over_budget": 0.25, "step_seconds": 0.5, "laconic/lambda/class_22": 0.125,
           "laconic/lambda/class_40": 0.0, "laconic/mu_tail": 0.0625}
    w = MetricsWriter(tmp_path, 0, 0, num_steps=10, log_every=1)
    w.start(0, [])
    w.write(dict(row))
    line = capsys.readouterr().out.strip()
    assert line.startswith("step    1/10 | lambda 22:0.1250 40:0.0000 | mu 0.0625 | mean_len    28.1 (B 22, 40) | ")
    many = {f"laconic/lambda/class_{lo}-{lo + 8}": lo / 100 for lo in range(16, 64, 8)}
    assert multipliers_text({"lambda": 0.0, **many}) == ("lambda 0.1600..0.5600 over 6 classes", "16-64")
    assert multipliers_text({"lambda": 0.03125}) == ("lambda 0.0312", None)  # lambda alone: as before
