"""Fault injection on real runs of the tiny recipe (2 ranks, TP = 2 over gloo): nothing lost, nothing hung.

One output folder goes through a chain of real faults, each run resuming the previous one (see
docs/reliability.md for the matrix); the tests below check one issue each on the recorded outcomes:

R0  SIGTERM to the launcher while the ranks start up          -> exit 3, nothing written
R1  SIGUSR1 to rank 1 at warm-up step 8 (fault point)         -> exit 3, warm-up progress saved
R2  SIGKILL of both ranks inside the first checkpoint         -> both named, the last line names the first;
                                                                 warm-up continued, not redone
R3  rerun; SIGKILL of rank 0 right after checkpoint 2          -> the .tmp is ignored; row 2 kept
R4  rerun; rank 0 dies half-way through writing row 3          -> a torn last line
    (probes: changed config / resume=never / a corrupt middle line are refused before any rank starts)
    then step_000002's shard is emptied (what a power cut leaves of an unsynced file)
R5  rerun; SIGSTOP of rank 1 at the start of step 3            -> step_000002 named as damaged, resumed from
                                                                 step_000001; the watchdog's bound scales with
                                                                 the measured step, it names rank 1, exit 4
    then metrics.jsonl is removed
R6  rerun; SIGTERM to rank 0 inside the last step              -> rows 1-2 restored from the checkpoint; the run
                                                                 finishes: exit 0, steps [1, 2, 3]
R7  run.num_steps=8; Ctrl-C (SIGINT to the process group)     -> exit 3 after a checkpoint, no traceback

Fault points are armed with LACONIC_FAULT (laconic_nemo/runtime/faults.py); signals go to real processes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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


def launch(args, out: Path, fault: str | None = None, timeout: float = 240, signal_on: tuple | None = None,
           group: bool = False, prefix: tuple = (), env_extra: dict | None = None,
           python: tuple = ("-m", "laconic_nemo")) -> Run:
    """Run `laconic-nemo train` in its own session; ``signal_on = (text, signum)`` sends ``signum`` to the
    launcher (``group``: to its whole process group, as a Ctrl-C at a terminal does) once ``text`` appears in
    its output; ``prefix``: a command line the launcher runs under; ``env_extra``: more environment variables;
    ``python``: what the interpreter runs (default the package's command line). Output is stdout and stderr
    together."""
    env = {**clean_env(), **(env_extra or {})}
    if fault:
        env["LACONIC_FAULT"] = fault
    cmd = [*prefix, sys.executable, *python, "train", *args, f"run.output_dir={out}"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if signal_on and signal_on[0] in line:
                if group:
                    os.killpg(proc.pid, signal_on[1])
                else:
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
        log.write(f"==== {' '.join(cmd[len(prefix) + 1 + len(python):])} (fault {fault}) -> {proc.returncode}\n"
                  f"{''.join(lines)}\n")
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
    r[2] = launch(args, out, fault="checkpoint_written@1:0:kill,checkpoint_written@1:1:kill")
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
    (out / "checkpoints" / "step_000002" / "model_tp01_pp00.pt").write_bytes(b"")  # a power cut's empty shard
    r[5] = launch([*args, "parallel.watchdog_min_s=10"], out, fault="generate@3:1:stop")
    r["rows5"] = rows(out)
    (out / "metrics.jsonl").unlink()
    r[6] = launch(args, out, fault="policy_update@3:0:term")
    r["rows6"] = rows(out)
    r[7] = launch([*args, "run.num_steps=8"], out, signal_on=("step    4/8", signal.SIGINT), group=True)
    r["latest7"] = (out / "checkpoints" / "latest").read_text().strip()
    r["rows7"] = rows(out)
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
        last = run.out.rstrip().splitlines()[-1]
        assert last.startswith("laconic-nemo train: failed: rank ") and "was killed by signal SIGKILL, the first rank " \
            "to fail" in last, last
    # both ranks died (within one poll of the launcher, most often): each is named, and the last line names one
    assert "rank 1 (pid" in chain[2].out and chain[2].out.count("was killed by signal SIGKILL") >= 3, chain[2].out[-3000:]


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
    """The bound inside a step is max(parallel.watchdog_min_s, parallel.watchdog_step_factor x the longest step
    of this process): here max(10, 10 x step 2's step_seconds from metrics.jsonl), not watchdog_s = 600."""
    run = chain[5]
    assert run.rc == 4, run.out[-3000:]
    assert "stalled rank: rank 1" in run.out and "stopped (SIGSTOP)" in run.out, run.out[-3000:]
    # the longest step is over every rank of this process (only step 2 ran before the stall): at least rank 0's
    # step 2, whose step_seconds metrics.jsonl holds
    step2 = chain["rows5"][1]["step_seconds"]
    found = re.search(r"no rank made progress for (\d+) s \(max\(parallel.watchdog_min_s = 10, "
                      r"parallel.watchdog_step_factor = 10 x the longest step so far, ([\d.]+) s\)\)", run.out)
    assert found, run.out[-3000:]
    longest = float(found.group(2))
    assert longest >= round(step2, 2) and abs(int(found.group(1)) - max(10.0, 10.0 * longest)) <= 1, found.group(0)
    assert run.out.rstrip().splitlines()[-1].startswith("laconic-nemo train: no rank made progress")


def test_damaged_latest_checkpoint_is_named_and_the_previous_one_resumed(chain):
    """step_000002's shard was emptied (a power cut before the data reached the disk): the rerun names it, resumes
    from step_000001 and recomputes step 2 bit for bit (timings aside)."""
    run = chain[5]
    ckpts = chain["out"] / "checkpoints"
    assert (f"checkpoint {ckpts / 'step_000002'} is damaged and skipped: {ckpts / 'step_000002' / 'model_tp01_pp00.pt'} "
            "has 0 bytes, manifest.json says") in run.out, run.out[-3000:]
    assert f"resumed from {ckpts / 'step_000001'} at step 1" in run.out
    assert "EOFError" not in run.out and "Traceback" not in run.out
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "step_seconds"))}  # noqa: E731
    assert [strip(r) for r in chain["rows5"]] == [strip(r) for r in chain["rows3"]]


