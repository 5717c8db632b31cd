"""launch/: dry runs print the srun commands the plan renders; preemption forwards the signal and
requeues; shellcheck is clean."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from laconic_nemo.config import load_config
from laconic_nemo.launch_plan import plan_layout, render_commands

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DRY_RUN="1", REPO_DIR=str(ROOT), CONTAINER="/lustre/img/laconic.sqsh")
    env.update(extra)
    return env


def dry_run(script: str, **extra) -> list[str]:
    out = subprocess.run(["bash", str(LAUNCH / script)], cwd=ROOT, env=_env(**extra), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [line[2:] for line in out.stdout.splitlines() if line.startswith("+ ")]


def _tokens(cmd: str) -> list[str]:
    return [t for t in shlex.split(cmd) if not t.startswith("--output=") and t != "--label"]


def test_dry_run_deepseek_prints_srun_commands():
    cmds = dry_run("deepseek_b1500.sh", SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2",
                   SLURM_JOB_NODELIST="gpu-a01,gpu-a02")
    sruns = [c for c in cmds if c.startswith("srun ")]
    assert len(sruns) == 3  # plan, prepare (HF -> .nemo), train
    train = shlex.split(sruns[-1])
    assert "--nodes=2" in train and "--ntasks-per-node=8" in train and "--gpus-per-node=8" in train
    assert "--container-image=/lustre/img/laconic.sqsh" in train and "--no-container-mount-home" in train
    assert "recipes/deepseek_1.5b_b1500.yaml" in train
    assert any(t.startswith("--output=/lustre/results/deepseek_1.5b_b1500/logs/job_4242_restart0/") for t in train)
    assert "--prepare" in shlex.split(sruns[1]) and "--hf-model=/checkpoints/hf/DeepSeek-R1-Distill-Qwen-1.5B" in \
        shlex.split(sruns[1])


def test_dry_run_commands_match_plan():
    """The script and `laconic-nemo plan` render the same srun lines (up to the log-file flags)."""
    hf = "/checkpoints/hf/DeepSeek-R1-Distill-Qwen-1.5B"
    mounts = f"/d:/data,/c:/checkpoints,/r:/results,{ROOT}:/opt/laconic-nemo"
    cmds = dry_run("deepseek_b1500.sh", SLURM_JOB_NUM_NODES="2", MOUNTS=mounts,
                   EXTRA_OVERRIDES="laconic.eta=0.001 run.num_steps=10")
    sruns = [c for c in cmds if c.startswith("srun ")]
    overrides = ["laconic.eta=0.001", "run.num_steps=10"]
    recipe = "recipes/deepseek_1.5b_b1500.yaml"
    cfg = load_config(ROOT / recipe, overrides)
    plan = plan_layout(cfg, 2, 8, check_paths=False)
    rendered = render_commands(plan, cfg, recipe, overrides, "/lustre/img/laconic.sqsh", mounts, hf)
    assert [_tokens(c) for c in sruns] == [_tokens(c) for c in rendered]


def test_dry_run_without_slurm_reads_nodes_from_sbatch_header_and_skips_prepare_for_hf():
    cmds = dry_run("qwen3_8b_b1000.sh")
    sruns = [shlex.split(c) for c in cmds if c.startswith("srun ")]
    assert len(sruns) == 2  # no conversion for the HF (megatron-core) run
    assert "--nodes=4" in sruns[-1]
    assert "launch/torch_env.sh" in sruns[-1]


def _fake_bin(tmp_path: Path) -> Path:
    """Fake srun / scontrol: the train step waits for SIGUSR1, then exits 3 like the trainer."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "srun").write_text(f"""#!/bin/bash
echo "srun $*" >> {log}
case "$*" in
  *nemo_entry*torch_env*|*torch_env*nemo_entry*)
    trap 'echo "train got USR1" >> {log}; exit 3' USR1
    touch {tmp_path}/train_started
    for _ in $(seq 200); do sleep 0.1; done
    exit 0 ;;
esac
exit 0
""")
    (bin_dir / "scontrol").write_text(f"""#!/bin/bash
echo "scontrol $*" >> {log}
if [ "$1 $2" = "show hostnames" ]; then echo node-x1; echo node-x2; fi
""")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def test_preemption_signal_is_forwarded_and_job_requeued(tmp_path):
    bin_dir = _fake_bin(tmp_path)
    env = _env(DRY_RUN="0", PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="777", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="node-x[1-2]", RESULTS_DIR=str(tmp_path / "results"))
    proc = subprocess.Popen(["bash", str(LAUNCH / "deepseek_b1500.sh")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not (tmp_path / "train_started").exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    time.sleep(0.3)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    calls = (tmp_path / "calls.log").read_text()
    assert "train got USR1" in calls
    assert "scontrol requeue 777" in calls
    assert "master node-x1:20777" in out
    assert (tmp_path / "results" / "deepseek_1.5b_b1500" / "logs" / "job_777_restart0").is_dir()


def test_finished_run_is_not_requeued(tmp_path):
    bin_dir = _fake_bin(tmp_path)
    srun = bin_dir / "srun"
    srun.write_text(f"#!/bin/bash\necho \"srun $*\" >> {tmp_path}/calls.log\nexit 0\n")
    env = _env(DRY_RUN="0", PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="778", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="node-x[1-2]", RESULTS_DIR=str(tmp_path / "results"))
    out = subprocess.run(["bash", str(LAUNCH / "deepseek_b1500.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "requeue" not in (tmp_path / "calls.log").read_text()


def test_shellcheck_clean():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck); CI installs it")
    scripts = sorted(str(p) for p in LAUNCH.glob("*.sh"))
    out = subprocess.run([exe, "-x", *scripts], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
