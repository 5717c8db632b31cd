"""The metrics writer's dashboards in one process: TensorBoard event files and W&B offline runs read back with
their own readers (tests/dashboards.py), a resume after a crash past the last checkpoint (no duplicate steps),
the progress line's ETA, and the refusal of a dashboard whose package is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from laconic_nemo.config import ConfigError, load_config
from laconic_nemo.grpo import metrics as M
from tests.dashboards import tensorboard_scalars, tensorboard_texts, wandb_history, wandb_offline_runs

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny_cpu.yaml"


def row(step: int, run: int) -> dict:
    """A metrics.jsonl row of step ``step`` (values differ between ``run`` 0 and 1)."""
    lam = 0.01 * step + 0.1 * run
    return {"step": step, "lambda": lam, "lambda_next": lam + 0.01, "mean_response_length": 40.0 - step + 0.5 * run,
            "budget": 31.0, "task_reward": 0.5 + 0.01 * step, "frac_over_budget": 0.25, "shaper/mean_cost": 0.1,
            "reward/accuracy": 0.5, "train/loss": -0.01 * step, "step_seconds": 1.0, "time/generate": 0.5,
            "sample_response": f"a3:3,\\boxed{{{step}}} run {run}"}


def crash_and_resume(tmp_path: Path, sinks, steps_before: int, checkpoint: int, steps_after: int, die=None):
    """Run 0 writes steps 1..steps_before and dies without closing the writer (its last checkpoint: step
    ``checkpoint``; ``die(sinks)`` ends what a dying process would take with it); run 1 resumes at
    ``checkpoint`` and writes up to ``steps_after``."""
    first = M.MetricsWriter(tmp_path, 0, 0, steps_after, log_every=1)
    first.start(0, sinks(0))
    for s in range(1, steps_before + 1):
        first.write(row(s, 0))
    if die is not None:
        die(first.sinks)
    second = M.MetricsWriter(tmp_path, 0, 0, steps_after, log_every=1)
    second.start(checkpoint, sinks(checkpoint))
    for s in range(checkpoint + 1, steps_after + 1):
        second.write(row(s, 1))
    second.close()
    return [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_resume_after_a_crash_shows_each_step_once(tmp_path):
    """Run 0 sent steps 1..5 and died; its last checkpoint is step 3. The resumed run writes steps 4..6 again.
    TensorBoard's reader gives every metric of metrics.jsonl once per step 1..6: 1..3 from run 0, 4..6 from the
    resumed run (the later write; purge_step = 4), equal to metrics.jsonl (float32, TensorBoard's scalar)."""
    pytest.importorskip("tensorboard")
    logdir = tmp_path / "tb"
    rows = crash_and_resume(tmp_path, lambda k: [M.TensorBoardSink(logdir, k)], 5, 3, 6)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    scalars = tensorboard_scalars(logdir)
    numeric = {k for k, v in rows[0].items() if isinstance(v, float)}
    assert set(scalars) == numeric  # every number of a row, nothing else ("step" is the x axis)
    for tag in numeric:
        assert scalars[tag] == [(r["step"], float(np.float32(r[tag]))) for r in rows], tag
    assert scalars["lambda"][4][1] == pytest.approx(0.15)  # step 5 from the resumed run, not run 0's 0.05
    assert tensorboard_texts(logdir, "sample_response") == [(r["step"], r["sample_response"]) for r in rows]


def test_tensorboard_without_the_restart_marker_would_show_two_values_for_a_step(tmp_path, monkeypatch):
    """The reason for the restart markers: without them TensorBoard's server keeps both writes of steps 4, 5."""
    pytest.importorskip("tensorboard")
    monkeypatch.setattr(M, "purge_step", lambda resume_step: None)
    logdir = tmp_path / "tb"
    crash_and_resume(tmp_path, lambda k: [M.TensorBoardSink(logdir, k)], 5, 3, 6)
    assert [s for s, _ in tensorboard_texts(logdir, "sample_response")].count(4) == 2


def die_wandb(sink):
    """What the end of a crashed process does to its W&B run: the run ends with a failure status, W&B's service
    writes out what it holds."""
    import wandb

    sink.run.finish(exit_code=1)
    wandb.teardown()


def test_wandb_offline_resume_continues_the_run_without_duplicate_steps(tmp_path, monkeypatch):
    """W&B in offline mode: both processes log to the same run id; the resumed run sends only the steps W&B does
    not hold yet (6), so the run's history holds steps 1..6 once each, read back from the offline run files."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = crash_and_resume(tmp_path, lambda k: [M.WandbSink(tmp_path, "laconic-test", "tiny", "offline")], 5, 3, 6,
                            die=lambda sinks: die_wandb(sinks[0]))
    files = wandb_offline_runs(tmp_path)
    assert len(files) == 2
    ids, history = set(), []
    for f in files:
        run_id, h = wandb_history(f)
        ids.add(run_id)
        history += h
    assert len(ids) == 1 and json.loads((tmp_path / "wandb" / M.WANDB_STATE).read_text())["id"] in ids
    assert [h["_step"] for h in history] == [1, 2, 3, 4, 5, 6]
    jsonl = {r["step"]: r for r in rows}
    for h in history:
        s = h["_step"]
        expected = row(s, 0) if s <= 5 else jsonl[s]  # 4, 5: the first write stays (W&B cannot rewrite a step)
        assert h["lambda"] == expected["lambda"] and h["mean_response_length"] == expected["mean_response_length"]
        assert {k for k in h if not k.startswith("_")} == {k for k, v in expected.items() if isinstance(v, float)}


def test_eta_from_the_mean_step_time(monkeypatch):
    """ETA = elapsed / steps done since this process started * steps left (a resumed run counts from its start)."""
    now = [100.0]
    monkeypatch.setattr(M.time, "monotonic", lambda: now[0])
    clock = M.ProgressClock(start_step=20, total=70)
    assert clock.eta(20) == "?"
    now[0] += 50.0  # 10 steps in 50 s
    assert clock.eta(30) == "3m20s"  # 5 s x 40 steps left
    now[0] += 3550.0
    assert clock.eta(60) == "15m00s"  # 3600 s / 40 steps x 10 steps left
    long = M.ProgressClock(start_step=0, total=1000)
    now[0] += 100.0
    assert long.eta(10) == "2h45m" and long.eta(1000) == "0s"  # 10 s x 990 steps = 9900 s
    assert M.format_duration(9.4) == "9s" and M.format_duration(75) == "1m15s" and M.format_duration(3725) == "1h02m"


def test_progress_line_ends_with_the_eta(tmp_path, capsys):
    w = M.MetricsWriter(tmp_path, 0, 0, num_steps=10, log_every=1)
    w.start(0, [])
    w.write(row(1, 0))
    line = capsys.readouterr().out.strip()
    assert line.startswith("step    1/10 | lambda 0.0100 | mean_len    39.0 (B 31) |") and " | eta " in line


def test_a_dashboard_without_its_package_is_refused_before_the_run(monkeypatch):
    cfg = load_config(TINY, ["logging.tensorboard=true", "logging.wandb=true"])
    monkeypatch.setattr(M.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="logging.tensorboard = true needs the tensorboard package"):
        M.check_sinks(cfg)
    with pytest.raises(ConfigError, match="logging.wandb = true needs the wandb package"):
        M.check_sinks(load_config(TINY, ["logging.tensorboard=false", "logging.wandb=true"]))
    assert M.tensorboard_enabled(load_config(TINY, []).logging) is False  # null: on only where installed
    M.check_sinks(load_config(TINY, []))  # the defaults need nothing
    with pytest.raises(ConfigError, match="logging.wandb_mode = 'cloud' is invalid"):
        load_config(TINY, ["logging.wandb_mode=cloud"])


def test_wandb_resend_the_rows_it_does_not_hold(tmp_path, monkeypatch):
    """W&B held none of run 0's steps (its service died with the process: here its offline run is removed); the
    resumed run re-sends rows 1..3 of metrics.jsonl before its own steps 4..6, each once."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")

    def lose(sinks):
        die_wandb(sinks[0])
        for f in wandb_offline_runs(tmp_path):
            shutil.rmtree(f.parent)

    rows = crash_and_resume(tmp_path, lambda k: [M.WandbSink(tmp_path, "laconic-test", "tiny", "offline")], 5, 3, 6,
                            die=lose)
    history = [h for f in wandb_offline_runs(tmp_path) for h in wandb_history(f)[1]]
    assert [h["_step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert [h["lambda"] for h in history] == [r["lambda"] for r in rows]  # 1-3 from metrics.jsonl, 4-6 the resumed


class _Broken:
    """A dashboard whose writes fail from step ``at`` on (a full disk)."""

    def __init__(self, at: int):
        self.at, self.got = at, []

    def describe(self):
        return "Broken /full"

    def log(self, step, scalars, texts):
        if step >= self.at:
            raise OSError(28, "No space left on device")
        self.got.append(step)

    def close(self):
        raise AssertionError("a failed dashboard is not closed")


def test_a_failing_dashboard_is_named_once_and_the_others_go_on(tmp_path, capsys):
    broken, fine = _Broken(2), _Broken(99)
    fine.close = lambda: None
    w = M.MetricsWriter(tmp_path, 0, 0, num_steps=4, log_every=10)
    w.start(0, [broken, M.FailedSink("Gone /ro", PermissionError(13, "Permission denied")), fine])
    for s in range(1, 5):
        w.write(row(s, 0))
    w.close()
    err = capsys.readouterr().err.splitlines()
    assert err == ["laconic-nemo train: dashboard Gone /ro could not be opened at step 1: PermissionError: [Errno 13] "
                   "Permission denied; training goes on without it for the rest of this session",
                   "laconic-nemo train: dashboard Broken /full failed writing at step 2: OSError: [Errno 28] No space "
                   "left on device; training goes on without it for the rest of this session"]
    got = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3, 4] and broken.got == [1] and fine.got == [1, 2, 3, 4]
    assert got[0]["notes"] == [err[0][len("laconic-nemo train: "):]] and got[1]["notes"] == [err[1][20:]]
    assert "notes" not in got[2] and "notes" not in got[3]
