"""The cluster path. Through NeMo's own code on CPU (pytest marker `nemo`: nemo-toolkit 2.2.1 + nemo-aligner 0.7.0):
the HF -> .nemo conversion of ``prepare`` (one conversion per target, jobs at once, a job killed while it saves)
and the final ``.nemo`` export, both through NeMo's ``NLPSaveRestoreConnector.save_to`` on a real tiny
``MegatronGPTModel``; the export of a run whose NeMo model has its own output layer; the LR schedule's length.
Two ranks of the NeMo entry point stopped by a signal during NeMo's start-up. Without NeMo: a preemption signal
during the NeMo entry point's start-up."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

import pytest
import torch

from laconic_nemo.config import load_config
from tests.test_nemo_aligner import (  # noqa: F401  (fixtures)
    _nemo_gpt_model,
    _torch_dist_writer_for_this_torch,
    cpu_cuda_shims,
    gloo_world,
    nemo_skip,
)

ROOT = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 900.0  # generous: only against a hang (the machine is shared; no assertion on time)


def _wait(cond, what: str, timeout_s: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def _nemo_members(path: Path) -> list[str]:
    with tarfile.open(path) as tar:
        return sorted(n.lstrip("./") for n in tar.getnames() if n not in (".", "./"))


def _assert_complete_nemo(path: Path, hidden: int) -> None:
    """A .nemo NeMo packed whole: its config and a distributed checkpoint with metadata and shards."""
    members = _nemo_members(path)
    assert "model_config.yaml" in members and "model_weights/metadata.json" in members, members
    assert any(m.startswith("model_weights/") and m.endswith(".distcp") for m in members), members
    with tarfile.open(path) as tar:
        config = next(tar.extractfile(m).read().decode() for m in tar.getmembers() if m.name.endswith("model_config.yaml"))
    assert f"hidden_size: {hidden}" in config


# ---------------------------------------------------------------------------------------------- prepare: conversions
def _cpu_stand_ins(patch) -> None:
    """What the tests in this tier patch for NeMo on CPU (``cpu_cuda_shims``, ``gloo_world``'s ``Tensor.cuda``, and
    megatron-core's torch_dist byte writer for this torch)."""
    patch.setattr(torch.cuda, "current_device", lambda: "cpu")
    patch.setattr(torch.cuda, "FloatTensor", lambda data: torch.tensor(data, dtype=torch.float32))
    patch.setattr(torch.cuda, "LongTensor", lambda data: torch.tensor(data, dtype=torch.long))
    patch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    patch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _torch_dist_writer_for_this_torch(patch)


# Imported once by the fork server the jobs start from (a fresh interpreter: a process forked from pytest would
# inherit the process groups of earlier tests, whose destructors wait for threads that do not exist after fork).
FORKSERVER_PRELOAD = ["tests.test_nemo_cluster", "nemo.collections.nlp.models.language_modeling.megatron_gpt_model",
                      "nemo.collections.nlp.parts.nlp_overrides", "nemo.utils.callbacks.dist_ckpt_io"]


def _conversion_job(name: str, target: Path, hf: str, root: Path, hold: bool) -> None:
    """One Slurm job's ``prepare`` step, in a process of its own (and its own process group, like an srun step):
    ``laconic_nemo.app.nemo_entry.prepare`` with a converter that does what NeMo's
    ``convert_qwen2_hf_to_nemo.py`` (v2.2.1, lines 300-309) does last: build the ``MegatronGPTModel``, set an
    ``NLPSaveRestoreConnector`` and ``model.save_to(--output_path)``. ``hold``: after NeMo has written the
    distributed checkpoint (``model_weights``) and before it packs the .nemo, signal ``<name>.saved`` and wait for
    ``<name>.release`` (the test kills or releases the job there)."""
    os.setpgrp()
    log = open(root / f"{name}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    rc = 1
    try:
        import torch.distributed as dist
        from _pytest.monkeypatch import MonkeyPatch
        from megatron.core import parallel_state
        from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
        from nemo.collections.nlp.parts.nlp_overrides import NLPSaveRestoreConnector
        from nemo.utils.callbacks.dist_ckpt_io import DistributedCheckpointIO

        from laconic_nemo.app.nemo_entry import prepare

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{root}/{name}.store", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        init_num_microbatches_calculator(rank=0, rampup_batch_size=None, global_batch_size=6, micro_batch_size=3,
                                         data_parallel_size=1)
        patch = MonkeyPatch()  # this process only; it ends with the job
        _cpu_stand_ins(patch)
        if hold:
            save = DistributedCheckpointIO.save_checkpoint

            def save_then_hold(self, checkpoint, path, storage_options=None):
                save(self, checkpoint, path, storage_options)
                (root / f"{name}.saved").write_text(str(path))
                _wait((root / f"{name}.release").exists, f"{name}.release")

            patch.setattr(DistributedCheckpointIO, "save_checkpoint", save_then_hold)

        def convert(cmd: list[str]) -> int:
            model = _nemo_gpt_model(patch, hf)
            model._save_restore_connector = NLPSaveRestoreConnector()
            model.save_to(cmd[cmd.index("--output_path") + 1])
            return 0

        cfg = load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml", [f"model.path={target}"])
        rc = prepare(cfg, hf, run=convert)
    except BaseException:
        traceback.print_exc()
    finally:
        log.flush()
    sys.exit(rc)


@pytest.mark.nemo
@pytest.mark.slow
@nemo_skip
def test_prepare_one_conversion_per_target_and_after_a_killed_one(tmp_path):
    """Two jobs convert the same .nemo at once, then a job is killed while NeMo saves another .nemo of the same
    folder and the next job converts it. Every conversion goes through NeMo's ``save_to``, which puts the
    distributed checkpoint in ``dirname(output)/model_weights`` (``nlp_overrides.py:1068-1085``) where
    megatron-core refuses a non-empty folder (``serialization.py:353-356``): without a private folder per
    conversion the second job fails there, and so does every conversion after the killed one."""
    from tests.hf_fixtures import save_tiny_qwen2

    hf = save_tiny_qwen2(tmp_path / "hf", hidden=32, layers=1)
    ck = tmp_path / "checkpoints"
    target, other = ck / "shared.nemo", ck / "other.nemo"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)

    def start(name, path, hold):
        p = ctx.Process(target=_conversion_job, args=(name, path, hf, tmp_path, hold), name=name)
        p.start()
        return p

    def log(name):
        f = tmp_path / f"{name}.log"
        return f.read_text() if f.exists() else ""

    def finish(p):
        p.join(HANG_GUARD_S)
        assert p.exitcode is not None, f"{p.name} hangs"
        return p.exitcode

    # 1. job a is inside NeMo's save (its weights written, the .nemo not yet packed) when job b starts
    a = start("a", target, hold=True)
    _wait(lambda: (tmp_path / "a.saved").exists() or not a.is_alive(), "job a to write its weights")
    b = start("b", target, hold=False)
    _wait(lambda: not b.is_alive() or "prepare: waiting for" in log("b"), "job b to finish or wait")
    (tmp_path / "a.release").touch()
    assert finish(a) == 0, log("a")
    assert finish(b) == 0, log("b")
    _assert_complete_nemo(target, hidden=32)
    assert "written by another job meanwhile" in log("b") and "convert_qwen2" not in log("b")  # b waited, converted nothing
    assert sorted(p.name for p in ck.iterdir()) == ["shared.nemo"]  # no lock, scratch folder or model_weights

    # 2. job c is killed (with its whole process group) inside NeMo's save of another .nemo in the same folder
    c = start("c", other, hold=True)
    _wait(lambda: (tmp_path / "c.saved").exists() or not c.is_alive(), "job c to write its weights")
    assert c.is_alive(), log("c")
    os.killpg(c.pid, signal.SIGKILL)
    c.join(HANG_GUARD_S)
    assert c.exitcode == -signal.SIGKILL
    assert not other.exists()
    d = start("d", other, hold=False)
    assert finish(d) == 0, log("d")
    _assert_complete_nemo(other, hidden=32)
    assert "took over" in log("d") and "left by an interrupted conversion" in log("d")
    assert sorted(p.name for p in ck.iterdir()) == ["other.nemo", "shared.nemo"]  # no lock, scratch or model_weights


