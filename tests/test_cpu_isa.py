"""The instruction set of CPU runs (laconic_nemo/runtime/cpu_isa.py): the machine's own kernels by default, which
variables a pinned CPU run on x86-64 gets (LACONIC_CPU_ISA=avx2), which runs are left alone, the key that names it,
and (slow) the main job's bits under two instruction-set settings of one machine: equal once pinned, different
without the pin."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from laconic_nemo.runtime import cpu_isa as isa

ROOT = Path(__file__).resolve().parent.parent
X86 = platform.machine().lower() in isa.X86_64
PINNED = {"pin": "avx2", "machine": platform.machine(), "aten": "AVX2", "mkl_cbwr": "COMPATIBLE",
          "onednn_max_cpu_isa": "AVX2"}


def test_a_cpu_run_runs_the_machines_own_kernels_unless_pinned(monkeypatch):
    """The default is the machine's own kernels: nothing is written into the environment. LACONIC_CPU_ISA=avx2 pins,
    overriding what the environment says (the variables stand for the machine's own choice, which is what differs
    between machines); a GPU run and another machine get nothing either way."""
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    assert isa.cpu_isa_setting({}) == "native"
    pin = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    env = {"LACONIC_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AUTO", "OTHER": "1"}
    assert isa.pin_cpu_isa(env) == pin and env == {**pin, "LACONIC_CPU_ISA": "avx2", "OTHER": "1"}
    for env, cpu in (({"ATEN_CPU_CAPABILITY": "avx512"}, True),
                     ({"LACONIC_CPU_ISA": "native", "ATEN_CPU_CAPABILITY": "avx512"}, True),
                     ({"LACONIC_CPU_ISA": " Native ", "ATEN_CPU_CAPABILITY": "avx512"}, True),
                     ({"LACONIC_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx512"}, False)):
        before = dict(env)
        assert isa.pin_cpu_isa(env, cpu=cpu) == {} and env == before
    assert isa.pin_cpu_isa({"LACONIC_CPU_ISA": "AVX2"}) == isa.PINS["avx2"]
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    env = {"LACONIC_CPU_ISA": "avx2"}
    assert isa.pin_cpu_isa(env) == {} and env == {"LACONIC_CPU_ISA": "avx2"}


def test_a_bad_setting_names_the_variable_and_the_choices():
    with pytest.raises(ValueError, match=r"LACONIC_CPU_ISA = 'avx512' is invalid: allowed avx2 \| native"):
        isa.pin_cpu_isa({"LACONIC_CPU_ISA": "avx512"})


def test_train_refuses_a_bad_setting_before_starting_anything(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "laconic_nemo", "train", "recipes/tiny_cpu.yaml",
                           f"run.output_dir={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "LACONIC_CPU_ISA": "sse2"}, timeout=300)
    assert proc.returncode == 2 and "LACONIC_CPU_ISA = 'sse2' is invalid: allowed avx2 | native" in proc.stderr
    assert not (tmp_path / "out").exists()


def _isa_in(env: dict) -> dict:
    """cpu_isa() of a fresh process after pin_cpu_isa(), with ``env``."""
    code = ("import json; from laconic_nemo.runtime.cpu_isa import cpu_isa, pin_cpu_isa; pin_cpu_isa(); "
            "print(json.dumps(cpu_isa()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=120).stdout
    return json.loads(out.splitlines()[-1])


@pytest.mark.skipif(not X86, reason="the pin is for x86-64 machines")
def test_the_in_container_entry_pins_a_cpu_run_before_training(monkeypatch, tmp_path):
    """launch/submit.sh runs `python -m laconic_nemo.nemo_entry` under srun; for a megatron-core recipe it hands the
    config to train_cli.train. Its CPU ranks run the kernels `laconic-nemo train`'s do: with LACONIC_CPU_ISA=avx2 the
    pin is in the environment before train starts (before the first kernel; a Slurm job's rows equal the local
    run's), by default nothing is."""
    from laconic_nemo.app import nemo_entry, train_cli

    seen = {}

    def fake_train(cfg):
        seen.update({k: os.environ.get(k) for k in isa.PINS["avx2"]})
        return 0

    monkeypatch.setattr(train_cli, "train", fake_train)
    for key in ("LACONIC_CPU_ISA", *isa.PINS["avx2"]):  # recorded as they are: the pin the entry writes into
        monkeypatch.setenv(key, "")                    # os.environ is undone after the test, not left to the next
    for setting, expected in (("avx2", isa.PINS["avx2"]), (None, dict.fromkeys(isa.PINS["avx2"]))):
        for key in ("LACONIC_CPU_ISA", *isa.PINS["avx2"]):
            monkeypatch.delenv(key, raising=False)
        if setting is not None:
            monkeypatch.setenv("LACONIC_CPU_ISA", setting)
        seen.clear()
        rc = nemo_entry.main([str(ROOT / "recipes" / "tiny_cpu.yaml"), f"run.output_dir={tmp_path / 'out'}"])
        assert rc == 0 and seen == expected, setting


def test_the_key_names_the_kernels_in_effect():
    """Pinned: ATen's capability in effect is AVX2 and the key names the pin (the same on every AVX2 machine, no CPU
    model); native: the machine's own choice and its CPU model."""
    pinned = _isa_in({"LACONIC_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "default"})
    assert pinned == PINNED
    native = _isa_in({"LACONIC_CPU_ISA": "native", "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO"})
    assert native["pin"] is None and native["aten"] == "DEFAULT" and native["mkl_cbwr"] == "AUTO" and native["cpu"]
    assert isa.describe(pinned) == "ATen AVX2, MKL_CBWR=COMPATIBLE, ONEDNN_MAX_CPU_ISA=AVX2"


@pytest.mark.skipif(not X86, reason="the pin is for x86-64 machines")
def test_the_planned_kernels_are_what_a_pinned_process_runs(monkeypatch):
    """An evaluation looks the trainer's warm-up up under planned_cpu_isa(): pinned, in this (unpinned) test process
    it equals what a freshly pinned process reports, so the lookup finds the ranks' cache; native (the default), it is
    this process's own."""
    monkeypatch.setenv("LACONIC_CPU_ISA", "avx2")
    assert isa.planned_cpu_isa() == _isa_in({"LACONIC_CPU_ISA": "avx2"}) == PINNED
    for setting in ("native", None):
        if setting is None:
            monkeypatch.delenv("LACONIC_CPU_ISA")
        else:
            monkeypatch.setenv("LACONIC_CPU_ISA", setting)
        assert isa.planned_cpu_isa() == isa.cpu_isa()


@pytest.mark.skipif(not X86, reason="the pin is for x86-64 machines")
def test_mkl_honours_the_pinned_branch_on_this_processor():
    """MKL reports the branch it runs (its exported mkl_serv_cbwr_get(MKL_CBWR_BRANCH)): COMPATIBLE (3) under the pin
    on this processor, whatever its vendor; AVX2 is not a pin that holds everywhere (MKL runs it on Intel processors
    only; elsewhere it reports AUTO, 2)."""
    code = ("import ctypes, os, torch; from laconic_nemo.runtime.cpu_isa import pin_cpu_isa; pin_cpu_isa(); "
            "lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_cpu.so')); "
            "f = getattr(lib, 'mkl_serv_cbwr_get', None); a = torch.ones(8, 8); (a @ a).sum(); "
            "print(-1 if f is None else f(1))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "LACONIC_CPU_ISA": "avx2"}, timeout=120)
    branch = int(out.stdout.split()[-1])
    if branch == -1:
        pytest.skip("this torch build does not export MKL's branch query (no MKL)")
    assert branch == 3  # MKL_CBWR_COMPATIBLE


# ----------------------------------------------------------------------------------------------- the main job's bits
# the tiny recipe, smaller (as the mechanics tests of tests/test_trainer_e2e.py): a warm-up and two GRPO steps
FAST = ["model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "warmup.num_steps=20",
        "grpo.num_prompts_per_step=4", "grpo.group_size=4", "grpo.minibatch_size=8", "grpo.micro_batch_size=4",
        "rollout.max_new_tokens=40", "laconic.budget=20", "laconic.eta=0.5", "laconic.ceiling=1.0", "logging.plot=false",
        "logging.tensorboard=false", "run.num_steps=2"]
# two machines' own choices, as one machine can make them: ATen's scalar and AVX2 kernels, MKL's automatic and
# its COMPATIBLE branch, oneDNN's SSE4.1 and AVX2 code (every x86-64 CPU with AVX2 runs them all); b is the pin
MACHINES = {"a": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO", "ONEDNN_MAX_CPU_ISA": "SSE41"},
            "b": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def _bits(tmp: Path, name: str, env: dict) -> tuple[list[dict], str, dict]:
    """(metrics rows without timings, sha256 of the cached warm-up policy's tensors, the cache's meta.json key) of
    the fast recipe launched as the main job is, with ``env``."""
    import torch

    out = tmp / name
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                              "MASTER_ADDR", "MASTER_PORT", "ATEN_CPU_CAPABILITY",
                                                              "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "LACONIC_CPU_ISA")}
    proc = subprocess.run([sys.executable, "-m", "laconic_nemo", "train", "recipes/tiny_cpu.yaml", *FAST,
                           f"run.output_dir={out}", f"warmup.cache_dir={out / 'cache'}"], cwd=ROOT,
                          env={**base, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "step_seconds"))}
            for line in (out / "metrics.jsonl").read_text().splitlines()]
    (cache,) = (out / "cache").glob("policy_*")
    h = hashlib.sha256()
    for shard in sorted(cache.glob("*.pt")):
        for k, v in sorted(torch.load(shard, weights_only=False).items()):
            if isinstance(v, torch.Tensor):
                h.update(k.encode() + v.contiguous().numpy().tobytes())
    return rows, h.hexdigest(), json.loads((cache / "meta.json").read_text())["key"]


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="the pin is for x86-64 machines")
def test_the_main_job_gives_the_same_bits_under_two_instruction_set_settings(tmp_path):
    """Two settings of one machine stand for two machines of one vendor (what the pin buys: docs/megatron_cpu.md).
    Without the pin (LACONIC_CPU_ISA=native, the default) the warm-up and the first GRPO steps differ between them in
    their bits (so the settings matter here); pinned (LACONIC_CPU_ISA=avx2), machine a's ranks run ATen's AVX2 kernels
    and MKL's COMPATIBLE branch, machine b's own choice, and the cached warm-up policy and every metric equal b's, bit
    for bit, with the pin named in the cache's meta.json."""
    native = {m: _bits(tmp_path, f"native_{m}", {**env, "LACONIC_CPU_ISA": "native"}) for m, env in MACHINES.items()}
    assert native["a"][1] != native["b"][1] and native["a"][0] != native["b"][0]
    assert native["a"][2]["cpu_isa"]["aten"] == "DEFAULT" and native["a"][2]["cpu_isa"]["pin"] is None
    pinned = _bits(tmp_path, "pinned_a", {**MACHINES["a"], "LACONIC_CPU_ISA": "avx2"})
    assert pinned[1] == native["b"][1]
    assert pinned[0] == native["b"][0] and [r["step"] for r in pinned[0]] == [1, 2]
    assert pinned[2]["cpu_isa"] == native["b"][2]["cpu_isa"] == PINNED
    assert pinned[2] == native["b"][2]  # one key: one cached policy for both machines


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="the pin is for x86-64 machines")
def test_a_resume_under_other_kernels_is_named_once_and_never_refused(tmp_path):
    """A preempted job may come back on another machine or setting: a resume whose CPU kernels are not those its
    checkpoint was written with goes on (status 0) and names both once, on the console and in the resumed row's
    notes; a resume under the checkpoint's own kernels says nothing. Each way: native -> avx2 (-> avx2) -> native.
    One process, the tiny recipe's small variant (the e2e tests' shapes), a checkpoint after every step."""
    from tests.test_reliability_e2e import launch, rows
    from tests.test_trainer_e2e import FAST, TINY

    out = tmp_path / "run"
    args = [TINY, *FAST, "parallel.tensor_model_parallel_size=1", "checkpoint.every_n_steps=1",
            f"warmup.cache_dir={tmp_path / 'cache'}"]
    prefix = "laconic-nemo train: resumed under other CPU kernels than the checkpoint's"
    said = {}
    for steps, setting in ((1, "native"), (2, "avx2"), (3, "avx2"), (4, "native")):
        run = launch([*args, f"run.num_steps={steps}"], out, env_extra={isa.ISA_ENV: setting}, timeout=400)
        assert run.rc == 0, run.out[-3000:]
        said[steps] = [line for line in run.out.splitlines() if line.startswith(prefix)]
    ckpt = out / "checkpoints"
    native = r"ATen \w+, MKL_CBWR=\w+, ONEDNN_MAX_CPU_ISA=\w+, .+ \(LACONIC_CPU_ISA=native or a machine without the pin\)"
    avx2 = r"ATen AVX2, MKL_CBWR=COMPATIBLE, ONEDNN_MAX_CPU_ISA=AVX2 \(LACONIC_CPU_ISA=avx2\)"
    assert said[1] == [] and said[3] == []  # a fresh start; the same kernels as the checkpoint's
    for steps, before, now in ((2, native, avx2), (4, avx2, native)):
        (line,) = said[steps]
        where = re.escape(f"{prefix}: {ckpt / f'step_{steps - 1:06d}'} was written with ")
        assert re.fullmatch(rf"{where}{before}, this process runs with {now}; its steps from here round otherwise "
                            r"than those of a run that kept the checkpoint's kernels", line), line
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    notes = {r["step"]: r["notes"] for r in got if "notes" in r}
    assert notes == {2: [said[2][0][len("laconic-nemo train: "):]], 4: [said[4][0][len("laconic-nemo train: "):]]}
