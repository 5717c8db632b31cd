"""Dashboards never cost steps or runs, through the real trainer on the reasoning-only recipe
(``tiny_cpu_reasoning.yaml``; one process, TP = 1: the dashboards are rank 0's alone):

* W&B offline and a kill -9 after step 3: W&B's service had written none of steps 1-3 (its run file holds its
  header alone); the resumed session re-sends the rows W&B lacks from metrics.jsonl, so the run's offline files
  hold steps 1-4 once each, with metrics.jsonl's values;
* a bad value in the checkpoint's lambda state (``shaper.dual.lam = "abc"``): named and skipped for the
  previous checkpoint; with nothing intact left, one line and status 2;
* a TensorBoard folder that cannot be written (a read-only tmpfs mounted there) or a W&B folder that is a file:
  refused before the model is loaded (status 2, the folder named); where that check is skipped, training goes on
  without TensorBoard, which is named once on the console and in metrics.jsonl's run notes;
* a full disk during the writes: TensorBoard's folder on a 4 KiB tmpfs (a real ENOSPC once its event file
  outgrows the first page) and W&B's ``Run.log`` monkeypatched in the training process to raise ENOSPC from
  step 2 on: each named once, the run finishes with every row.

The tmpfs mounts run in a private user and mount namespace (``unshare -rm``); those tests are skipped, with the
reason, where the kernel does not allow that.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest

from tests.dashboards import wandb_history, wandb_offline_runs
from tests.test_reliability_e2e import launch, rows, tmpfs_prefix
from tests.test_resume_constraint_state import RANKS_ONLY, edit_state, said
from tests.test_trainer_e2e import FAST, ROOT, strip_timing

pytestmark = pytest.mark.slow

REASONING = str(ROOT / "recipes" / "tiny_cpu_reasoning.yaml")
ARGS = [REASONING, *FAST, "parallel.tensor_model_parallel_size=1", "checkpoint.every_n_steps=2",
        "checkpoint.keep_last=3"]
WANDB = ["logging.wandb=true", "logging.wandb_mode=offline"]
QUIET = {"WANDB_SILENT": "true"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return f"warmup.cache_dir={tmp_path_factory.mktemp('dash_cache')}"


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, cache):
    """4 steps with W&B offline and TensorBoard; the process is killed (SIGKILL) at the start of step 4 (rows 1-3
    written and handed to W&B, checkpoint 2 written), then rerun."""
    pytest.importorskip("wandb")
    out = tmp_path_factory.mktemp("dash") / "run"
    args = [*ARGS, *WANDB, "logging.tensorboard=true", cache, "run.num_steps=4"]
    killed = launch(args, out, fault="generate@4:0:kill", env_extra=QUIET, timeout=400)
    first_files = wandb_offline_runs(out)
    first = {"rc": killed.rc, "rows": rows(out), "history": [wandb_history(f)[1] for f in first_files]}
    rerun = launch(args, out, env_extra=QUIET, timeout=400)
    return out, args, first, rerun


def test_wandb_offline_holds_every_step_after_a_kill_9(killed_and_resumed):
    out, _, first, rerun = killed_and_resumed
    assert first["rc"] == -9 and [r["step"] for r in first["rows"]] == [1, 2, 3]
    assert first["history"] == [[]], "the premise: W&B's service wrote out none of the steps it was handed"
    assert rerun.rc == 0, rerun.out[-3000:]
    assert len(said(rerun, "re-sent steps 1-2 from")) == 1, rerun.out[-3000:]
    history = [h for f in wandb_offline_runs(out) for h in wandb_history(f)[1]]
    jsonl = rows(out)
    assert [h["_step"] for h in history] == [r["step"] for r in jsonl] == [1, 2, 3, 4]
    for h, r in zip(history, jsonl):
        assert (h["lambda"], h["mean_response_length"], h["laconic/reasoning_length_mean"]) == \
            (r["lambda"], r["mean_response_length"], r["laconic/reasoning_length_mean"])
    assert "notes" not in json.dumps(jsonl)  # no dashboard failed


def test_a_bad_lambda_in_the_checkpoint_falls_back_or_is_one_line(killed_and_resumed, tmp_path):
    done, args, _, _ = killed_and_resumed
    out = tmp_path / "run"
    shutil.copytree(done, out)
    ckpt4, ckpt2 = out / "checkpoints" / "step_000004", out / "checkpoints" / "step_000002"
    edit_state(ckpt4, lambda s: s["shaper"]["dual"].update(lam="abc"))
    run = launch(args, out, env_extra={**QUIET, **RANKS_ONLY}, timeout=400)
    assert run.rc == 0 and "Traceback" not in run.out, run.out[-3000:]
    assert (f"checkpoint {ckpt4} is damaged and skipped: {ckpt4 / 'trainer_state.json'} key shaper.dual.lam = "
            "\"abc\" is invalid: allowed a finite number") in run.out
    assert f"resumed from {ckpt2} at step 2" in run.out
    assert [strip_timing(r) for r in rows(out)] == [strip_timing(r) for r in rows(done)]  # 3-4 recomputed
    for ckpt in (ckpt4, ckpt2):
        edit_state(ckpt, lambda s: s["shaper"]["dual"].update(lam="abc"))
    run = launch(args, out, env_extra=QUIET, timeout=120)
    assert run.rc == 2 and "layout:" not in run.out, run.out[-3000:]
    (line,) = said(run, "cannot resume")
    assert line.startswith(f"laconic-nemo train: cannot resume: {ckpt4 / 'trainer_state.json'} key shaper.dual.lam")


def test_a_dashboard_folder_that_cannot_be_written_is_refused_before_the_model_or_skipped(tmp_path, cache):
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    prefix = tmpfs_prefix(out / "tensorboard", "ro,size=4k")
    if not prefix:
        pytest.skip("unshare -rm (user and mount namespaces) is not available to mount a read-only tmpfs")
    args = [*ARGS, "logging.tensorboard=true", cache, "run.num_steps=2", "checkpoint.every_n_steps=0"]
    run = launch(args, out, prefix=prefix, timeout=120)
    assert run.rc == 2 and "layout:" not in run.out, run.out[-3000:]
    (line,) = said(run, "is invalid")
    assert line.startswith(f"laconic-nemo train: logging.tensorboard (its folder, ${{run.output_dir}}/tensorboard; "
                           f"set logging.tensorboard_dir or false) = '{out / 'tensorboard'}' is invalid: cannot "
                           f"write in {out / 'tensorboard'} (Read-only file system)"), line
    # the check skipped (as under a launcher that does not run it): TensorBoard is left out, training goes on
    run = launch(args, out, prefix=prefix, env_extra=RANKS_ONLY, timeout=400)
    assert run.rc == 0 and "Traceback" not in run.out, run.out[-3000:]
    (line,) = said(run, "dashboard TensorBoard")
    assert line.startswith(f"laconic-nemo train: dashboard TensorBoard {out / 'tensorboard'} could not be opened at "
                           "step 1: OSError: [Errno 30] Read-only file system"), line
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2] and got[0]["notes"] == [line[len("laconic-nemo train: "):]]
    assert "notes" not in got[1]
    # the W&B folder taken by a file: refused before the model, the folder named
    other = tmp_path / "other"
    other.mkdir()
    (other / "wandb").write_text("")
    run = launch([*args, *WANDB], other, timeout=120)
    assert run.rc == 2 and "layout:" not in run.out, run.out[-3000:]
    assert f"logging.wandb (its folder, ${{run.output_dir}}/wandb; or logging.wandb=false) = '{other / 'wandb'}' " \
           "is invalid: it is a file, not a folder" in run.out


WANDB_FULL = """
import errno, sys
from wandb.sdk import wandb_run
real = wandb_run.Run.log
def log(self, data, step=None, *args, **kwargs):  # a full disk under W&B's files from step 2 on
    if step is not None and step >= 2:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, data, step=step, *args, **kwargs)