# ---------------------------------------------------------------------------------------------- the final .nemo export
@pytest.mark.nemo
@nemo_skip
@pytest.mark.usefixtures("gloo_world", "cpu_cuda_shims")
def test_final_export_after_an_interrupted_one(monkeypatch, tmp_path):
    """The run's last act, ``export/policy.nemo`` through NeMo's ``save_to``, must succeed on a rerun after an
    export that was interrupted once NeMo had written ``model_weights`` (megatron-core refuses that folder when it
    is not empty, ``serialization.py:353-356``): what the old ``model.save_to(export/policy.nemo)`` left
    (``export/model_weights``) and what an interrupted export of this code leaves (its scratch folder)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from nemo.collections.nlp.parts.nlp_overrides import NLPSaveRestoreConnector

    from laconic_nemo.app.nemo_entry import export_policy_nemo
    from laconic_nemo.tools.export import load_nemo_weights
    from tests.hf_fixtures import save_tiny_qwen2

    _torch_dist_writer_for_this_torch(monkeypatch)
    model = _nemo_gpt_model(monkeypatch, save_tiny_qwen2(tmp_path / "hf", hidden=32, layers=1))
    model._save_restore_connector = NLPSaveRestoreConnector()
    export = tmp_path / "run" / "export"
    for leftover in (export / "model_weights", export / ".policy.nemo.scratch" / "model_weights"):
        leftover.mkdir(parents=True)
        (leftover / "__0_0.distcp").write_bytes(b"partial")
    with pytest.raises(CheckpointingException, match="is not empty"):  # the upstream call into that folder
        model.save_to(str(export / "policy.nemo"))

    path = export_policy_nemo(model, tmp_path / "run", 0)
    assert path == export / "policy.nemo"
    _assert_complete_nemo(path, hidden=32)
    assert not (export / ".policy.nemo.scratch").exists()
    with tarfile.open(path) as tar:  # the packed weights are the model's
        tar.extractall(tmp_path / "unpacked", filter="data")
    saved = load_nemo_weights(tmp_path / "unpacked" / "model_weights")
    for name, p in model.model.named_parameters():
        assert torch.equal(saved[name], p.detach()), name


@pytest.mark.nemo
@nemo_skip
@pytest.mark.usefixtures("gloo_world", "cpu_cuda_shims")
def test_export_keeps_the_trained_output_layer_of_a_tied_checkpoint(monkeypatch, tmp_path):
    """Qwen2.5-Math-1.5B(-Instruct) ties its embeddings (``tie_word_embeddings: true`` in its config.json). NeMo's
    converter (``convert_qwen2_hf_to_nemo.py`` v2.2.1, lines 284-289) copies HF's ``lm_head.weight`` - the embedding
    of a tied model - into ``model.output_layer.weight`` of a model built from ``megatron_qwen2_config.yaml``
    (``share_embeddings_and_output_weights: False``, line 86), so NeMo trains that output layer on its own. The
    export of such a run must keep the trained layer: the Hugging Face logits equal NeMo's."""
    import contextlib

    import transformers
    from megatron.core.tensor_parallel import random as mp_random
    from nemo.utils.callbacks.dist_ckpt_io import DistributedCheckpointIO

    from laconic_nemo.cli import main as cli_main
    from tests.hf_fixtures import save_tiny_qwen2

    torch.manual_seed(0)
    hf = save_tiny_qwen2(tmp_path / "hf", hidden=32, layers=1, tie=True)
    assert json.loads((Path(hf) / "config.json").read_text())["tie_word_embeddings"] is True
    model = _nemo_gpt_model(monkeypatch, hf)
    assert model.cfg.share_embeddings_and_output_weights is False  # as the converter's megatron_qwen2_config.yaml
    emb, out_w = model.model.embedding.word_embeddings.weight, model.model.output_layer.weight
    with torch.no_grad():  # the conversion (output layer = the tied embedding), then training moved the layer
        out_w.copy_(emb + 0.05 * torch.randn_like(emb))
    monkeypatch.setattr(mp_random.CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext())
    V = json.loads((Path(hf) / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, V, (2, 7))
    with torch.no_grad():
        causal = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1).expand(2, 1, 7, 7)
        ref = model(tokens, torch.arange(7).expand(2, 7), causal, labels=None)

    _torch_dist_writer_for_this_torch(monkeypatch)
    nemo_dir = tmp_path / "nemo_ckpt"
    DistributedCheckpointIO("torch_dist").save_checkpoint({"state_dict": model.sharded_state_dict()}, str(nemo_dir))
    out = tmp_path / "out"
    assert cli_main(["export", str(nemo_dir), "--to", "hf", str(out), "--hf-config", hf]) == 0
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf_model(input_ids=tokens).logits
    assert (got - ref).abs().max() < 1e-5
    assert torch.equal(hf_model.lm_head.weight, out_w.detach())
    assert not torch.equal(hf_model.lm_head.weight, hf_model.model.embed_tokens.weight)


