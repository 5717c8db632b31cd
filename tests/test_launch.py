"""launch/: dry runs print the srun commands the plan renders; preemption forwards the signal and
requeues; shellcheck is clean."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from laconic_nemo.config import load_config
from laconic_nemo.plan.cli import render_commands
from laconic_nemo.plan.layout import plan_layout

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


def _fake_bin(tmp_path: Path, exit_on_usr1: int = 3) -> Path:
    """Fake srun / scontrol: the train step waits for SIGUSR1, then exits ``exit_on_usr1`` (3 like the trainer
    after its checkpoint; anything else is a crash). Every srun call logs the environment its tasks would get."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "srun").write_text(f"""#!/bin/bash
echo "srun $*" >> {log}
echo "env HOME=$HOME XDG_CACHE_HOME=${{XDG_CACHE_HOME:-}} TRITON_CACHE_DIR=${{TRITON_CACHE_DIR:-}} PYTHONPATH=${{PYTHONPATH:-}}" >> {log}
case "$*" in
  *nemo_entry*torch_env*|*torch_env*nemo_entry*)
    trap 'echo "train got USR1" >> {log}; exit {exit_on_usr1}' USR1
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


def _preempt(tmp_path: Path, exit_on_usr1: int = 3, **extra) -> tuple[subprocess.Popen, str, str]:
    """Run deepseek_b1500.sh with the fake srun, send the batch shell SIGUSR1 once training started."""
    bin_dir = _fake_bin(tmp_path, exit_on_usr1)
    env = _env(DRY_RUN="0", PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="777", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="node-x[1-2]", RESULTS_DIR=str(tmp_path / "results"), **extra)
    proc = subprocess.Popen(["bash", str(LAUNCH / "deepseek_b1500.sh")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not (tmp_path / "train_started").exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    time.sleep(0.3)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    return proc, out, err


def test_preemption_signal_is_forwarded_and_job_requeued(tmp_path):
    proc, out, err = _preempt(tmp_path)
    assert proc.returncode == 0, err
    calls = (tmp_path / "calls.log").read_text()
    assert "train got USR1" in calls
    assert "scontrol requeue 777" in calls
    assert "master node-x1:20777" in out
    assert (tmp_path / "results" / "deepseek_1.5b_b1500" / "logs" / "job_777_restart0").is_dir()


def test_crash_after_the_preemption_signal_is_not_requeued(tmp_path):
    """Only the trainer's exit code 3 (checkpoint written) requeues; a rank that fails after SIGUSR1 ends the job
    with its status instead of requeueing it forever."""
    proc, out, err = _preempt(tmp_path, exit_on_usr1=1)
    calls = (tmp_path / "calls.log").read_text()
    assert "train got USR1" in calls
    assert "scontrol requeue" not in calls
    assert proc.returncode == 1, out + err
    assert "not requeueing" in out


def test_a_signal_before_training_requeues_without_starting_it(tmp_path):
    """SIGUSR1 reaching the batch shell during the plan or prepare step (no train step to forward it to yet): bash runs
    the trap when that step ends; the script then requeues the job instead of starting a train step that would
    never hear of the signal and run into the time limit."""
    bin_dir = _fake_bin(tmp_path)
    log = tmp_path / "calls.log"
    srun = bin_dir / "srun"
    srun.write_text(srun.read_text().replace("case \"$*\" in", f'''case "$*" in
  *"laconic_nemo plan"*)
    kill -USR1 "$PPID"; echo "plan signalled" >> {log}; exit 0 ;;''', 1))
    env = _env(DRY_RUN="0", PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="777", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="node-x[1-2]", RESULTS_DIR=str(tmp_path / "results"))
    out = subprocess.run(["bash", str(LAUNCH / "deepseek_b1500.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    calls = log.read_text()
    assert "plan signalled" in calls and "--prepare" in calls  # the running step is not cut short
    assert "torch_env.sh" not in calls  # no train step
    assert "scontrol requeue 777" in calls and out.returncode == 0, out.stdout + out.stderr
    assert "before training started" in out.stdout


def test_requeues_are_capped(tmp_path):
    proc, out, err = _preempt(tmp_path, SLURM_RESTART_COUNT="3", MAX_REQUEUES="3")
    assert "scontrol requeue" not in (tmp_path / "calls.log").read_text()
    assert proc.returncode == 3, out + err
    assert "already requeued 3 times (MAX_REQUEUES=3)" in out
    # below the cap it requeues and says which requeue this is
    (tmp_path / "again").mkdir()
    proc, out, err = _preempt(tmp_path / "again", SLURM_RESTART_COUNT="2", MAX_REQUEUES="3")
    assert proc.returncode == 0 and "scontrol requeue 777" in (tmp_path / "again" / "calls.log").read_text()
    assert "requeue 3 of at most 3" in out


def test_container_gets_a_home_and_caches_under_the_run_dir_and_no_host_pythonpath(tmp_path):
    """--no-container-mount-home leaves the host's HOME, which does not exist in the container: HOME, XDG_CACHE_HOME
    and TRITON_CACHE_DIR point under /results/<recipe>/home (created on the host side), and PYTHONPATH is the
    repository mount alone, whatever the host had."""
    results = tmp_path / "results"
    proc, out, err = _preempt(tmp_path, PYTHONPATH="/host/site-packages", HOME="/home/someone")
    assert proc.returncode == 0, err
    envs = [line for line in (tmp_path / "calls.log").read_text().splitlines() if line.startswith("env ")]
    assert len(envs) == 3  # plan, prepare, train
    home = "/results/deepseek_1.5b_b1500/home"
    for line in envs:
        assert line == (f"env HOME={home} XDG_CACHE_HOME={home}/.cache TRITON_CACHE_DIR={home}/.cache/triton "
                        "PYTHONPATH=/opt/laconic-nemo"), line
    assert (results / "deepseek_1.5b_b1500" / "home" / ".cache" / "triton").is_dir()


def test_container_none_drops_only_the_container_flags(tmp_path):
    """CONTAINER=none (pyxis-less clusters, tests/slurm): the same srun lines without the --container-* flags, as
    `plan` renders them too; the environment is the submitting one."""
    extra = dict(SLURM_JOB_NUM_NODES="2", EXTRA_OVERRIDES="run.num_steps=3")
    with_c = [shlex.split(c) for c in dry_run("deepseek_b1500.sh", **extra) if c.startswith("srun ")]
    without = [shlex.split(c) for c in dry_run("deepseek_b1500.sh", CONTAINER="none", **extra) if c.startswith("srun ")]
    assert len(with_c) == len(without) == 3
    for a, b in zip(with_c, without):
        assert any(t.startswith("--container-") for t in a)
        assert [t for t in a if not t.startswith(("--container-", "--no-container-"))] == b
    recipe = "recipes/deepseek_1.5b_b1500.yaml"
    cfg = load_config(ROOT / recipe, ["run.num_steps=3"])
    plan = plan_layout(cfg, 2, 8, check_paths=False)
    rendered = render_commands(plan, cfg, recipe, ["run.num_steps=3"], "none", "", "/checkpoints/hf/"
                               "DeepSeek-R1-Distill-Qwen-1.5B")
    assert [_tokens(" ".join(shlex.quote(t) for t in c)) for c in without] == [_tokens(c) for c in rendered]


def test_gpus_per_node_comes_from_the_allocation():
    """Inside a job SLURM_GPUS_ON_NODE (from #SBATCH --gpus-per-node) sets the tasks per node and what `plan`
    checks, over a stale GPUS_PER_NODE; outside Slurm the wrapper's #SBATCH line does."""
    cmds = dry_run("deepseek_b1500.sh", SLURM_JOB_NUM_NODES="2", SLURM_GPUS_ON_NODE="4", GPUS_PER_NODE="8")
    plan_cmd, _, train = [shlex.split(c) for c in cmds if c.startswith("srun ")]
    assert "--gpus-per-node=4" in plan_cmd and "--gpus-per-node=8" not in plan_cmd
    assert "--ntasks-per-node=4" in train and "--gpus-per-node=4" in train
    header = [shlex.split(c) for c in dry_run("qwen3_8b_b1000.sh") if c.startswith("srun ")]
    assert "--gpus-per-node=8" in header[-1] and "--ntasks-per-node=8" in header[-1]
    out = subprocess.run(["bash", str(LAUNCH / "deepseek_b1500.sh")], cwd=ROOT, env=_env(GPUS_PER_NODE="eight"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "GPUS_PER_NODE = 'eight'" in out.stderr


def _cpus_flags(**slurm) -> tuple[list[str], list[str]]:
    """The --cpus-per-task flags of the prepare and train srun lines of a dry run inside an allocation like ``slurm``."""
    _, prepare, train = [shlex.split(c) for c in dry_run("deepseek_b1500.sh", SLURM_JOB_NUM_NODES="2", **slurm)
                         if c.startswith("srun ")]
    return ([t for t in prepare if t.startswith("--cpus-per-task")], [t for t in train if t.startswith("--cpus-per-task")])


def test_srun_steps_ask_for_their_cpus():
    """Slurm >= 22.05: srun gives each task one CPU unless the step asks for more (srun(1) -c, "The default is one
    CPU per process"; sbatch(1): "Beginning with 22.05, srun will not inherit the --cpus-per-task value requested by
    salloc or sbatch"), and a site that binds tasks by default (CpuBind / TaskPluginParam=cores) then runs each rank
    on one core. The train step asks for a node's CPUs over its tasks (the smallest node of
    SLURM_JOB_CPUS_PER_NODE), or the job's own --cpus-per-task; the one-task prepare step for the whole node."""
    assert _cpus_flags(SLURM_JOB_CPUS_PER_NODE="112(x2)") == (["--cpus-per-task=112"], ["--cpus-per-task=14"])
    assert _cpus_flags(SLURM_JOB_CPUS_PER_NODE="72,36(x3)") == (["--cpus-per-task=36"], ["--cpus-per-task=4"])
    assert _cpus_flags(SLURM_JOB_CPUS_PER_NODE="4(x2)") == (["--cpus-per-task=4"], ["--cpus-per-task=1"])
    assert _cpus_flags(SLURM_JOB_CPUS_PER_NODE="112(x2)", SLURM_CPUS_PER_TASK="6")[1] == ["--cpus-per-task=6"]
    assert _cpus_flags(SLURM_JOB_CPUS_PER_NODE="112(x2)", CPUS_PER_TASK="10")[1] == ["--cpus-per-task=10"]
    assert _cpus_flags() == ([], [])  # outside an allocation: plan's commands, flag for flag
    out = subprocess.run(["bash", str(LAUNCH / "deepseek_b1500.sh")], cwd=ROOT, capture_output=True, text=True,
                         env=_env(SLURM_JOB_CPUS_PER_NODE="112", CPUS_PER_TASK="all"), timeout=60)
    assert out.returncode == 2 and "CPUS_PER_TASK = 'all'" in out.stderr


def _arrays_that_may_be_empty(text: str) -> set[str]:
    """Arrays assigned by `read -a` or as `()`: empty when their input is."""
    names = set(re.findall(r"read\s+(?:-\w+\s+)*-a\s+(\w+)", text))
    names |= set(re.findall(r"\b(\w+)=\(\s*\)", text))
    return names


def test_empty_arrays_are_expanded_safely_for_bash_before_4_4():
    """Bash < 4.4 (RHEL/CentOS 7 login and compute nodes) aborts on "${A[@]}" of an empty array under `set -u`
    ("A[@]: unbound variable"); every expansion of an array that may be empty must read ${A[@]+"${A[@]}"}."""
    for script in sorted(LAUNCH.glob("*.sh")):
        text = script.read_text()
        for name in _arrays_that_may_be_empty(text):
            bare = re.findall(r'(?<!\+)"\$\{' + name + r'\[@\]\}"(?!\})', text)
            assert not bare, f"{script.name}: unguarded \"${{{name}[@]}}\" (write ${{{name}[@]+\"${{{name}[@]}}\"}})"


def test_dry_run_under_an_old_bash():
    """The dry run with no EXTRA_OVERRIDES under a bash < 4.4 (LACONIC_OLD_BASH=/path/to/bash-4.3)."""
    old_bash = os.environ.get("LACONIC_OLD_BASH")
    if not old_bash:
        pytest.skip("set LACONIC_OLD_BASH to a bash < 4.4 binary to run the launch scripts under it")
    version = subprocess.run([old_bash, "-c", "echo ${BASH_VERSINFO[0]}.${BASH_VERSINFO[1]}"], capture_output=True,
                             text=True).stdout.strip()
    assert tuple(map(int, version.split("."))) < (4, 4), version
    out = subprocess.run([old_bash, str(LAUNCH / "deepseek_b1500.sh")], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sum(line.startswith("+ srun ") for line in out.stdout.splitlines()) == 3


def test_finished_run_is_not_requeued(tmp_path):
    bin_dir = _fake_bin(tmp_path)
    srun = bin_dir / "srun"
    srun.write_text(f"#!/bin/bash\necho \"srun $*\" >> {tmp_path}/calls.log\nexit 0\n")
    env = _env(DRY_RUN="0", PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="778", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="node-x[1-2]", RESULTS_DIR=str(tmp_path / "results"))
    out = subprocess.run(["bash", str(LAUNCH / "deepseek_b1500.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "scontrol requeue" not in (tmp_path / "calls.log").read_text()


@pytest.mark.parametrize("srun_status", [5, 1])
def test_out_of_memory_ends_the_job_with_the_ranks_line(tmp_path, srun_status):
    """A step that ran out of GPU memory: the train step's rank exits 5 with its line in train.log (srun may report
    another status once the other ranks lost their peer). The job is not requeued and its last line is that line:
    the memory model's prediction and the keys to change."""
    from laconic_nemo.grpo.trainer import OOM_MARKER

    bin_dir = _fake_bin(tmp_path)
    oom = f"{OOM_MARKER} in the policy update of step 1 on rank 3 (CUDA out of memory): the memory model predicted X"
    srun = bin_dir / "srun"
    srun.write_text(srun.read_text().replace("case \"$*\" in", f'''case "$*" in
  *nemo_entry*torch_env*|*torch_env*nemo_entry*)
    for a in "$@"; do case "$a" in --output=*) log="${{a#--output=}}" ;; esac; done
    printf '3: step 1 starts\\n3: %s\\n0: another line\\n' "{oom}" > "$log"
    exit {srun_status} ;;''', 1))
    env = _env(DRY_RUN="0", PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="779", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_NODELIST="node-x[1-2]", RESULTS_DIR=str(tmp_path / "results"))
    out = subprocess.run(["bash", str(LAUNCH / "deepseek_b1500.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == srun_status, out.stdout + out.stderr
    assert "scontrol requeue" not in (tmp_path / "calls.log").read_text()
    lines = out.stdout.rstrip().splitlines()
    assert lines[-1] == f"3: {oom}" and "ran out of GPU memory; not requeueing" in lines[-2], lines[-3:]


def test_shellcheck_clean():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck); CI installs it")
    scripts = sorted(str(p) for p in LAUNCH.glob("*.sh"))
    out = subprocess.run([exe, "-x", *scripts], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_frozen_vllm_image_pins_one_vllm_version_and_builds_megatron_core_the_same_way_every_time():
    """containers/Dockerfile.vllm-0.10 (the frozen vLLM 0.10.1.1 image): one vLLM version, the same in the base image
    tag, the build-time check and containers/README.md (pyproject's `vllm` extra pins the current image's vLLM:
    tests/test_images.py).

    megatron-core 0.11.0 has no cp312 wheel (PyPI: a cp311 wheel and the sdist; `pip download megatron-core==0.11.0
    --python-version 3.12 --only-binary=:all:` finds none), and the vLLM images run Python 3.12, so pip builds the
    sdist. Its setup.py (megatron_core-0.11.0.tar.gz, lines 108-121) declares the one C++ part,
    ``Extension("megatron.core.datasets.helpers_cpp", ..., optional=True)``: pip skips it with a warning when no
    compiler is there (checked: CXX=/bin/false builds and installs without it) and compiles it otherwise. The
    Dockerfile must install the compiler and headers before that pip line and fail when the extension is missing.
    """
    docker = (ROOT / "containers" / "Dockerfile.vllm-0.10").read_text()
    lines = docker.splitlines()
    froms = [line.split()[1] for line in lines if line.startswith("FROM ")]
    assert len(froms) == 1 and froms[0].startswith("vllm/vllm-openai:v"), froms
    version = froms[0].split(":v", 1)[1]
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.\d+)?", version), version
    assert version == "0.10.1.1" and f"vllm.__version__ == '{version}'" in docker
    readme = (ROOT / "containers" / "README.md").read_text()
    assert set(re.findall(r"vllm/vllm-openai:v([\w.]+)", docker)) == {version}
    assert f"vllm/vllm-openai:v{version}" in readme
    # toolchain before the megatron-core build, and the optional extension required afterwards
    build = next(i for i, line in enumerate(lines) if '"megatron-core==0.11.0"' in line)
    toolchain = [i for i, line in enumerate(lines) if "apt-get install" in line and "g++" in line and "-dev" in line]
    assert toolchain and toolchain[0] < build
    assert any("import megatron.core" in line and "helpers_cpp" in line for line in lines[build:])


# NeMo in the NGC NeMo Framework containers: the NeMo Framework changelog's "NeMo Framework 25.02.01" entry
# (docs.nvidia.com/nemo-framework/user-guide/latest/changelog.html) is the "NVIDIA Neural Modules 2.2.1" highlights
# of NeMo's CHANGELOG.md (tag v2.2.1, 2025-03-31: MoE training instability, Llama 3.2 exporter, LoRA
# linear_fc1 adapter); 25.02 predates it and carries v2.2.0 (2025-03-12).
NEMO_IN_CONTAINER = {"nvcr.io/nvidia/nemo:25.02": "2.2.0", "nvcr.io/nvidia/nemo:25.02.01": "2.2.1"}


def test_nemo_image_ships_the_nemo_the_actor_targets():
    """containers/Dockerfile's default base image carries the nemo-toolkit the NeMo-Aligner actor names as its target
    (actors/nemo_aligner.TARGET_VERSIONS, the version the nemo test tier installs), and the documents name that
    image."""
    from laconic_nemo.actors.nemo_aligner import TARGET_VERSIONS

    docker = (ROOT / "containers" / "Dockerfile").read_text()
    base = re.findall(r"^ARG BASE_IMAGE=(\S+)$", docker, re.M)
    assert len(base) == 1 and base[0] in NEMO_IN_CONTAINER, base
    assert NEMO_IN_CONTAINER[base[0]] == TARGET_VERSIONS["nemo_toolkit"]
    assert f'"nemo-toolkit[nlp]=={TARGET_VERSIONS["nemo_toolkit"]}"' in (ROOT / "containers" / "cpu_nemo_venv.sh").read_text()
    tag = base[0].split(":", 1)[1]
    for doc in ("README.md", "containers/README.md", "docs/cluster.md", "laconic_nemo/actors/nemo_aligner.py"):
        text = (ROOT / doc).read_text()
        assert f"nvcr.io/nvidia/nemo:{tag}`" in text, doc


def _wrappers_table():
    """launch/wrappers.py, the table the training wrappers are written from (a script, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_wrappers", LAUNCH / "wrappers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_training_wrappers_equal_their_rows_in_the_table(tmp_path):
    """Every launch/<name>.sh that sources submit.sh is what launch/wrappers.py writes for its row, byte for byte;
    the check names a wrapper edited by hand and one without a row, and writing the table restores the first."""
    table = _wrappers_table()
    assert table.stale() == []
    assert subprocess.run([sys.executable, str(LAUNCH / "wrappers.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60).returncode == 0
    copy = tmp_path / "launch"
    shutil.copytree(LAUNCH, copy)
    edited = copy / "deepseek_b1500.sh"
    edited.write_text(edited.read_text().replace("#SBATCH --nodes=2", "#SBATCH --nodes=3"))
    (copy / "my_run.sh").write_text(table.WRAPPERS[0].render())
    assert table.stale(copy) == ["deepseek_b1500.sh differs from its row in launch/wrappers.py",
                                 "my_run.sh sources submit.sh but has no row in launch/wrappers.py"]
    table.write(copy)
    assert table.stale(copy) == ["my_run.sh sources submit.sh but has no row in launch/wrappers.py"]
    assert os.access(edited, os.X_OK)


def test_every_wrapper_row_fits_its_recipe():
    """Each row's node count passes `plan` for its recipe on 8 GPUs per node, and a row names an HF checkpoint to
    convert exactly when the recipe is a .nemo one not produced by an earlier run (ThinkPrune's later stages
    start from the previous stage's export; model.source hf reads the HF folder itself)."""
    table = _wrappers_table()
    assert len({w.name for w in table.WRAPPERS}) == len(table.WRAPPERS)
    for w in table.WRAPPERS:
        cfg = load_config(ROOT / w.recipe)
        plan = plan_layout(cfg, w.nodes, 8, check_paths=False)
        assert plan.world_size == 8 * w.nodes, w.name
        converts = cfg.model.source == "nemo" and not str(cfg.model.path).startswith("/results/")
        assert (w.hf_model is not None) == converts, w.name


def test_default_mounts_are_the_scripts_from_the_repository_root(monkeypatch):
    """Without MOUNTS or REPO_DIR, `plan` mounts the repository root (the folder holding launch/ and recipes/) where
    launch/submit.sh mounts REPO_DIR (its default: the submit folder, the repository root), with the same
    DATA_DIR / CKPT_DIR / RESULTS_DIR defaults."""
    from laconic_nemo.plan.cli import default_mounts

    for key in ("REPO_DIR", "DATA_DIR", "CKPT_DIR", "RESULTS_DIR", "MOUNTS"):
        monkeypatch.delenv(key, raising=False)
    cmds = dry_run("deepseek_b1500.sh", SLURM_JOB_NUM_NODES="2", REPO_DIR=str(ROOT))
    script = next(t.split("=", 1)[1] for t in shlex.split(cmds[-1]) if t.startswith("--container-mounts="))
    assert default_mounts() == script
    assert default_mounts().endswith(f",{ROOT}:/opt/laconic-nemo") and (ROOT / "launch" / "submit.sh").is_file()