wandb_run.Run.log = log
from laconic_nemo.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_under_the_dashboards_is_named_once_and_training_goes_on(tmp_path, cache):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    prefix = tmpfs_prefix(out / "tensorboard", "size=4k")
    if not prefix:
        pytest.skip("unshare -rm (user and mount namespaces) is not available to mount a small tmpfs")
    args = [*ARGS, *WANDB, "logging.tensorboard=true", cache, "run.num_steps=3", "checkpoint.every_n_steps=0"]
    run = launch(args, out, prefix=prefix, python=("-c", WANDB_FULL), env_extra=QUIET, timeout=400)
    assert run.rc == 0 and "Traceback" not in run.out, run.out[-3000:]
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3]
    notes = {r["step"]: r.get("notes", []) for r in got}
    no_space = f"OSError: [Errno {errno.ENOSPC}] No space left on device"
    (tb,) = said(run, "dashboard TensorBoard")
    (wb,) = said(run, "dashboard W&B run")
    assert f"dashboard TensorBoard {out / 'tensorboard'} (tensorboard --logdir " in tb and no_space in tb, tb
    assert "failed writing at step 2: " + no_space in wb, wb
    tb_step = int(tb.split("failed writing at step ")[1].split(":")[0])
    assert 1 <= tb_step <= 3
    assert tb[len("laconic-nemo train: "):] in notes[tb_step] and wb[len("laconic-nemo train: "):] in notes[2]
    assert sum(len(n) for n in notes.values()) == 2  # each named once
    history = [h for f in wandb_offline_runs(out) for h in wandb_history(f)[1]]
    assert [h["_step"] for h in history] == [1]  # what W&B got before its disk filled