# ---------------------------------------------------------------------------------------------- LR schedule length
@pytest.mark.nemo
@nemo_skip
def test_lr_schedule_spans_every_optimiser_step_of_the_run():
    """NeMo builds the scheduler with ``sched.max_steps = trainer.max_steps`` (``nemo/core/classes/modelPT.py:694``;
    ``megatron_base_model.py:785-787`` takes the same value) through ``prepare_lr_scheduler``, and the actor steps
    it once per optimiser step (``NemoAlignerActor.train_step``), rollout batch / minibatch = 2 times per GRPO step
    here. With a decay (min_lr below lr) every optimiser step of the run must train at a learning rate above
    min_lr, reaching min_lr only after the last one."""
    from nemo.core.optim.lr_scheduler import prepare_lr_scheduler
    from omegaconf import OmegaConf

    from laconic_nemo.app.nemo_entry import build_nemo_config

    cfg = load_config(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml",
                      ["run.num_steps=3", "grpo.num_prompts_per_step=4", "grpo.group_size=4", "grpo.minibatch_size=8",
                       "optim.warmup_steps=1"])
    ncfg = build_nemo_config(cfg, 1, 1, ["model.optim.sched.min_lr=0.0"])
    sched_cfg = OmegaConf.to_container(ncfg.model.optim.sched, resolve=True)
    sched_cfg["max_steps"] = ncfg.trainer.max_steps  # modelPT.py:694
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(ncfg.model.optim.lr))
    sched = prepare_lr_scheduler(opt, sched_cfg)["scheduler"]
    used = []
    for _ in range(3 * 2):  # run.num_steps GRPO steps x 2 optimiser steps: train_step's optimizer.step(), scheduler.step()
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert min(used) > 0.0, used
    assert used[2:] == sorted(used[2:], reverse=True)  # after the warm-up: cosine decay over the whole run
    assert opt.param_groups[0]["lr"] == 0.0  # min_lr once the run's last optimiser step is done


