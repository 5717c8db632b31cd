"""Fault injection on real runs of the tiny recipe (2 ranks, TP = 2 over gloo): nothing lost, nothing hung.

One output folder goes through a chain of real faults, each run resuming the previous one (see
docs/reliability.md for the matrix); the tests below check one issue each on the recorded outcomes:

R0  SIGTERM to the launcher while the ranks start up          -> exit 3, nothing written
R1  SIGUSR1 to rank 1 at warm-up step 8 (fault point)         -> exit 3, warm-up progress saved
R2  SIGKILL of rank 0 inside the first checkpoint (tmp written)-> rank named; warm-up continued, not redone
R3  rerun; SIGKILL of rank 0 right after checkpoint 2          -> the .tmp is ignored; row 2 kept
R4  rerun; rank 0 dies half-way through writing row 3          -> a torn last line
    (probes: changed config / resume=never / a corrupt middle line are refused before any rank starts)
R5  rerun; SIGSTOP of rank 1 at the start of step 3            -> after 30 s the watchdog names rank 1, exit 4
R6  plain rerun                                                -> steps [1, 2, 3]; summary over all steps

Fault points are armed with LACONIC_FAULT (laconic_nemo/faults.py); signals go to real processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_trainer_e2e import FAST, ROOT, TINY, clean_env

pytestmark = pytest.mark.slow

BASE = [TINY, *FAST, "warmup.num_steps=20", "run.num_steps=3", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3"]


class Run:
    def __init__(self, rc: int, out: str, seconds: float):
        self.rc, self.out, self.seconds = rc, out, seconds


def launch(args, out: Path, fault: str | None = None, timeout: float = 240, signal_on: tuple | None = None) -> Run:
    """Run `laconic-nemo train` in its own session; ``signal_on = (text, signum)`` sends ``signum`` to the
    launcher once ``text`` appears in its output. Output is stdout and stderr together."""
    env = clean_env()
    if fault:
        env["LACONIC_FAULT"] = fault
    cmd = [sys.executable, "-m", "laconic_nemo", "train", *args, f"run.output_dir={out}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if signal_on and signal_on[0] in line:
                proc.send_signal(signal_on[1])
                signal_on = None
            if time.monotonic() - t0 > timeout:
                raise TimeoutError
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except (TimeoutError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"no exit within {timeout} s:\n{''.join(lines)[-3000:]}")
    with (out.parent / "runs.log").open("a") as log:
        log.write(f"==== {' '.join(cmd[3:])} (fault {fault}) -> {proc.returncode}\n{''.join(lines)}\n")
    return Run(proc.returncode, "".join(lines), time.monotonic() - t0)


def ls(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def rows(out: Path) -> list[dict]:
    """The complete rows (a torn last line left out)."""
    from laconic_nemo.grpo.resume import read_metrics

    return read_metrics(out / "metrics.jsonl")[0]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    out, cache = tmp / "run", tmp / "cache"
    args = [*BASE, f"warmup.cache_dir={cache}"]
    r = {"out": out, "cache": cache, "args": args}
    r[0] = launch(args, out, signal_on=("launching 2 local ranks", signal.SIGTERM))
    r["after0"] = ls(out)
    r[1] = launch(args, out, fault="warmup_step@8:1:usr1")
    partial = list(cache.glob("*.partial"))
    r["partial"] = json.loads((partial[0] / "progress.json").read_text()) if partial else None
    r[2] = launch(args, out, fault="checkpoint_written@1:0:kill")
    r["after2"] = ls(out / "checkpoints")
    r[3] = launch(args, out, fault="after_checkpoint@2:0:kill")
    r["rows3"] = rows(out)
    r[4] = launch(args, out, fault="metrics_torn@3:0:kill")
    r["text4"] = (out / "metrics.jsonl").read_text()
    # refused before any rank starts: each must leave the folder as it is
    r["changed"] = launch([*args, "run.seed=8", "grpo.group_size=2"], out, timeout=60)
    r["never"] = launch([*args, "checkpoint.resume=never"], out, timeout=60)
    good = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text('{"step": 1, "lambda": 0.0\n' + good.split("\n", 1)[1])
    r["corrupt"] = launch(args, out, timeout=60)
    (out / "metrics.jsonl").write_text(good)
    r["text_after_probes"] = (out / "metrics.jsonl").read_text()
    r[5] = launch([*args, "parallel.watchdog_s=30"], out, fault="generate@3:1:stop")
    r["rows5"] = rows(out)
    r[6] = launch(args, out)
    r["rows6"] = rows(out)
    return r


def test_signal_during_start_up_exits_3_without_losing_anything(chain):
    run = chain[0]
    assert run.rc == 3, run.out[-3000:]
    assert "during start-up" in run.out
    assert "metrics.jsonl" not in chain["after0"]


def test_signal_during_warm_up_saves_it_and_the_rerun_continues_it(chain):
    run = chain[1]
    assert run.rc == 3, run.out[-3000:]
    assert "during the warm-up" in run.out
    done = chain["partial"]
    assert done is not None and 8 <= done["step"] < 20, done
    assert f"continuing the interrupted warm-up at step {done['step'] + 1}/20" in chain[2].out
    assert not list(chain["cache"].glob("*.partial"))  # finished warm-ups drop their partial copy


def test_launcher_names_the_dead_rank_and_its_signal(chain):
    for k in (2, 3):
        run = chain[k]
        assert run.rc not in (0, 3), run.out[-3000:]
        assert "rank 0 (pid" in run.out and "was killed by signal SIGKILL" in run.out, run.out[-3000:]


def test_kill_inside_the_first_checkpoint_leaves_a_resumable_run(chain):
    assert "continuing the interrupted warm-up" in chain[2].out, chain[2].out[-3000:]
    assert "step_000001.tmp" in chain["after2"] and "latest" not in chain["after2"]
    run = chain[3]
    assert "resumed from" not in run.out  # no complete checkpoint: a fresh start, not the .tmp
    assert "step    1/3" in run.out and "step    2/3" in run.out, run.out[-3000:]  # it trained, from step 1


def test_row_written_before_the_checkpoint_survives_a_crash_between_them(chain):
    assert [r["step"] for r in chain["rows3"]] == [1, 2]
    assert [r["step"] for r in chain["rows6"]] == [1, 2, 3]
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "step_seconds"))}  # noqa: E731
    assert [strip(r) for r in chain["rows6"][:2]] == [strip(r) for r in chain["rows3"]]


def test_torn_last_metrics_line_is_repaired_and_corruption_is_named(chain):
    text = chain["text4"]
    assert not text.endswith("\n")  # the fault left half a row
    last = text.rsplit("\n", 1)[1]
    with pytest.raises(ValueError):
        json.loads(last)
    bad = chain["corrupt"]
    assert bad.rc == 2 and "metrics.jsonl line 1" in bad.out and "launching" not in bad.out, bad.out[-2000:]
    assert "dropped a torn last line" in chain[5].out
    assert [r["step"] for r in chain["rows5"]] == [1, 2]


def test_resume_lists_every_config_difference_and_names_the_override_key(chain):
    run = chain["changed"]
    assert run.rc == 2 and "launching" not in run.out, run.out[-2000:]
    assert "run.seed: checkpoint 7 -> this run 8" in run.out
    assert "grpo.group_size: checkpoint 4 -> this run 2" in run.out
    assert "checkpoint.resume_allow_changes=[grpo.group_size,run.seed]" in run.out
    assert "strict=False" not in run.out


def test_resume_never_in_a_used_folder_is_refused(chain):
    run = chain["never"]
    assert run.rc == 2 and "already holds a run" in run.out and "launching" not in run.out, run.out[-2000:]
    assert chain["text_after_probes"] == chain["text4"]  # the refused runs changed nothing


def test_watchdog_names_the_stopped_rank_within_its_bound(chain):
    run = chain[5]
    assert run.rc == 4, run.out[-3000:]
    assert "stalled rank: rank 1" in run.out and "stopped (SIGSTOP)" in run.out, run.out[-3000:]
    # the configured bound (30 s) fired; without it the run would have hit launch()'s hang guard
    assert "no rank made progress for 30 s (parallel.watchdog_s)" in run.out, run.out[-3000:]


def test_final_rerun_finishes_and_summary_covers_every_step(chain):
    run = chain[6]
    assert run.rc == 0 and "resumed from" in run.out and "step_000002" in run.out, run.out[-3000:]
    summary = [line for line in run.out.splitlines() if line.startswith("summary:")][-1]
    first = chain["rows6"][0]["mean_response_length"]
    assert f"start_length {first:.4f}" in summary, (summary, first)


def test_signal_to_one_rank_before_the_rendezvous_stops_every_rank(tmp_path):
    """Rank 1 is told to stop before it has joined the rendezvous; rank 0 is not (it was forwarded the
    signal later, or never). Leaving alone would leave rank 0 waiting for it until the watchdog: both must
    reach the trainer's collective stop and leave together, status 3, nothing written."""
    out = tmp_path / "run"
    run = launch([*BASE, "warmup.num_steps=0", "parallel.watchdog_s=60", f"warmup.cache_dir={tmp_path / 'c'}"],
                 out, fault="start_up@0:1:term", timeout=150)
    assert run.rc == 3, run.out[-3000:]
    assert "[fault point] rank 1" in run.out and "during start-up" in run.out, run.out[-3000:]
    assert "no rank made progress" not in run.out
    assert not (out / "metrics.jsonl").exists()