def test_lost_metrics_rows_are_restored_and_a_signal_in_the_last_step_still_finishes(chain):
    run = chain[6]
    assert run.rc == 0, run.out[-3000:]
    assert "the rows of steps 1-2 were missing; restored the rows of steps 1-2 from" in run.out, run.out[-3000:]
    assert "[fault point] rank 0" in run.out and "arrived during the last step: the run is finished" in run.out
    assert (chain["out"] / "checkpoints" / "step_000003" / "manifest.json").is_file()


def test_ctrl_c_checkpoints_and_exits_3_like_sigterm(chain):
    run = chain[7]
    assert run.rc == 3, run.out[-3000:]
    assert "KeyboardInterrupt" not in run.out and "Traceback" not in run.out, run.out[-3000:]
    stopped = int(run.out.split("stopping on signal 2 after step ")[1].split(";")[0])
    assert 5 <= stopped < 8 and chain["latest7"] == f"step_{stopped:06d}"
    assert [r["step"] for r in chain["rows7"]] == list(range(1, stopped + 1))
    from laconic_nemo.grpo.resume import damage

    assert damage(chain["out"] / "checkpoints" / chain["latest7"]) is None
    assert run.out.rstrip().splitlines()[-1] == ("laconic-nemo train: stopped on signal 2: every rank stopped after "
                                                 "its checkpoint (status 3); rerun the same command to continue")


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


def tmpfs_prefix(folder: Path, options: str = "size=96k") -> tuple:
    """A command prefix that runs the rest with a tmpfs mounted at ``folder`` with mount ``options`` (default: 96
    KiB; a private user and mount namespace: no root needed, nothing visible outside); () where this kernel does
    not allow it."""
    if shutil.which("unshare") is None:
        return ()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o {options} tmpfs {folder}"],
                           capture_output=True)
    if probe.returncode != 0:
        return ()
    return ("unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o {options} tmpfs "$0" && exec "$@"', str(folder))


def test_full_disk_is_named_in_the_launchers_last_line(tmp_path):
    """run.output_dir on a file system with room for the config and a metrics row, not for a checkpoint: every
    rank fails writing its shard of checkpoint 1 (torch alone says "basic_ios::clear" or "unexpected pos")."""
    out = tmp_path / "full"
    out.mkdir()
    prefix = tmpfs_prefix(out)
    if not prefix:
        pytest.skip("unshare -rm (user and mount namespaces) is not available to mount a small tmpfs")
    run = launch([*BASE, "warmup.num_steps=0", f"warmup.cache_dir={tmp_path / 'c'}"], out, prefix=prefix, timeout=180)
    assert run.rc not in (0, 2, 3, 4), run.out[-3000:]
    last = run.out.rstrip().splitlines()[-1]
    assert last.startswith("laconic-nemo train: failed: rank ") and ": No space left on device" in last, last
    assert "checkpoints/step_000001.tmp/model_tp0" in last  # the rank's own line names the file


def test_out_of_memory_in_a_training_step_is_fatal_and_names_the_prediction(tmp_path):
    """torch.OutOfMemoryError inside rank 0's first optimiser step (fault point ``train_step``, after its
    micro-batches' forward and backward): the run ends with status 5 (launch/submit.sh requeues only 3), no
    checkpoint of that step, no traceback of it, and the launcher's last line names that rank (rank 1 fails too, its
    peer gone from a collective) with its line: the phase and step, the memory model's prediction for its
    micro-batches and the keys to change."""
    out = tmp_path / "run"
    run = launch([*BASE, "warmup.num_steps=0", f"warmup.cache_dir={tmp_path / 'c'}"], out,
                 fault="train_step@1:0:oom", timeout=400)
    assert run.rc == 5, run.out[-3000:]
    assert "OutOfMemoryError" not in run.out and "[rank0]: Traceback" not in run.out, run.out[-3000:]  # one line
    last = run.out.rstrip().splitlines()[-1]
    assert last.startswith("laconic-nemo train: failed: rank 0 ") and "exited with status 5" in last, last
    assert "the first rank to fail: laconic-nemo: out of memory" in last, last
    assert "laconic-nemo: out of memory in the policy update of step 1 on rank 0 (CUDA out of memory" in last, last
    assert "the memory model predicted activations" in last and "micro-batch of" in last, last
    assert "logits + gradients" in last and "change grpo.micro_batch_size" in last, last
    assert "grpo.recompute_layers" in last and "Not requeued (status 5)" in last, last
    assert ls(out / "checkpoints") == []
