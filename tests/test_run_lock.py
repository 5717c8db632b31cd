"""One run per output directory, and ranks that die with their launcher.

* the lock of ``laconic_nemo.runtime.run_lock`` against real processes: a live holder on this host refuses
  (naming pid, host and the file), a dead, zombie or recycled-pid holder is stale, a holder on another
  host refuses unless it is an earlier run of the same Slurm job;
* end to end (``laconic-nemo train --nprocs 2``, the tiny recipe): the launcher holds the output dir from before
  its ranks start; while a run trains or its ranks start up, a second run into its output dir is refused by its
  pre-flight, once, before it starts anything; after ``kill -9`` of the first launcher its ranks die, and a rerun
  takes over the stale lock and resumes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from laconic_nemo.runtime.run_lock import (
    LOCK_NAME,
    OutputDirLock,
    OutputDirLocked,
    check_free,
    identity,
    process_alive,
)
from tests.test_trainer_e2e import FAST, ROOT, TINY  # the e2e tests' tiny, fast variant


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)


def _write_lock(out: Path, holder: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_NAME).write_text(json.dumps(holder))


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_live_holder_on_this_host_refuses_and_a_dead_one_is_taken_over(tmp_path):
    out = tmp_path / "run"
    holder = _sleeper()
    try:
        _write_lock(out, identity(holder.pid))
        with pytest.raises(OutputDirLocked) as err:
            OutputDirLock.acquire(out)
        msg = str(err.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in msg and str(out / LOCK_NAME) in msg
        with pytest.raises(OutputDirLocked):
            check_free(out)
    finally:
        holder.kill()
    holder.wait()
    check_free(out)
    lock = OutputDirLock.acquire(out)
    assert lock.took_over == f"process {holder.pid} on this host is gone"
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(OutputDirLocked):  # held now by this (live) process
        OutputDirLock.acquire(out)
    lock.release()
    assert not (out / LOCK_NAME).exists() and not list(out.glob(f".{LOCK_NAME}*"))


def test_a_zombie_or_a_recycled_pid_is_not_the_holder(tmp_path):
    zombie = _sleeper()
    zombie.kill()  # not reaped: /proc still lists it, state Z
    deadline = time.time() + 10
    while process_alive(zombie.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert os.path.exists(f"/proc/{zombie.pid}") or sys.platform != "linux"
    _write_lock(tmp_path / "a", identity(zombie.pid))
    OutputDirLock.acquire(tmp_path / "a").release()
    zombie.wait()

    live = _sleeper()
    try:
        recycled = {**identity(live.pid), "start_time": "1"}  # the pid now belongs to another process
        _write_lock(tmp_path / "b", recycled)
        assert OutputDirLock.acquire(tmp_path / "b").took_over.endswith("is gone")
    finally:
        live.kill()
        live.wait()


def test_another_hosts_lock_refuses_unless_it_is_an_earlier_run_of_the_same_slurm_job(tmp_path, monkeypatch):
    other = {"host": "gpu-node-17", "pid": 4242, "start_time": "99", "boot_id": "x", "slurm_job_id": "555",
             "slurm_restart_count": "0", "taken_at": "2026-01-01T00:00:00Z"}
    _write_lock(tmp_path, other)
    with pytest.raises(OutputDirLocked) as err:
        OutputDirLock.acquire(tmp_path)
    assert "pid 4242 on host gpu-node-17, Slurm job 555 restart 0" in str(err.value)
    assert "cannot be checked from here" in str(err.value) and f"delete {tmp_path / LOCK_NAME}" in str(err.value)
    monkeypatch.setenv("SLURM_JOB_ID", "555")  # the same job, same restart: a concurrent step, refused
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with pytest.raises(OutputDirLocked):
        OutputDirLock.acquire(tmp_path)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued: its previous run's lock, on whatever node
    lock = OutputDirLock.acquire(tmp_path)
    assert lock.took_over == "left by an earlier run of Slurm job 555 (restart 0)"
    assert json.loads((tmp_path / LOCK_NAME).read_text())["slurm_restart_count"] == "1"


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the ranks")
def test_second_run_is_refused_and_ranks_die_with_a_killed_launcher(tmp_path):
    out, cache = tmp_path / "run", f"warmup.cache_dir={tmp_path / 'cache'}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LACONIC_LAUNCHER_PID")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "laconic_nemo", "train", "--nprocs", "2", TINY, *FAST, cache,
           "checkpoint.every_n_steps=1", f"run.output_dir={out}"]
    first = subprocess.Popen([*cmd, "run.num_steps=500"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started = []
    try:
        deadline = time.time() + 300
        while len(_metrics(out)) < 1:
            assert first.poll() is None and time.time() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.3)
        ranks = _children(first.pid)
        assert len(ranks) == 2
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == first.pid  # the launcher holds the output dir

        # a second run into the same output dir: refused before any rank, warm-up or model
        second = subprocess.Popen([*cmd, "run.num_steps=500"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
        started.append(second)
        out2, err = second.communicate(timeout=120)  # hang guard
        assert second.returncode == 2, err[-3000:]
        # refused by the launcher itself: no rank was started, no warm-up or model
        assert "is in use by another run" in err and "warm-up" not in err and "launching" not in out2 + err

        # kill -9 of the launcher: its ranks go with it
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        deadline = time.time() + 15
        while any(process_alive(r) for r in ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(process_alive(r) for r in ranks), "ranks outlived their launcher"
        done = _metrics(out)[-1]["step"]
        time.sleep(0.5)
        assert _metrics(out)[-1]["step"] == done  # nobody trains into the folder any more

        # the lock they left is stale: a rerun takes it over and resumes
        assert (out / LOCK_NAME).is_file()
        rerun = subprocess.run([*cmd, f"run.num_steps={done + 1}"], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=600)
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
        assert "resumed from" in rerun.stdout
        assert [r["step"] for r in _metrics(out)][-1] == done + 1
        assert not (out / LOCK_NAME).exists()
    finally:
        for p in [first, *started]:  # each launcher leads its process group; its ranks die with it (PDEATHSIG)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the ranks")
def test_a_run_started_while_anothers_ranks_start_is_refused_in_its_preflight_once(tmp_path):
    """Two runs on one folder started together. The first's rank 0 is held at its start-up (a fault point stops it
    there, before its rendezvous) while the second starts: the second is refused by its pre-flight, before it starts
    a rank, with the lock's line once (the first's launcher holds the folder from before its ranks start). Before,
    the lock was rank 0's to take after its rendezvous: the second passed the launcher's check, and its ranks took the
    folder and trained into it. The first then continues, finishes and leaves no lock."""
    out, cache = tmp_path / "run", f"warmup.cache_dir={tmp_path / 'cache'}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LACONIC_LAUNCHER_PID", "LACONIC_FAULT")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "laconic_nemo", "train", "--nprocs", "2", TINY, *FAST, cache, "run.num_steps=1",
           f"run.output_dir={out}"]
    first = subprocess.Popen(cmd, cwd=ROOT, env={**env, "LACONIC_FAULT": "start_up@0:0:stop"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    started = []
    try:
        said = []
        for line in first.stdout:  # until rank 0 has stopped itself
            said.append(line)
            if "[fault point] rank 0 pid " in line:
                break
        rank0 = int(said[-1].split(" pid ")[1].split(":")[0])
        second = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)
        started.append(second)
        text = second.communicate(timeout=300)[0]  # hang guard
        assert second.returncode == 2, text[-3000:]
        lines = [line for line in text.splitlines() if "is in use by another run" in line]
        assert lines == [f"laconic-nemo train: run.output_dir = {out} is in use by another run: {out / LOCK_NAME} is "
                         f"held by pid {first.pid} on host {socket.gethostname()}, since "
                         f"{json.loads((out / LOCK_NAME).read_text())['taken_at']}. Wait for that run to end or "
                         "choose another run.output_dir."], text[-3000:]
        assert "launching" not in text and "warm-up" not in text, text[-3000:]
        os.kill(rank0, signal.SIGCONT)
        rest = first.communicate(timeout=600)[0]
        assert first.returncode == 0, "".join(said)[-2000:] + rest[-3000:]
        assert [r["step"] for r in _metrics(out)] == [1] and not (out / LOCK_NAME).exists()
    finally:
        for p in [first, *started]:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
