"""A private one-node Slurm cluster on 127.0.0.1 for the `slurm` tests (Slurm 22.05 from Debian's slurm-wlm).

Everything lives in one folder: munged with its own key and socket, slurmctld and slurmd with their own
state, spool, logs, pid files and two free ports, so neither the machine's munge/Slurm nor another
cluster of this kind is touched. No cgroups (proctrack/linuxproc, task/none). The main scheduling loop
runs every 2 s instead of 60 (a requeued job whose begin time passed starts without waiting a minute). The node advertises more
CPUs than the machine has (SlurmdParameters=config_overrides) so that two 2-task jobs run side by side,
and 4 GPUs as generic resources backed by plain files: `--gpus-per-node` works and the job sees
SLURM_GPUS_ON_NODE, as on a GPU cluster, while the tasks run on CPU.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class StartError(RuntimeError):
    pass


class LocalSlurm:
    def __init__(self, root: Path, cpus: int = 8, gpus: int = 4):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.cpus, self.gpus = cpus, gpus
        self.conf = self.root / "slurm.conf"
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
                    "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ daemons
    def start(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "run", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        try:
            socket.gethostbyname(self.host)
        except OSError as exc:
            raise StartError(f"this host's name {self.host!r} does not resolve ({exc}); the job's MASTER_ADDR is it") from exc
        self._run([_which("munged"), "--force", f"--socket={r}/munge/sock", f"--key-file={key}",
                   f"--pid-file={r}/run/munged.pid", f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/seed"],
                  "munged")
        for i in range(self.gpus):
            (r / f"gpu{i}").touch()
        (r / "gres.conf").write_text(f"NodeName={self.host} Name=gpu File={r}/gpu[0-{self.gpus - 1}]\n")
        self.conf.write_text(f"""ClusterName=laconic
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/sock
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MpiDefault=none
GresTypes=gpu
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000 Gres=gpu:{self.gpus} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")
        self._run([_which("slurmctld"), "-c"], "slurmctld")
        self._run([_which("slurmd"), "-N", self.host], "slurmd")
        deadline = time.time() + 30
        while time.time() < deadline:
            out = self.cmd("sinfo", "-h", "-o", "%t", check=False)
            if out.returncode == 0 and out.stdout.strip() == "idle":
                return
            time.sleep(0.5)
        raise StartError(f"the node did not come up: sinfo says {out.stdout.strip()!r} {out.stderr.strip()!r}; "
                         + self.log_tail())

    def _run(self, argv: list[str], name: str) -> None:
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise StartError(f"{name} did not start ({out.returncode}): {out.stderr.strip()[-500:]}; "
                             + self.log_tail())

    def log_tail(self, n: int = 5) -> str:
        tails = []
        for f in sorted((self.root / "log").glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            tails.append(f"{f.name}: " + " | ".join(lines))
        return "; ".join(tails)

    def stop(self) -> None:
        """Cancel every job, end what is left of them, stop the daemons (each by its pid)."""
        if self.conf.exists():
            self.cmd("scancel", "--partition=debug", check=False)
            deadline = time.time() + 20
            while time.time() < deadline and self.cmd("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for pid in self.job_processes():
            _kill(pid)
        for name in ("slurmd", "slurmctld", "munged"):
            pidfile = self.root / "run" / f"{name}.pid"
            if pidfile.is_file():
                try:
                    _kill(int(pidfile.read_text().strip()), signal.SIGTERM)
                except ValueError:
                    pass

    def job_processes(self, job_id: str | None = None, procid: str | None = None) -> list[int]:
        """Pids of processes started by this cluster's jobs (their environment names this slurm.conf), optionally
        only a job's training ranks (``procid``: SLURM_PROCID of the train step)."""
        pids = []
        for env_file in Path("/proc").glob("[0-9]*/environ"):
            try:
                env = dict(kv.split("=", 1) for kv in env_file.read_bytes().decode(errors="replace").split("\0")
                           if "=" in kv)
                cmdline = (env_file.parent / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if env.get("SLURM_CONF") != str(self.conf) or int(env_file.parent.name) == os.getpid():
                continue
            if job_id is not None and env.get("SLURM_JOB_ID") != str(job_id):
                continue
            argv = cmdline.split("\0")
            if procid is not None and (env.get("SLURM_PROCID") != procid or "laconic_nemo.nemo_entry" not in argv
                                       or not Path(argv[0]).name.startswith("python")):
                continue  # not a rank (srun itself carries the command in its arguments)
            pids.append(int(env_file.parent.name))
        return pids

    # ------------------------------------------------------------------ client commands
    def cmd(self, *argv: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run(list(argv), env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def sbatch(self, script: Path, env: dict, cwd: Path) -> str:
        out = subprocess.run(["sbatch", "--parsable", str(script)], env={**env, "SLURM_CONF": str(self.conf)},
                             cwd=cwd, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch failed: {out.stderr.strip()}")
        return out.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, RunTime, ...)."""
        text = self.cmd("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", text))


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
