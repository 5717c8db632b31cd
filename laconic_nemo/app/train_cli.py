"""`laconic-nemo train RECIPE [key=value ...]`: GRPO + LACONIC on the megatron-core actor.

Run from a plain shell, the command starts ``--nprocs`` local ranks of itself (default: TP x PP,
i.e. one data-parallel replica) and forwards signals to them; under torchrun or srun (``WORLD_SIZE``
set) it trains directly. The recipe is loaded and validated before any process, model or data exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from laconic_nemo.config import ConfigError, load_config
from laconic_nemo.grpo.run_lock import OutputDirLocked, check_free, hold_output_dir

LAUNCHER_PID_ENV = "LACONIC_LAUNCHER_PID"


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


# A SIGUSR1 / SIGTERM that arrives before the trainer installs its own handler (start-up, imports,
# model construction) is recorded here and honoured as soon as the ranks can agree to stop.
_EARLY_SIGNAL: list[int] = []


def _install_early_stop() -> None:
    def handler(signum, _frame):
        _EARLY_SIGNAL.append(signum)

    for s in (signal.SIGUSR1, signal.SIGTERM):
        try:
            signal.signal(s, handler)
        except ValueError:  # not the main thread
            pass


def run(args) -> int:
    from laconic_nemo.faults import fault_point, heartbeat
    from laconic_nemo.preflight import PREFLIGHT_DONE_ENV, preflight_train

    launcher = "WORLD_SIZE" not in os.environ
    _install_early_stop()
    if not launcher:
        heartbeat("start-up")  # this rank now turns a forwarded signal into a clean stop
        fault_point("start_up", 0)
    try:
        _split_nprocs(args)
        cfg = load_config(args.recipe, args.overrides)
        nprocs = world = int(os.environ.get("WORLD_SIZE", "1"))
        if launcher:
            model_parallel = int(cfg.parallel.tensor_model_parallel_size) * int(cfg.parallel.pipeline_model_parallel_size)
            nprocs = world = args.nprocs or model_parallel
            if nprocs % model_parallel:
                raise ConfigError(f"--nprocs = {nprocs} is invalid: allowed a multiple of TP x PP = {model_parallel}")
        if os.environ.get(PREFLIGHT_DONE_ENV) != "1":
            preflight_train(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except (ConfigError, FileNotFoundError) as exc:
        print(f"laconic-nemo train: {exc}", file=sys.stderr)
        return 2
    try:  # a live run in this output dir: refuse before any rank, warm-up or model exists
        check_free(cfg.run.output_dir)
    except OutputDirLocked as exc:
        print(f"laconic-nemo train: {exc}", file=sys.stderr)
        return 2
    # The launcher (or a lone process) stops here at once. A rank of a multi-rank run must not: the others
    # would wait for it in the rendezvous or a collective forever. It goes on to the trainer, where every
    # rank agrees on the stop (GRPOTrainer._should_stop is an all-reduce) and they leave together.
    if _EARLY_SIGNAL and (launcher or int(os.environ.get("WORLD_SIZE", "1")) == 1):
        print(f"laconic-nemo train: stopped on signal {_EARLY_SIGNAL[0]} during start-up; nothing to save yet",
              file=sys.stderr)
        return 3
    if launcher and nprocs > 1:
        return launch_local(nprocs, [args.recipe, *args.overrides], watchdog_s=float(cfg.parallel.watchdog_s))
    return train(cfg)


def _how(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {name}"
    return f"exited with status {code}"


def _stall_report(procs, heartbeat_dir: str, watchdog_s: float) -> str:
    """Which rank stalled: a stopped process first, else the one whose last progress is oldest."""
    from laconic_nemo.faults import process_state, read_heartbeat

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
    return (f"laconic-nemo train: no rank made progress for {watchdog_s:.0f} s (parallel.watchdog_s): "
            f"stalled rank: {stalled[3]}" + (f"; {others}" if others else "") + ". Stopping every rank.")


def launch_local(nprocs: int, argv: list[str], watchdog_s: float = 600.0, grace_s: float = 5.0) -> int:
    """Start ``nprocs`` ranks of this command on this machine (torchrun's environment variables) and
    wait for them.

    * SIGUSR1 / SIGTERM / SIGINT are forwarded to every rank, as Slurm's ``--signal`` does on a cluster,
      so a preempted local run checkpoints and stops too; a rank still starting up gets the signal as
      soon as it can handle it (its first heartbeat).
    * When a rank fails, the launcher says which and how (exit status or signal) and stops the others
      ``grace_s`` seconds later (they would wait on collectives).
    * Watchdog: when no rank has made progress for ``watchdog_s`` seconds, it names the stalled rank
      (a stopped process, else the one whose last heartbeat is oldest), stops every rank and returns 4.

    Returns 0 when all ranks finished, 3 when they stopped on a signal, 4 on a hang, else the failed
    rank's exit status (1 when it died on a signal)."""
    import tempfile

    from laconic_nemo.faults import HEARTBEAT_ENV, read_heartbeat
    from laconic_nemo.megatron_env import free_port
    from laconic_nemo.preflight import PREFLIGHT_DONE_ENV

    port = free_port()
    heartbeat_dir = tempfile.mkdtemp(prefix="laconic_heartbeat_")
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    received[:0] = _EARLY_SIGNAL  # one that came before this handler replaced the start-up one
    print(f"launching {nprocs} local ranks (master 127.0.0.1:{port})", flush=True)
    procs = []
    for rank in range(nprocs):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
               "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               HEARTBEAT_ENV: heartbeat_dir, PREFLIGHT_DONE_ENV: "1",
               LAUNCHER_PID_ENV: str(os.getpid())}  # the rank dies with this launcher (main below)
        env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(subprocess.Popen([sys.executable, "-m", "laconic_nemo.app.train_cli", *argv], env=env))
    delivered = [0] * nprocs
    failed_at, first_code, reported, stopped_by_us = None, None, set(), set()
    started = time.time()

    def say(msg):
        print(f"laconic-nemo train: {msg}", file=sys.stderr, flush=True)

    try:
        while any(p.poll() is None for p in procs):
            for r, p in enumerate(procs):  # forward signals to the ranks ready to handle them
                if delivered[r] < len(received) and p.poll() is None and read_heartbeat(heartbeat_dir, r):
                    for s in received[delivered[r]:]:
                        p.send_signal(s)
                    delivered[r] = len(received)
            for r, p in enumerate(procs):
                code = p.poll()
                if code is not None and code not in (0, 3) and r not in reported and r not in stopped_by_us:
                    reported.add(r)
                    say(f"rank {r} (pid {p.pid}) {_how(code)}")
                    if failed_at is None:
                        failed_at, first_code = time.monotonic(), code
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for r, p in enumerate(procs):  # the survivors would wait on collectives forever
                    if p.poll() is None:
                        say(f"stopping rank {r} (pid {p.pid}): another rank failed")
                        stopped_by_us.add(r)
                        p.kill()
            if failed_at is None:
                beats = [read_heartbeat(heartbeat_dir, r) for r in range(nprocs)]
                last = max([b["mtime"] for b in beats if b] + [started])
                if time.time() - last > watchdog_s:
                    say(_stall_report(procs, heartbeat_dir, watchdog_s)[len("laconic-nemo train: "):])
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
                    for p in procs:
                        p.wait()
                    return 4
            time.sleep(0.2)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        shutil.rmtree(heartbeat_dir, ignore_errors=True)
    codes = [p.returncode for p in procs]
    if first_code is not None:
        return first_code if first_code > 0 else 1
    bad = [c for c in codes if c not in (0, 3)]
    if bad:
        return bad[0] if bad[0] > 0 else 1
    return 3 if 3 in codes else 0


