"""A resume of the per-prompt-budget and tail constraints through the real trainer (2 ranks, TP = 2 over gloo):
each budget class is restored by its key and the tail constraint by its settings, a difference is refused before
launch unless ``checkpoint.resume_allow_changes`` says how to carry it over, and a bad value inside a
checkpoint's state ends in one line naming the file and the key, or falls back to the previous checkpoint.

One run of ``tiny_cpu_stated.yaml`` with stated budgets 22 and 40 and a tail constraint (checkpoints after steps 2
and 4); each probe works on a copy of its folder, ``trainer_state.json`` edited with its manifest updated to match
(size and CRC-32), as a hand edit that keeps the checkpoint "intact" would:

* class 22 removed from step 4's state: refused before launch (status 2, one line naming class 22, the checkpoint
  and ``class:new``); the same check in the ranks (the pre-flight skipped) gives the same one line; with
  ``class:new`` the run resumes, class 22 at lambda_init and class 40 with its own multiplier (zip by position
  gave class 22 the multiplier of class 40);
* a changed set of budgets (``data.target_lengths=[22,36]``) and a changed tail constraint: refused naming the
  keys and the entries that carry them over;
* the list form of older checkpoints: read when unambiguous; with its first multiplier removed it is named and
  refused (no intact checkpoint left);
* ``"abc"`` as class 40's multiplier: named, skipped, the run resumes from step 2 and recomputes steps 3-4 bit for
  bit; ``"0.3"`` as mu with ``constraints: null`` in step 2: one line, status 2, in the ranks too.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import pytest

from tests.test_reliability_e2e import launch, rows
from tests.test_trainer_e2e import FAST, ROOT, strip_timing

pytestmark = pytest.mark.slow

STATED = str(ROOT / "recipes" / "tiny_cpu_stated.yaml")
ARGS = [STATED, *FAST, "data.target_lengths=[22,40]", "rollout.max_new_tokens=48", "laconic.ceiling=2.0", "laconic.tail_budget=30",
        "laconic.tail_share=0.2", "laconic.tail_eta=0.3", "run.num_steps=4", "checkpoint.every_n_steps=2",
        "checkpoint.keep_last=3", "logging.tensorboard=false"]
RANKS_ONLY = {"LACONIC_PREFLIGHT_DONE": "1"}  # the launcher skips its pre-flight: the ranks' own checks decide


def edit_state(ckpt: Path, edit) -> None:
    """Edit ``ckpt``'s trainer_state.json in place and update its manifest to match (size and CRC-32)."""
    path = ckpt / "trainer_state.json"
    state = json.loads(path.read_text())
    edit(state)
    data = json.dumps(state, indent=1).encode()
    path.write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["trainer_state.json"] = {"size": len(data), "crc32": zlib.crc32(data)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def any_rank(line: str) -> str:
    """``line`` with the rank that printed it as ``R`` (whichever rank's identical line came first is printed)."""
    return re.sub(r"^laconic-nemo train: rank \d+: ", "laconic-nemo train: rank R: ", line)


def said(run, text: str) -> list[str]:
    """The lines of the run's output that hold ``text``."""
    return [line for line in run.out.splitlines() if text in line]


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """The uninterrupted run: 4 steps, checkpoints after steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("constraint_state")
    out = tmp / "full"
    run = launch([*ARGS, f"warmup.cache_dir={tmp / 'cache'}"], out, timeout=600)
    assert run.rc == 0, run.out[-3000:]
    (tmp / "full.out").write_text(run.out)
    return tmp, out


def probe(done, name: str) -> tuple[Path, list[str]]:
    """A copy of the finished run to probe, and the arguments that continue it."""
    tmp, out = done
    copy = tmp / name
    shutil.copytree(out, copy)
    return copy, [*ARGS, f"warmup.cache_dir={tmp / 'cache'}"]


def saved_lams(ckpt: Path) -> dict[str, float]:
    state = json.loads((ckpt / "trainer_state.json").read_text())["constraints"]
    return {**{k: v["dual"]["lam"] for k, v in state["classes"]["classes"].items()},
            "tail": state["tail"]["dual"]["lam"]}


def test_a_class_missing_from_the_checkpoint_is_refused_and_carried_over_by_key(done):
    out, args = probe(done, "missing_class")
    ckpt = out / "checkpoints" / "step_000004"
    lams = saved_lams(ckpt)
    edit_state(ckpt, lambda s: s["constraints"]["classes"]["classes"].pop("22"))
    for env, prefix in (({}, "laconic-nemo train: cannot resume"), (RANKS_ONLY, "laconic-nemo train: rank R: "
                                                                                "cannot resume")):
        run = launch([*args, "run.num_steps=5"], out, env_extra=env, timeout=300)
        assert run.rc == 2, run.out[-3000:]
        lines = [any_rank(line) for line in said(run, "cannot resume")]  # the ranks' identical lines: printed once
        assert len(lines) == 1 and lines[0].startswith(prefix), run.out[-3000:]
        assert f"cannot resume from {ckpt}: the budget classes differ" in lines[0] and "class 22 is new" in lines[0]
        assert "checkpoint.resume_allow_changes=[class:new]" in lines[0]
        assert "Traceback" not in run.out and ("launching" not in run.out) == (not env)
    run = launch([*args, "run.num_steps=5", "checkpoint.resume_allow_changes=[class:new]"], out, timeout=300)
    assert run.rc == 0 and f"resumed from {ckpt} at step 4" in run.out, run.out[-3000:]
    step5 = rows(out)[-1]
    assert step5["step"] == 5
    assert step5["laconic/lambda/class_22"] == 0.0  # laconic.lambda_init: the checkpoint has no class 22
    assert step5["laconic/lambda/class_40"] == lams["40"] and step5["laconic/mu_tail"] == lams["tail"]
    # the resumed line names the multipliers the run continues with: each class's and mu (lambda is unused)
    assert (f"resumed from {ckpt} at step 4 (lambda 22:0.000000 40:{lams['40']:.6f} | mu {lams['tail']:.6f}; "
            "B 22, 40)") in run.out, run.out[-3000:]


def test_a_changed_set_of_budgets_or_tail_is_refused_naming_the_keys(done):
    out, args = probe(done, "changed")
    ckpt = out / "checkpoints" / "step_000004"
    run = launch([*args, "data.target_lengths=[22,36]", "checkpoint.resume_allow_changes=[data.target_lengths]"],
                 out, timeout=120)
    assert run.rc == 2 and "launching" not in run.out, run.out[-3000:]
    (line,) = said(run, "cannot resume")
    assert line.startswith(f"laconic-nemo train: cannot resume from {ckpt}: the budget classes differ: the "
                           "checkpoint has 22, 40, this run 22, 36: class 36 is new"), line
    assert "class 40 of the checkpoint is gone" in line
    assert "checkpoint.resume_allow_changes=[data.target_lengths,class:40=36]" in line
    run = launch([*args, "laconic.tail_budget=32", "checkpoint.resume_allow_changes=[laconic.tail_budget]"], out,
                 timeout=120)
    assert run.rc == 2 and "launching" not in run.out, run.out[-3000:]
    (line,) = said(run, "cannot resume")
    assert ("the tail constraint differs: the checkpoint has the tail constraint B_tail=30,q=0.2, this run "
            "B_tail=32,q=0.2") in line
    assert "checkpoint.resume_allow_changes=[laconic.tail_budget,tail:carry]" in line and "tail:reset" in line


def _list_form(state: dict, drop_first: bool = False) -> None:
    """The classes' state as older checkpoints wrote it: names, budgets, edges and a list of multipliers."""
    keyed = state["constraints"]["classes"]
    names = sorted(keyed["classes"], key=float)
    duals = [keyed["classes"][n]["dual"] for n in names]
    state["constraints"]["classes"] = {"budgets": [float(n) for n in names], "edges": None, "names": names,
                                       "duals": duals[1:] if drop_first else duals}


def test_the_list_form_of_older_checkpoints_is_read_only_when_unambiguous(done):
    out, args = probe(done, "list_form")
    ckpt = out / "checkpoints" / "step_000004"
    lams = saved_lams(ckpt)
    edit_state(ckpt, _list_form)
    run = launch([*args, "run.num_steps=5"], out, timeout=300)
    assert run.rc == 0 and f"resumed from {ckpt} at step 4" in run.out, run.out[-3000:]
    step5 = rows(out)[-1]
    assert (step5["laconic/lambda/class_22"], step5["laconic/lambda/class_40"]) == (lams["22"], lams["40"])
    # the probe: the first multiplier removed, names and manifest kept: which class is it for? Named, and
    # with step 2 also bad (no state of its constraints) there is nothing intact to fall back to
    out, args = probe(done, "list_form_short")
    ckpt = out / "checkpoints" / "step_000004"
    edit_state(ckpt, lambda s: _list_form(s, drop_first=True))
    edit_state(out / "checkpoints" / "step_000002", lambda s: s.update(constraints=None))
    run = launch(args, out, timeout=120)
    assert run.rc == 2 and "launching" not in run.out, run.out[-3000:]
    (line,) = said(run, "cannot resume")
    assert line == (f"laconic-nemo train: cannot resume: {ckpt / 'trainer_state.json'} key constraints.classes.duals = "
                    "\"a list of 1\" is invalid: allowed one multiplier per class of 'names' (2: 22, 40; else which "
                    "belongs to which class is ambiguous); no intact checkpoint to fall back to (step_000002 damaged "
                    "too): repair the value, or move the checkpoint folders aside to start over"), line


def test_a_bad_value_in_the_state_falls_back_to_the_previous_checkpoint_in_the_ranks(done):
    """``"abc"`` as class 40's multiplier in step 4: every rank names it and skips it, the run resumes from step 2
    and recomputes steps 3-4 as the uninterrupted run did (timings aside)."""
    tmp, full = done
    out, args = probe(done, "abc")
    ckpt = out / "checkpoints" / "step_000004"
    edit_state(ckpt, lambda s: s["constraints"]["classes"]["classes"]["40"]["dual"].update(lam="abc"))
    run = launch(args, out, env_extra=RANKS_ONLY, timeout=400)
    assert run.rc == 0, run.out[-3000:]
    assert (f"checkpoint {ckpt} is damaged and skipped: {ckpt / 'trainer_state.json'} key "
            "constraints.classes.classes.40.dual.lam = \"abc\" is invalid: allowed a finite number") in run.out
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in run.out and "Traceback" not in run.out
    assert [strip_timing(r) for r in rows(out)] == [strip_timing(r) for r in rows(full)]


def test_a_bad_value_with_nothing_to_fall_back_to_is_one_line_and_status_2_in_the_ranks(done):
    out, args = probe(done, "mu")
    ckpt = out / "checkpoints" / "step_000004"
    edit_state(ckpt, lambda s: s["constraints"]["tail"]["dual"].update(lam="0.3"))
    edit_state(out / "checkpoints" / "step_000002", lambda s: s.update(constraints=None))
    run = launch(args, out, env_extra=RANKS_ONLY, timeout=300)
    assert run.rc == 2, run.out[-3000:]
    lines = [any_rank(line) for line in run.out.splitlines() if line.startswith("laconic-nemo train:")]
    assert lines == [f"laconic-nemo train: rank R: cannot resume: {ckpt / 'trainer_state.json'} key "
                     "constraints.tail.dual.lam = \"0.3\" is invalid: allowed a finite number; no intact checkpoint "
                     "to fall back to (step_000002 damaged too): repair the value, or move the checkpoint folders "
                     "aside to start over"], run.out[-3000:]
    assert "Traceback" not in run.out


def test_the_step_lines_show_the_class_multipliers_and_budgets(done):
    """The console's step line of the stated recipe: each class's multiplier used in the step, mu, and the classes'
    budgets (not lambda, unused with budget classes, nor laconic.budget)."""
    tmp, out = done
    lines = [line for line in (tmp / "full.out").read_text().splitlines() if line.startswith("step ")]
    got = rows(out)
    assert len(lines) == len(got) == 4
    for line, r in zip(lines, got):
        assert line.startswith(f"step {r['step']:>4}/4 | lambda 22:{r['laconic/lambda/class_22']:.4f} "
                               f"40:{r['laconic/lambda/class_40']:.4f} | mu {r['laconic/mu_tail']:.4f} | mean_len "
                               f"{r['mean_response_length']:7.1f} (B 22, 40) | "), line


def test_a_multiplier_outside_its_range_is_named_and_skipped_for_the_previous_checkpoint(done):
    """Class 22's multiplier -0.5 in step 4 (its state's floor is 0): the pre-flight names the file and the whole key
    path, skips it and the ranks resume step 2, recomputing steps 3-4 bit for bit (before: refused, status 2, naming
    neither the file nor which multiplier)."""
    tmp, full = done
    out, args = probe(done, "range")
    ckpt = out / "checkpoints" / "step_000004"
    edit_state(ckpt, lambda s: s["constraints"]["classes"]["classes"]["22"]["dual"].update(lam=-0.5))
    run = launch(args, out, timeout=400)
    assert run.rc == 0 and "Traceback" not in run.out, run.out[-3000:]
    assert (f"laconic-nemo train: checkpoint {ckpt} is damaged and skipped: {ckpt / 'trainer_state.json'} key "
            "constraints.classes.classes.22.dual.lam = -0.5 is invalid: allowed a number in [floor, ceiling] = "
            "[0.0, 2.0]") in run.out, run.out[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in run.out
    assert [strip_timing(r) for r in rows(out)] == [strip_timing(r) for r in rows(full)]


def test_turning_per_prompt_budgets_off_is_refused_before_launch_then_carried(done):
    """``laconic.per_prompt_budget=false`` on the stated run (allowed as a config change): before, the pre-flight
    passed and each rank refused after start-up (``shaper state for 'laconic' is missing key 'dual'``). Now the
    pre-flight refuses, one line naming the classes dropped and the entry to write; with ``class:40=lambda`` the
    run resumes, lambda's controller taking class 40's multiplier."""
    out, args = probe(done, "per_prompt_off")
    ckpt = out / "checkpoints" / "step_000004"
    lams = saved_lams(ckpt)
    off = [*args, "run.num_steps=5", "laconic.per_prompt_budget=false"]
    run = launch([*off, "checkpoint.resume_allow_changes=[laconic.per_prompt_budget]"], out, timeout=120)
    assert run.rc == 2 and "launching" not in run.out, run.out[-3000:]
    (line,) = said(run, "cannot resume")
    assert line == (f"laconic-nemo train: cannot resume from {ckpt}: lambda's controller (budget 20) is new: the "
                    "checkpoint holds no state of it (trained with per-prompt budgets: this run drops the multipliers "
                    "of its budget classes 22, 40). To carry the state over, resume with "
                    "checkpoint.resume_allow_changes=[laconic.per_prompt_budget,lambda:reset] (how each entry carries "
                    "it: docs/reliability.md), or with the checkpoint's settings"), line
    run = launch([*off, "checkpoint.resume_allow_changes=[laconic.per_prompt_budget,class:40=lambda]"], out,
                 timeout=400)
    assert run.rc == 0 and f"resumed from {ckpt} at step 4 (lambda {lams['40']:.6f}" in run.out, run.out[-3000:]
    step5 = rows(out)[-1]
    assert step5["step"] == 5 and step5["lambda"] == lams["40"] and "laconic/lambda/class_40" not in step5