def _full_tmpfs_prefix(folder, pages: int, leave: int, fill_when_stopped: bool = False) -> tuple:
    """A command prefix that runs the rest with a tmpfs of ``pages`` memory pages mounted at ``folder``, filled but
    for ``leave`` pages; ``fill_when_stopped``: filled only once the command's process has stopped itself (a fault
    point's SIGSTOP), then continued. () where this kernel does not allow the mount."""
    page = os.sysconf("SC_PAGE_SIZE")
    if not tmpfs_prefix(folder, f"size={pages * page}"):
        return ()
    fill = f'head -c {(pages - leave) * page} /dev/zero > "$0/filler" 2>/dev/null'
    if fill_when_stopped:  # the command keeps this shell's pid ($$) once it is exec-ed
        fill = (f'(pid=$$; while [ -d /proc/$pid ] && [ "$(sed "s/.*) //" /proc/$pid/stat | cut -c1)" != T ]; '
                f'do sleep 0.2; done; {fill}; kill -CONT $pid) &')
    else:
        fill += ";"
    return ("unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size={pages * page} tmpfs "$0" && {fill} exec "$@"',
            str(folder))


def test_a_full_disk_under_wandb_is_named_once_without_its_loggers_tracebacks(tmp_path, cache):
    """``<output_dir>/wandb`` on a real full tmpfs: W&B reports nothing itself (its service writes a run file of 0
    bytes, its own logger printed a traceback for each of its lines, 116 for a short run, and no line named W&B).
    Full from the start (one page left: the run id's file takes it): named once, "could not be opened at step 1",
    in row 1's notes. Filled while the process is stopped at the start of step 3 (a fault point; then continued):
    named once, "failed writing at step 3", in row 3's notes. Every row written, status 0, no traceback."""
    pytest.importorskip("wandb")
    args = [*ARGS, *WANDB, "logging.tensorboard=false", cache, "run.num_steps=4", "checkpoint.every_n_steps=0"]
    full, fills = tmp_path / "full" / "run", tmp_path / "fills" / "run"
    for out in (full, fills):
        (out / "wandb").mkdir(parents=True)
    cases = [(full, _full_tmpfs_prefix(full / "wandb", pages=16, leave=1), None, "could not be opened", 1),
             (fills, _full_tmpfs_prefix(fills / "wandb", pages=256, leave=0, fill_when_stopped=True),
              "generate@3:0:stop", "failed writing", 3)]
    if not cases[0][1]:
        pytest.skip("unshare -rm (user and mount namespaces) is not available to mount a small tmpfs")
    no_space = f"OSError: [Errno {errno.ENOSPC}] No space left on device"
    for out, prefix, fault, what, step in cases:
        run = launch(args, out, prefix=prefix, fault=fault, timeout=400)  # W&B's own console lines kept
        assert run.rc == 0, run.out[-3000:]
        assert "Traceback" not in run.out and "Logging error" not in run.out, run.out[-3000:]
        (line,) = said(run, "dashboard W&B")
        assert line.startswith("laconic-nemo train: dashboard W&B run ") and f" {what} at step {step}: {no_space}" \
            in line and line.endswith("training goes on without it for the rest of this session"), line
        got = rows(out)
        assert [r["step"] for r in got] == [1, 2, 3, 4]
        assert {r["step"]: r["notes"] for r in got if "notes" in r} == {step: [line[len("laconic-nemo train: "):]]}