def _warmup_cache_dir(cfg: DictConfig) -> Path:
    key = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "warmup", "parallel")}
    key["synthetic"] = OmegaConf.to_container(cfg.data.synthetic, resolve=True)
    key["seed"] = int(cfg.run.seed)
    key["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
    # the warm-up's micro-batches follow grpo.sort_by_length (another float summation order, another policy)
    key["sort_by_length"] = bool(cfg.grpo.sort_by_length)
    key["warmup"].pop("cache_dir", None)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cfg.warmup.cache_dir) if cfg.warmup.cache_dir else Path(cfg.run.output_dir) / "warmup"
    return root / f"policy_{digest}"


def build_task(cfg: DictConfig):
    """(encode, decode, eos_id, pad_id, vocab_size, prompts, reward_fn, warmup_example or None) for the
    recipe; vocab_size is the synthetic tokenizer's (the HF path reads it from the checkpoint: None)."""
    if cfg.data.kind == "synthetic":
        from laconic_nemo.data.synthetic import CharTokenizer, SyntheticTask
        from laconic_nemo.rewards import extract_answer

        tok = CharTokenizer()
        task = SyntheticTask(**OmegaConf.to_container(cfg.data.synthetic, resolve=True))
        problems = task.problems(int(cfg.data.num_prompts), seed=int(cfg.run.seed))
        prompts = [(p.prompt, p.answer) for p in problems]

        def reward_fn(texts, answers):
            extracted = [extract_answer(t) for t in texts]
            scores = [1.0 if e is not None and e.strip() == a else 0.0 for e, a in zip(extracted, answers)]
            no_answer = sum(e is None for e in extracted)
            return scores, {"accuracy": sum(scores) / len(scores), "no_answer": no_answer / len(scores)}

        def warmup_example(rng: random.Random):
            prompt, response = task.warmup_example(rng)
            return tok.encode(prompt), tok.encode(response) + [tok.eos_id]

        return tok.encode, tok.decode, tok.eos_id, tok.pad_id, tok.vocab_size, prompts, reward_fn, warmup_example

    from laconic_nemo.data.datasets import load_math_prompts
    from laconic_nemo.rewards.format import build_reward_fn

    if cfg.model.source != "hf":
        raise ConfigError("data.kind = math with the megatron-core actor needs model.source = hf (a tokenizer)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    items = load_math_prompts(list(cfg.data.train_files), str(cfg.data.prompt_template))
    from laconic_nemo.launch_plan import _hf_config

    hf = _hf_config(str(cfg.model.path)) or {}
    context = int(hf.get("max_position_embeddings", cfg.model.max_position_embeddings))
    room = context - int(cfg.rollout.max_new_tokens)
    for item in items:
        n = len(tok.encode(item.prompt, add_special_tokens=False))
        if n > room:
            raise ConfigError(f"{item.source}: field 'problem' is {n} tokens after the prompt template; with "
                              f"rollout.max_new_tokens = {cfg.rollout.max_new_tokens} at most {room} fit the "
                              f"context of {context} tokens")
    reward_fn, _grader = build_reward_fn(OmegaConf.to_container(cfg.reward, resolve=True))  # reward.format

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    return encode, decode, tok.eos_token_id, tok.pad_token_id or tok.eos_token_id, None, \
        [(i.prompt, i.answer) for i in items], reward_fn, None


def train(cfg: DictConfig) -> int:
    import torch

    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.faults import heartbeat
    from laconic_nemo.app.plots import plot_training_curves
    from laconic_nemo.grpo.resume import read_metrics
    from laconic_nemo.grpo.trainer import GRPOTrainer, summarize
    from laconic_nemo.megatron_env import destroy_distributed, init_distributed

    torch.set_num_threads(max(1, int(os.environ.get("LACONIC_THREADS", "1"))))
    info = init_distributed(int(cfg.parallel.tensor_model_parallel_size),
                            int(cfg.parallel.pipeline_model_parallel_size),
                            backend=str(cfg.parallel.backend), seed=int(cfg.run.seed),
                            timeout_s=float(cfg.parallel.collective_timeout_s))
    heartbeat("start-up")
    is_logger = info.rank == 0

    def log(msg: str):
        if is_logger:
            print(msg, flush=True)

    lock = None
    try:
        try:  # rank 0 holds run.output_dir until the run ends; every rank stops here if another run has it
            lock = hold_output_dir(cfg.run.output_dir, info.rank)
        except OutputDirLocked as exc:
            if is_logger:
                print(f"laconic-nemo train: {exc}", file=sys.stderr, flush=True)
            return 2
        encode, decode, eos_id, pad_id, vocab_size, prompts, reward_fn, warmup_example = build_task(cfg)
        if vocab_size is not None:
            OmegaConf.update(cfg, "model.vocab_size", vocab_size)
        heartbeat("build model")
        actor = MegatronCoreActor.from_config(cfg)
        heartbeat("build trainer")
        if cfg.rollout.engine == "vllm":
            if cfg.model.source != "hf":
                raise ConfigError("rollout.engine = vllm needs model.source = hf (vLLM loads the checkpoint)")
            from laconic_nemo.bridge import arch_from_hf_config
            from laconic_nemo.rollout.vllm import VLLMRolloutEngine

            actor.attach_rollout_engine(VLLMRolloutEngine.from_recipe(
                OmegaConf.to_container(cfg, resolve=True), str(cfg.model.path),
                arch_from_hf_config(str(cfg.model.path)), pad_id=pad_id))
        elif cfg.rollout.engine != "megatron":
            raise ConfigError(f"rollout.engine = {cfg.rollout.engine}: the megatron-core actor supports megatron "
                              "or vllm (nemo generation runs in the NeMo-Aligner entry point)")
        log(f"layout: world {info.world_size} = TP {info.tp_size} x PP {info.pp_size} x DP {info.dp_size} "
            f"({info.device}); prompts {len(prompts)}; output {cfg.run.output_dir}")
        trainer = GRPOTrainer(cfg, actor, encode, decode, prompts, reward_fn, eos_id)
        trainer._install_signal_handlers()
        if _EARLY_SIGNAL and trainer._stop_signal is None:
            trainer._stop_signal = _EARLY_SIGNAL[0]
        if trainer._should_stop():
            log("stopped on a signal during start-up; nothing to save yet")
            return 3
        if int(cfg.warmup.num_steps) > 0 and trainer.find_resume_checkpoint() is None:
            if not _warmup(cfg, actor, warmup_example, pad_id, info, log, trainer._should_stop):
                log("stopped on a signal during the warm-up; its progress is saved and a rerun continues it")
                return 3
            if trainer._should_stop():
                log("stopped on a signal after the warm-up; the warmed-up policy is cached")
                return 3
        heartbeat("resume")
        status = trainer.fit()
        heartbeat("finish")
        if is_logger:
            # the whole run, also the steps before a resume
            rows, _ = read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl")
            if rows:
                s = summarize(rows)
                log("summary: " + ", ".join(f"{k} {v:.4f}" for k, v in s.items()))
            if rows and cfg.logging.plot:
                png = plot_training_curves(Path(cfg.run.output_dir) / "metrics.jsonl",
                                           Path(cfg.run.output_dir) / "training_curves.png",
                                           title=f"{cfg.run.name}: shaper {cfg.laconic.shaper}, B={cfg.laconic.budget}")
                log(f"wrote {png}")
        return 0 if status == "finished" else 3
    finally:
        if lock is not None:
            lock.release()
        destroy_distributed()


def _warmup(cfg, actor, warmup_example, pad_id, info, log, should_stop=None) -> bool:
    """Warm up the policy (or load the cached result). Returns False when stopped by a signal: the steps
    done so far (model, optimiser, step) are saved next to the cache and a rerun continues from them."""
    import torch
    import torch.distributed as dist

    from laconic_nemo.app.warmup import supervised_warmup

    if warmup_example is None:
        raise ConfigError("warmup.num_steps > 0 needs a task with warm-up examples (data.kind = synthetic)")
    cache = _warmup_cache_dir(cfg)
    shard = cache / f"model_tp{actor.tp_rank:02d}_pp{actor.pp_rank:02d}.pt"
    partial = cache.with_name(cache.name + ".partial")
    total = int(cfg.warmup.num_steps)

    def barrier():
        if dist.is_initialized():
            dist.barrier()

    if (cache / "done").is_file():
        actor.load_model_state(torch.load(shard, weights_only=False))
        log(f"warm-up: loaded cached policy {cache}")
    else:
        actor.set_learning_rate(float(cfg.warmup.lr))
        start = 0
        if (partial / "progress.json").is_file():
            start = int(json.loads((partial / "progress.json").read_text())["step"])
            actor.load_checkpoint_state(torch.load(partial / shard.name, weights_only=False))
            log(f"warm-up: continuing the interrupted warm-up at step {start + 1}/{total}")
        else:
            log(f"warm-up: {total} supervised steps, batch {cfg.warmup.batch_size}")
        losses = supervised_warmup(actor, warmup_example, total, int(cfg.warmup.batch_size),
                                   int(cfg.grpo.micro_batch_size), int(cfg.run.seed), pad_id, log=log,
                                   start_step=start, should_stop=should_stop)
        done_steps = start + len(losses)
        if done_steps < total:  # stopped by a signal: save what is done
            if info.rank == 0:
                if partial.exists():
                    shutil.rmtree(partial)
                partial.mkdir(parents=True)
            barrier()
            if actor.dp_rank == 0:
                torch.save(actor.state_dict_for_checkpoint(), partial / shard.name)
            barrier()
            if info.rank == 0:
                tmp = partial / "progress.json.tmp"
                tmp.write_text(json.dumps({"step": done_steps, "of": total}))
                os.replace(tmp, partial / "progress.json")
            barrier()
            log(f"warm-up: saved {done_steps}/{total} steps in {partial}")
            return False
        # rank 0 names the temporary folder (unique per process) and tells the other ranks
        tmp_list = [str(cache.with_name(f"{cache.name}.tmp{os.getpid()}"))]
        if dist.is_initialized():
            dist.broadcast_object_list(tmp_list, src=0)
        tmp = Path(tmp_list[0])
        if info.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        barrier()
        if actor.dp_rank == 0:
            torch.save(actor.model_state(), tmp / shard.name)
        barrier()
        if info.rank == 0:
            (tmp / "done").write_text("ok")
            if cache.exists():  # another run with the same settings finished first: keep its copy
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                os.replace(tmp, cache)
            shutil.rmtree(partial, ignore_errors=True)
        barrier()
        log(f"warm-up: cached policy in {cache}")
    # RL starts from the warmed-up weights with a fresh optimiser at the RL learning rate; this
    # policy is also the reference for the KL term.
    actor.reset_optimizer(lr=float(cfg.optim.lr))
    actor.snapshot_reference()
    return True


def main(argv=None) -> int:
    if os.environ.get(LAUNCHER_PID_ENV):  # a rank started by launch_local
        from laconic_nemo.grpo.parent_death import die_with_parent

        die_with_parent(int(os.environ[LAUNCHER_PID_ENV]))
    parser = argparse.ArgumentParser(prog="laconic-nemo")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