# ---------------------------------------------------------------------------------------------- start-up signal
ENTRY_WITH_SIGNAL_DURING_START_UP = """
import os, signal, sys
import laconic_nemo.app.nemo_entry as entry
import laconic_nemo.runtime.run_lock as run_lock
check = run_lock.check_free
def check_free(*args, **kwargs):  # Slurm's notice arrives while the entry point starts up
    os.kill(os.getpid(), signal.SIG{sig})
    return check(*args, **kwargs)
run_lock.check_free = check_free
sys.exit(entry.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_entry_stops_with_status_3_on_a_signal_during_start_up(tmp_path, sig):
    """``launch/submit.sh`` requeues a job only when the train step exits 3. A SIGUSR1 / SIGTERM that reaches the
    NeMo entry point before the trainer installs its handler must end a lone process with 3, not with the signal's
    default action (the process killed, status 128 + signal, no requeue)."""
    recipe = str(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, "-c", ENTRY_WITH_SIGNAL_DURING_START_UP.format(sig=sig), recipe,
                          f"run.output_dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    assert out.returncode == 3, (out.returncode, out.stderr[-2000:])
    assert f"stopped on signal {int(getattr(signal, 'SIG' + sig))} during start-up" in out.stderr
    assert not (tmp_path / "run").exists()  # nothing was started


def _start_two_ranks(monkeypatch, tmp_path: Path, out: Path, env: dict[str, str], *overrides: str) -> list:
    """Two ranks of the NeMo entry point over gloo (tests/dist/nemo_entry_rank.py: NeMo's and NeMo-Aligner's own
    start-up on CPU), a ``model.source: nemo`` recipe on a real tiny .nemo (a distributed checkpoint, so its
    ``load_from_nemo`` creates the process groups), ``env`` and ``overrides`` added; stdout and stderr merged."""
    from nemo.collections.nlp.parts.nlp_overrides import NLPSaveRestoreConnector

    from laconic_nemo.runtime.megatron_env import free_port
    from tests.hf_fixtures import save_tiny_qwen2

    _torch_dist_writer_for_this_torch(monkeypatch)
    model = _nemo_gpt_model(monkeypatch, save_tiny_qwen2(tmp_path / "hf", hidden=32, layers=1))
    model._save_restore_connector = NLPSaveRestoreConnector()
    model.save_to(str(tmp_path / "tiny.nemo"))
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(4)))
    args = [str(ROOT / "recipes" / "deepseek_1.5b_b1500.yaml"), f"model.path={tmp_path / 'tiny.nemo'}",
            f"data.train_files=[{data}]", f"run.output_dir={out}", "grpo.num_prompts_per_step=2",
            "grpo.group_size=2", "grpo.minibatch_size=4", "grpo.micro_batch_size=1", "rollout.max_new_tokens=8",
            "laconic.budget=4", "reward.num_workers=1", "logging.tensorboard=false",
            "nemo.trainer.accelerator=cpu", "nemo.trainer.devices=2", "nemo.trainer.precision=32",
            "nemo.model.precision=32", "nemo.model.megatron_amp_O2=false",
            "nemo.model.gradient_as_bucket_view=true", *overrides]  # in NeMo's megatron_qwen2_config.yaml, not the .nemo
    port = free_port()
    procs = []
    for rank in (0, 1):
        rank_env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "OMP_NUM_THREADS": "1", **env}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "dist" / "nemo_entry_rank.py"), *args],
                                      env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.nemo
@pytest.mark.slow
@nemo_skip
@pytest.mark.usefixtures("gloo_world", "cpu_cuda_shims")
def test_two_ranks_stop_with_status_3_on_a_signal_during_the_nemo_start_up(monkeypatch, tmp_path):
    """Two ranks of the NeMo entry point over gloo (tests/dist/nemo_entry_rank.py: NeMo's and NeMo-Aligner's own
    start-up on CPU), a ``model.source: nemo`` recipe on a real tiny .nemo; rank 1 gets SIGUSR1 while its model
    loads, rank 0 none. A rank of a multi-rank start does not stop alone (the other would wait in a collective): both
    go through ``load_from_nemo``, the Lightning trainer, ``init_distributed`` and ``init_using_ptl`` to the trainer,
    agree on the stop and exit 3, which launch/submit.sh requeues (tests/test_launch.py), with nothing trained or
    saved. Nothing on that way replaces the start-up handler: ``init_using_ptl``
    (``nemo_aligner/utils/train_script_utils.py:105-125``) calls the ``on_fit_start`` hooks, not ``on_train_start``
    where NeMo's PreemptionCallback installs its SIGTERM handler (``nemo/utils/callbacks/preemption.py:48-77``), and
    never ``Trainer._run``, where Lightning registers its own (``lightning/pytorch/trainer/trainer.py:976``)."""
    out = tmp_path / "run"
    procs = _start_two_ranks(monkeypatch, tmp_path, out, {"SIGNAL_RANK": "1"})
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=HANG_GUARD_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 3, (rank, p.returncode, text[-3000:])
    assert "stopped on a signal during start-up; nothing to save yet" in outputs[0]  # rank 0 logs it
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1]  # rank 1 went on after its signal
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists() and not (out / "run.lock").exists()


COLLECTIVE_TIMEOUT_S = 30.0  # parallel.collective_timeout_s of the test (the recipe's default is 600 s)


@pytest.mark.nemo
@pytest.mark.slow
@nemo_skip
@pytest.mark.usefixtures("gloo_world", "cpu_cuda_shims")
def test_a_stopped_rank_ends_the_nemo_job_within_the_collective_timeout(monkeypatch, tmp_path):
    """Two ranks of the NeMo entry point with ``parallel.collective_timeout_s = 30``. Once the process groups exist
    (created inside NeMo's ``load_from_nemo`` for this distributed checkpoint, by Lightning's ``DDPStrategy`` and
    NeMo's ``init_model_parallel``), rank 1 stops inside the collective it was to join (SIGSTOP: its connections
    stay open, as a dead rank's do under NCCL) and rank 0 waits in an all-reduce on megatron's data-parallel group,
    then on the default group. Each fails after the recipe's 30 s, not after Lightning's default of 30 minutes
    (``set_collective_timeout``), and rank 0 exits with a failure within two timeouts; rank 1 is then killed, as
    ``srun --kill-on-bad-exit`` does. Before the timeout reached NeMo's strategy, rank 0 waited 30 minutes in the
    first collective (the hang guard of this test)."""
    out = tmp_path / "run"
    procs = _start_two_ranks(monkeypatch, tmp_path, out, {"STOP_RANK": "1"},
                             f"parallel.collective_timeout_s={COLLECTIVE_TIMEOUT_S}")
    try:
        text = procs[0].communicate(timeout=HANG_GUARD_S)[0]
        stopped = open(f"/proc/{procs[1].pid}/stat").read().split(")")[-1].split()[0]  # process state of rank 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        rest = procs[1].communicate()[0]
    assert stopped == "T", (stopped, rest[-2000:])  # rank 1 was stopped, not ended, until rank 0 ended
    assert procs[0].returncode not in (0, None), text[-3000:]
    waited = {}
    for line in text.splitlines():
        if line.startswith("collective on the "):
            group, how, seconds = line.split()[3], line.split()[5], float(line.split()[-2])
            assert how == "failed", line
            waited[group] = seconds
    assert set(waited) == {"data-parallel", "default"}, text[-3000:]
    for group, seconds in waited.items():
        # the recipe's timeout (gloo reports a little later, under load), far from 30 minutes
        assert COLLECTIVE_TIMEOUT_S - 1 <= seconds <= COLLECTIVE_TIMEOUT_S + 60, (group, seconds)
    assert "Timed out" in text or "timed out" in text, text[-3000:]

@pytest.mark.nemo
@nemo_skip
def test_checkpoints_record_the_installed_versions():
    """A checkpoint names the NeMo it was written with (the container's, e.g. 2.2.0 in nemo:25.02), not the target."""
    import megatron.core
    import nemo
    import nemo_aligner

    from laconic_nemo.actors import nemo_aligner as na

    actor = object.__new__(na.NemoAlignerActor)
    actor._last_saved = "/results/run/checkpoints/nemo/step_000001"
    versions = actor.state_dict_for_checkpoint()["versions"]
    assert versions == {"nemo_aligner": nemo_aligner.__version__, "nemo_toolkit": nemo.__version__,
                        "megatron_core": megatron.core.__version__}


# ---------------------------------------------------------------------------------------------- the conversion lock
def test_conversion_lock_stale_rules(tmp_path):
    """Whose conversion lock the next job may take over: the run lock's rules (same host and the process gone, an
    earlier run of the same Slurm job) and, for a holder on another host, no refresh for STALE_AFTER_S. A live
    holder makes the next job wait (here: a wait limit of 0 s, so it gives up at once, naming the holder)."""
    from laconic_nemo.runtime.run_lock import identity
    from laconic_nemo.tools.convert_qwen2 import (
        HEARTBEAT_S,
        STALE_AFTER_S,
        ConversionBusy,
        ConversionLock,
        conversion_lock_stale,
        lock_path,
    )

    me = identity()
    assert HEARTBEAT_S < STALE_AFTER_S
    live_here = identity(os.getppid())
    assert conversion_lock_stale(live_here, 0.0, me) is None
    dead_here = {**live_here, "pid": 2**22 + 7, "start_time": "1"}
    assert "gone" in conversion_lock_stale(dead_here, 0.0, me)
    elsewhere = {**live_here, "host": "gpu-b17", "boot_id": "other", "slurm_job_id": "91"}
    assert conversion_lock_stale(elsewhere, STALE_AFTER_S - 60, me) is None
    assert "not refreshed" in conversion_lock_stale(elsewhere, STALE_AFTER_S + 60, me)
    requeued = {**elsewhere, "slurm_job_id": "92", "slurm_restart_count": "0"}
    assert "earlier run" in conversion_lock_stale(requeued, 0.0, {**me, "slurm_job_id": "92",
                                                                  "slurm_restart_count": "1"})

    target = tmp_path / "m.nemo"
    lock_path(target).write_text(json.dumps(live_here))
    messages = []
    with pytest.raises(ConversionBusy, match=f"pid {live_here['pid']} on host {live_here['host']}"):
        ConversionLock(target, messages.append).acquire(wait_limit_s=0.0, poll_s=0.01)
    assert any("waiting for" in m for m in messages)
    lock_path(target).write_text(json.dumps(dead_here))  # its holder is gone: taken over, then released
    lock = ConversionLock(target, messages.append).acquire(wait_limit_s=0.0, poll_s=0.01)
    assert json.loads(lock_path(target).read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock_path(target).exists() and sorted(p.name for p in tmp_path.iterdir()) == []
