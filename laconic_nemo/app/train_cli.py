"""`laconic-nemo train RECIPE [key=value ...]`: GRPO + LACONIC on the megatron-core actor.

Run from a plain shell, the command starts ``--nprocs`` local ranks of itself (default: TP x PP,
i.e. one data-parallel replica) and forwards signals to them; under torchrun or srun (``WORLD_SIZE``
set) it trains directly. The recipe is loaded and validated before any process, model or data exists.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from laconic_nemo.config import Config, ConfigError, load_config
from laconic_nemo.runtime.run_lock import OutputDirLock, OutputDirLocked, hold_output_dir
from laconic_nemo.runtime.stop_signals import STOP_SIGNALS, handle_stop_signals

LAUNCHER_PID_ENV = "LACONIC_LAUNCHER_PID"
RANK_REFUSAL = "laconic-nemo train: rank "  # how a rank's line of a failed check (status 2) begins


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a policy with GRPO + LACONIC from a recipe",
                              description=__doc__)
    p.add_argument("recipe", help="recipe YAML (e.g. recipes/tiny_cpu.yaml) or recipe name")
    p.add_argument("overrides", nargs=argparse.REMAINDER,
                   help="config overrides key=value (e.g. laconic.budget=30), in any order with --nprocs N")
    p.add_argument("--nprocs", type=int, default=None,
                   help="processes to start when not already under torchrun (default TP x PP)")
    p.set_defaults(func=run)


def _split_nprocs(args) -> None:
    """Take ``--nprocs N`` out of the overrides wherever it was written; refuse anything but an integer >= 1."""
    rest, items = [], list(args.overrides or [])
    while items:
        item = items.pop(0)
        if item == "--nprocs":
            if not items:
                raise ConfigError("--nprocs needs a value: an integer >= 1")
            args.nprocs = items.pop(0)
        elif item.startswith("--nprocs="):
            args.nprocs = item.split("=", 1)[1]
        else:
            rest.append(item)
    args.overrides = rest
    if args.nprocs is not None:
        value = str(args.nprocs)
        if not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"--nprocs = {value!r} is invalid: allowed an integer >= 1")
        args.nprocs = int(value)


# A SIGUSR1 / SIGTERM / SIGINT (Ctrl-C) that arrives before the trainer installs its own handler (start-up,
# imports, model construction) is recorded here and honoured as soon as the ranks can agree to stop.
EARLY_SIGNALS: list[int] = []


def install_early_stop() -> None:
    """Record a SIGUSR1 / SIGTERM / SIGINT of the start-up in :data:`EARLY_SIGNALS` (both entry points call it first)."""

    def handler(signum, _frame):
        EARLY_SIGNALS.append(signum)

    handle_stop_signals(handler)


def run(args) -> int:
    from laconic_nemo.plan.preflight import PREFLIGHT_DONE_ENV, preflight_train
    from laconic_nemo.runtime.faults import fault_point, heartbeat

    launcher = "WORLD_SIZE" not in os.environ
    install_early_stop()
    if not launcher:
        heartbeat("start-up")  # this rank now turns a forwarded signal into a clean stop
        fault_point("start_up", 0)
    try:
        _split_nprocs(args)
        cfg = load_config(args.recipe, args.overrides)
        nprocs = world = int(os.environ.get("WORLD_SIZE", "1"))
        if launcher:
            model_parallel = cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
            nprocs = world = args.nprocs or model_parallel
            if nprocs % model_parallel:
                raise ConfigError(f"--nprocs = {nprocs} is invalid: allowed a multiple of TP x PP = {model_parallel}")
        pin_cpu_kernels(cfg)  # before torch's first kernel here, and in the environment the local ranks inherit
        if os.environ.get(PREFLIGHT_DONE_ENV) != "1":
            preflight_train(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except (ConfigError, FileNotFoundError) as exc:
        print(f"laconic-nemo train: {exc}", file=sys.stderr)
        return 2
    # The launcher (or a lone process) stops here at once. A rank of a multi-rank run must not: the others
    # would wait for it in the rendezvous or a collective forever. It goes on to the trainer, where every
    # rank agrees on the stop (GRPOTrainer.stop.requested is an all-reduce) and they leave together.
    if EARLY_SIGNALS and (launcher or int(os.environ.get("WORLD_SIZE", "1")) == 1):
        print(f"laconic-nemo train: stopped on signal {EARLY_SIGNALS[0]} during start-up; nothing to save yet",
              file=sys.stderr)
        return 3
    lock = None
    if launcher:  # this process runs the whole run (its local ranks, or the training itself): it holds the folder
        try:
            lock = OutputDirLock.acquire(cfg.run.output_dir)
        except OutputDirLocked as exc:  # another run took it since the pre-flight's check: no rank is started
            print(f"laconic-nemo train: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"laconic-nemo train: run.output_dir = {cfg.run.output_dir}: cannot create its lock file ({exc})",
                  file=sys.stderr)
            return 2
    try:
        if launcher and nprocs > 1:
            par = cfg.parallel
            return launch_local(nprocs, [args.recipe, *args.overrides], watchdog_s=par.watchdog_s,
                                step_factor=par.watchdog_step_factor, min_s=par.watchdog_min_s,
                                output_dir=cfg.run.output_dir)
        from laconic_nemo.grpo.resume import ResumeError

        try:  # the folder's lock: this process's (a lone process), its launcher's, or rank 0 takes it (torchrun, srun)
            return train(cfg, hold_lock=lock is None and not os.environ.get(LAUNCHER_PID_ENV))
        except (ConfigError, ResumeError) as exc:
            # a check only a rank can make (a prompt longer than the context, a checkpoint's state): one line
            print(f"{RANK_REFUSAL}{os.environ.get('RANK', '0')}: {exc}", file=sys.stderr, flush=True)
            return 2
    finally:
        if lock is not None:
            lock.release()


def pin_cpu_kernels(cfg: Config) -> None:
    """Pin a CPU run's kernels to one instruction set (``LACONIC_CPU_ISA``, :mod:`laconic_nemo.runtime.cpu_isa`)
    in this process's environment: the launcher's ranks inherit it, a rank under torchrun / srun (this function,
    or ``laconic_nemo.nemo_entry``'s call of it) or a lone process sets it before its first kernel. A GPU run (nccl, or auto with CUDA) is left as it is."""
    from laconic_nemo.runtime.cpu_isa import pin_cpu_isa, runs_on_cpu

    try:
        pin_cpu_isa(cpu=runs_on_cpu(cfg.parallel.backend))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _how(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {name}"
    return f"exited with status {code}"


# What a rank's last lines say when a write failed for want of space: the OS error, or torch's own words when
# it wrote through a path (its stream reports only "basic_ios::clear" / "file write failed").
_NO_SPACE = ("No space left on device", "[Errno 28]", "Disk quota exceeded", "[Errno 122]")
_TORCH_WRITE_FAILED = ("basic_ios::clear", "file write failed", "PytorchStreamWriter failed writing")


def _cause(tail: list[str], output_dir: str | None) -> str:
    """Why a rank failed, from its last lines: its out-of-memory line (the memory model's prediction and the keys to
    change, :class:`laconic_nemo.grpo.trainer.TrainingOutOfMemory`), "No space left on device" when that is the
    cause, else ""."""
    from laconic_nemo.grpo.trainer import OOM_MARKER

    oom = [line.strip() for line in tail if OOM_MARKER in line]
    if oom:
        return oom[-1]
    text = "\n".join(tail)
    if any(n in text for n in _NO_SPACE) or any(n in text for n in _TORCH_WRITE_FAILED):
        free = ""
        if output_dir:
            try:
                free = f" ({shutil.disk_usage(_existing(output_dir)).free} bytes free in run.output_dir)"
            except OSError:
                pass
        return "No space left on device" + free
    return ""


def _existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def _watchdog_bound(beats: list[dict | None], watchdog_s: float, step_factor: float, min_s: float) -> tuple[float, str]:
    """(seconds without progress that count as a hang, how that bound was set). Inside a warm-up or GRPO step of
    every rank, once one has been measured (the heartbeats' ``step_s``): max(min_s, step_factor x the longest
    step); anywhere else (start-up, the first step, checkpoints, export): watchdog_s."""
    steps = [b.get("step_s") for b in beats if b]
    if step_factor > 0 and len(steps) == len(beats) and all(s is not None for s in steps):
        longest = max(steps)
        bound = max(min_s, step_factor * longest)
        return bound, (f"max(parallel.watchdog_min_s = {min_s:g}, parallel.watchdog_step_factor = {step_factor:g} "
                       f"x the longest step so far, {longest:.2f} s)")
    return watchdog_s, "parallel.watchdog_s"


def _stall_report(procs, heartbeat_dir: str, bound: float, why: str) -> str:
    """Which rank stalled: a stopped process first, else the one whose last progress is oldest."""
    from laconic_nemo.runtime.faults import process_state, read_heartbeat

    now = time.time()
    rows = []
    for r, p in enumerate(procs):
        beat = read_heartbeat(heartbeat_dir, r)
        state = process_state(p.pid)
        where = (f"last progress: {beat['phase']} of step {beat['step']}, {now - beat['mtime']:.0f} s ago"
                 if beat else "no progress since it started")
        rows.append((state.startswith("stopped"), -(now - beat["mtime"]) if beat else -1e18, r,
                     f"rank {r} (pid {p.pid}): {where}, process {state or 'state unknown'}"))
    stalled = min(rows, key=lambda x: (not x[0], x[1]))
    others = "; ".join(x[3] for x in rows if x[2] != stalled[2])
    return (f"laconic-nemo train: no rank made progress for {bound:.0f} s ({why}): "
            f"stalled rank: {stalled[3]}" + (f"; {others}" if others else "") + ". Stopping every rank.")


class _RankOutput:
    """Copies one rank's stdout and stderr, line by line, to the launcher's own, and keeps its last lines
    (the launcher's closing line quotes them). A failed check's line (``laconic-nemo train: rank R: ...``) that
    another rank already printed with the same words is kept but not copied again: the user reads it once."""

    _lock = threading.Lock()

    def __init__(self, proc: subprocess.Popen, refusals: set[str] | None = None):
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self.refusals = refusals if refusals is not None else set()  # shared by the ranks of one launch
        self.refused = False  # this rank printed a failed check's line
        self.threads = [threading.Thread(target=self._copy, args=(pipe, sink), daemon=True)
                        for pipe, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
        for t in self.threads:
            t.start()

    def _copy(self, pipe, sink) -> None:
        for line in pipe:
            with self._lock:
                if line.strip():
                    self.tail.append(line.rstrip("\n"))
                if line.startswith(RANK_REFUSAL):
                    self.refused = True
                    words = line.split(": ", 2)[-1]
                    if words in self.refusals:
                        continue
                    self.refusals.add(words)
                if sink is not None:
                    try:
                        sink.write(line)
                        sink.flush()
                    except (OSError, ValueError):  # the launcher's output is gone (`| head`): keep draining the rank
                        sink = None
        pipe.close()

    def join(self, timeout: float = 10.0) -> None:
        for t in self.threads:
            t.join(timeout)

    def last_line(self) -> str:
        return self.tail[-1] if self.tail else ""


def launch_local(nprocs: int, argv: list[str], watchdog_s: float = 600.0, grace_s: float = 5.0,
                 step_factor: float = 0.0, min_s: float = 60.0, output_dir: str | None = None) -> int:
    """Start ``nprocs`` ranks of this command on this machine (torchrun's environment variables) and
    wait for them.

    * Each rank runs in its own process group, so a Ctrl-C at the terminal reaches the launcher alone.
      SIGUSR1 / SIGTERM / SIGINT are forwarded to every rank, as Slurm's ``--signal`` does on a cluster,
      so a preempted or interrupted local run checkpoints and stops too (status 3); a rank still starting
      up gets the signal as soon as it can handle it (its first heartbeat).
    * Every rank's output passes through the launcher (line by line), which keeps its last lines.
    * When a rank fails, the launcher says which and how (exit status or signal) and stops the others
      ``grace_s`` seconds later (they would wait on collectives).
    * Watchdog: when no rank has made progress for the bound of :func:`_watchdog_bound` (``watchdog_s``, or
      inside a step ``max(min_s, step_factor x the longest step)``), it names the stalled rank (a stopped
      process, else the one whose last heartbeat is oldest), stops every rank and returns 4.
    * Its last line names the first rank that failed (in the order the ranks ended; a rank that ran out of
      memory before any other, the others then lose their peer), how (signal or exit status) and why: its
      out-of-memory line, "No space left on device" when that is the cause, else the rank's last line. A rank
      that ended on a failed check (status 2, its line ``laconic-nemo train: rank R: ...``) has said it: the
      launcher copies the first of the ranks' identical lines and adds nothing after it.

    Returns 0 when all ranks finished, 3 when they stopped on a signal, 4 on a hang, else the failed
    rank's exit status (1 when it died on a signal)."""
    import tempfile

    from laconic_nemo.plan.preflight import PREFLIGHT_DONE_ENV
    from laconic_nemo.runtime.faults import HEARTBEAT_ENV, read_heartbeat
    from laconic_nemo.runtime.megatron_env import free_port

    port = free_port()
    heartbeat_dir = tempfile.mkdtemp(prefix="laconic_heartbeat_")
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    received[:0] = EARLY_SIGNALS  # one that came before this handler replaced the start-up one
    print(f"launching {nprocs} local ranks (master 127.0.0.1:{port})", flush=True)
    procs, outputs = [], []
    refusals: set[str] = set()
    for rank in range(nprocs):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
               "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               HEARTBEAT_ENV: heartbeat_dir, PREFLIGHT_DONE_ENV: "1", "PYTHONUNBUFFERED": "1",
               LAUNCHER_PID_ENV: str(os.getpid())}  # the rank dies with this launcher (main below)
        env.setdefault("OMP_NUM_THREADS", "1")
        # megatron's recommended setting for its TP communication (launch/submit.sh sets it on the cluster);
        # without it every TP > 1 rank prints a UserWarning asking for it
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        procs.append(subprocess.Popen([sys.executable, "-m", "laconic_nemo.app.train_cli", *argv], env=env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, errors="replace", process_group=0))
        outputs.append(_RankOutput(procs[-1], refusals))
    ended: list[int] = []  # ranks in the order they ended (a thread per rank waits for it)
    ended_lock = threading.Lock()

    def wait_for(r: int, p: subprocess.Popen) -> None:
        p.wait()
        with ended_lock:
            ended.append(r)

    waiters = [threading.Thread(target=wait_for, args=(r, p), daemon=True) for r, p in enumerate(procs)]
    for t in waiters:
        t.start()
    delivered = [0] * nprocs
    failed_at, reported, stopped_by_us = None, set(), set()
    started = time.time()

    def say(msg):
        print(f"laconic-nemo train: {msg}", file=sys.stderr, flush=True)

    def failed() -> list[int]:
        with ended_lock:
            order = list(ended)
        return [r for r in order if procs[r].returncode not in (0, 3) and r not in stopped_by_us]

    def refused(r: int) -> bool:  # the rank ended on a failed check (status 2) and printed its line: it says it all
        if procs[r].returncode != 2:
            return False
        outputs[r].join(5.0)  # its output ends with it
        return outputs[r].refused

    def finish() -> None:  # every rank has ended: its output is all copied before the launcher's last words
        for t in waiters:
            t.join(10.0)
        for o in outputs:
            o.join()

    try:
        while any(p.poll() is None for p in procs):
            for r, p in enumerate(procs):  # forward signals to the ranks ready to handle them
                if delivered[r] < len(received) and p.poll() is None and read_heartbeat(heartbeat_dir, r):
                    for s in received[delivered[r]:]:
                        p.send_signal(s)
                    delivered[r] = len(received)
            for r in failed():
                if r not in reported:
                    reported.add(r)
                    if not refused(r):
                        say(f"rank {r} (pid {procs[r].pid}) {_how(procs[r].returncode)}")
                    if failed_at is None:
                        failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for r, p in enumerate(procs):  # the survivors would wait on collectives forever
                    if p.poll() is None:
                        say(f"stopping rank {r} (pid {p.pid}): another rank failed")
                        stopped_by_us.add(r)
                        p.kill()
            if failed_at is None:
                beats = [read_heartbeat(heartbeat_dir, r) for r in range(nprocs)]
                last = max([b["mtime"] for b in beats if b] + [started])
                bound, why = _watchdog_bound(beats, watchdog_s, step_factor, min_s)
                if time.time() - last > bound:
                    report = _stall_report(procs, heartbeat_dir, bound, why)
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                    for p in procs:
                        p.wait()
                    finish()
                    say(report[len("laconic-nemo train: "):])
                    return 4
            time.sleep(0.2)
        finish()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        shutil.rmtree(heartbeat_dir, ignore_errors=True)
    bad = failed()
    for r in bad:  # ranks that ended between the last poll and the loop's end (every rank within one poll)
        if r not in reported and not refused(r):
            say(f"rank {r} (pid {procs[r].pid}) {_how(procs[r].returncode)}")
    if bad and refused(bad[0]):  # its one line was the last word
        return 2
    if bad:
        # a rank that ran out of memory is the cause of the others' failures (they lose their peer in a collective)
        from laconic_nemo.grpo.trainer import OOM_MARKER

        oom = [r for r in bad if OOM_MARKER in _cause(list(outputs[r].tail), output_dir)]
        if oom:
            bad = oom + [r for r in bad if r not in oom]
        first = procs[bad[0]]
        cause = _cause(list(outputs[bad[0]].tail), output_dir)
        last = outputs[bad[0]].last_line()
        if cause and last and last.strip() == cause:  # the out-of-memory line, already said in full
            said = ""
        else:
            said = f"; its last line: {last[-300:]!r}" if last else "; it printed nothing"
        say(f"failed: rank {bad[0]} (pid {first.pid}) {_how(first.returncode)}, the first rank to fail"
            + (f": {cause}" if cause else "") + said)
        return first.returncode if first.returncode > 0 else 1
    codes = [p.returncode for p in procs]
    if 3 in codes:
        say(f"stopped on signal {received[0] if received else '(a rank received it directly)'}: every rank stopped "
            "after its checkpoint (status 3); rerun the same command to continue")
        return 3
    return 0


def train(cfg: Config, hold_lock: bool = True) -> int:
    """The megatron-core entry point (every rank): torch.distributed, the output-dir lock (``hold_lock``: rank 0 takes
    it; False: the process that started this one holds it), the task, the actor (and its vLLM engine), the trainer,
    then :func:`laconic_nemo.app.run.run`."""
    import torch

    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.app.run import run as run_grpo
    from laconic_nemo.app.task import build_task
    from laconic_nemo.grpo.trainer import GRPOTrainer
    from laconic_nemo.runtime.faults import heartbeat
    from laconic_nemo.runtime.megatron_env import cpu_threads, destroy_distributed, init_distributed

    torch.set_num_threads(cpu_threads())
    info = init_distributed(cfg.parallel.tensor_model_parallel_size,
                            cfg.parallel.pipeline_model_parallel_size,
                            backend=cfg.parallel.backend, seed=cfg.run.seed,
                            timeout_s=cfg.parallel.collective_timeout_s)
    heartbeat("start-up")
    is_logger = info.rank == 0

    def log(msg: str):
        if is_logger:
            print(msg, flush=True)

    lock = None
    try:
        try:  # rank 0 holds run.output_dir until the run ends; every rank stops here if another run has it
            lock = hold_output_dir(cfg.run.output_dir, info.rank) if hold_lock else None
        except OutputDirLocked as exc:
            if is_logger:
                print(f"laconic-nemo train: {exc}", file=sys.stderr, flush=True)
            return 2
        task = build_task(cfg)
        if task.vocab_size is not None:
            cfg.model.vocab_size = task.vocab_size  # the synthetic GPT's vocabulary is its tokenizer's
        heartbeat("build model")
        actor = MegatronCoreActor.from_config(cfg)
        heartbeat("build trainer")
        if cfg.rollout.engine == "vllm":
            if cfg.model.source != "hf":
                raise ConfigError("rollout.engine = vllm needs model.source = hf (vLLM loads the checkpoint)")
            from laconic_nemo.bridge import arch_from_hf_config
            from laconic_nemo.rollout.vllm import VLLMRolloutEngine

            actor.attach_rollout_engine(VLLMRolloutEngine.from_recipe(
                cfg, str(cfg.model.path),
                arch_from_hf_config(str(cfg.model.path)), pad_id=task.pad_id))
        elif cfg.rollout.engine != "megatron":
            raise ConfigError(f"rollout.engine = {cfg.rollout.engine}: the megatron-core actor supports megatron "
                              "or vllm (nemo generation runs in the NeMo-Aligner entry point)")
        log(f"layout: world {info.world_size} = TP {info.tp_size} x PP {info.pp_size} x DP {info.dp_size} "
            f"({info.device}); prompts {len(task.prompts)}; output {cfg.run.output_dir}")
        trainer = GRPOTrainer(cfg, actor, task.encode, task.decode, task.prompts, task.reward_fn, task.eos_id,
                              stop_ids=task.stop_ids, budgets=task.budgets)
        return run_grpo(trainer, task, early_signal=EARLY_SIGNALS[0] if EARLY_SIGNALS else None)
    finally:
        if lock is not None:
            lock.release()
        destroy_distributed()


def main(argv=None) -> int:
    if os.environ.get(LAUNCHER_PID_ENV):  # a rank started by launch_local
        from laconic_nemo.runtime.parent_death import die_with_parent

        die_with_parent(int(os.environ[LAUNCHER_PID_ENV]))
    parser = argparse.ArgumentParser(prog="laconic-nemo")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
