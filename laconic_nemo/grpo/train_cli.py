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
    """Take ``--nprocs N`` out of the overrides wherever it was written."""
    rest, items = [], list(args.overrides or [])
    while items:
        item = items.pop(0)
        if item == "--nprocs" and items:
            args.nprocs = int(items.pop(0))
        elif item.startswith("--nprocs="):
            args.nprocs = int(item.split("=", 1)[1])
        else:
            rest.append(item)
    args.overrides = rest


def run(args) -> int:
    _split_nprocs(args)
    try:
        cfg = load_config(args.recipe, args.overrides)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"laconic-nemo train: {exc}", file=sys.stderr)
        return 2
    try:  # a live run in this output dir: refuse before any rank, warm-up or model exists
        check_free(cfg.run.output_dir)
    except OutputDirLocked as exc:
        print(f"laconic-nemo train: {exc}", file=sys.stderr)
        return 2
    if "WORLD_SIZE" not in os.environ:
        model_parallel = int(cfg.parallel.tensor_model_parallel_size) * int(cfg.parallel.pipeline_model_parallel_size)
        nprocs = args.nprocs or model_parallel
        if nprocs % model_parallel:
            print(f"laconic-nemo train: --nprocs {nprocs} must be a multiple of TP x PP = {model_parallel}",
                  file=sys.stderr)
            return 2
        if nprocs > 1:
            return launch_local(nprocs, [args.recipe, *args.overrides])
    return train(cfg)


def launch_local(nprocs: int, argv: list[str]) -> int:
    """Start ``nprocs`` ranks of this command on this machine (torchrun's environment variables) and
    wait for them. SIGUSR1 / SIGTERM / SIGINT are forwarded to every rank, as Slurm's ``--signal`` does
    on a cluster, so a preempted local run checkpoints and stops too. If a rank fails, the others are
    stopped. Returns 0 when all ranks finished, 3 when they stopped on a signal, else a rank's failure code."""
    from laconic_nemo.megatron_env import free_port

    port = free_port()
    print(f"launching {nprocs} local ranks (master 127.0.0.1:{port})", flush=True)
    procs = []
    for rank in range(nprocs):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
               "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               LAUNCHER_PID_ENV: str(os.getpid())}  # the rank dies with this launcher (main below)
        env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(subprocess.Popen([sys.executable, "-m", "laconic_nemo.grpo.train_cli", *argv], env=env))

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        failed_at = None
        while any(p.poll() is None for p in procs):
            codes = [p.poll() for p in procs]
            if failed_at is None and any(c not in (None, 0, 3) for c in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > 10:
                for p in procs:  # a rank died: the survivors would wait on collectives forever
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    codes = [p.returncode for p in procs]
    bad = [c for c in codes if c not in (0, 3)]
    if bad:
        return bad[0] if bad[0] > 0 else 1
    return 3 if 3 in codes else 0


def _warmup_cache_dir(cfg: DictConfig) -> Path:
    key = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "warmup", "parallel")}
    key["synthetic"] = OmegaConf.to_container(cfg.data.synthetic, resolve=True)
    key["seed"] = int(cfg.run.seed)
    key["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
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
    from laconic_nemo.grpo.plots import plot_training_curves
    from laconic_nemo.grpo.trainer import GRPOTrainer, summarize
    from laconic_nemo.megatron_env import destroy_distributed, init_distributed

    torch.set_num_threads(max(1, int(os.environ.get("LACONIC_THREADS", "1"))))
    info = init_distributed(int(cfg.parallel.tensor_model_parallel_size),
                            int(cfg.parallel.pipeline_model_parallel_size),
                            backend=str(cfg.parallel.backend), seed=int(cfg.run.seed))
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
        actor = MegatronCoreActor.from_config(cfg)
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
        if int(cfg.warmup.num_steps) > 0 and trainer.find_resume_checkpoint() is None:
            _warmup(cfg, actor, warmup_example, pad_id, info, log)
        status = trainer.fit()
        if is_logger and trainer.history:
            s = summarize(trainer.history)
            log("summary: " + ", ".join(f"{k} {v:.4f}" for k, v in s.items()))
            if cfg.logging.plot:
                png = plot_training_curves(Path(cfg.run.output_dir) / "metrics.jsonl",
                                           Path(cfg.run.output_dir) / "training_curves.png",
                                           title=f"{cfg.run.name}: shaper {cfg.laconic.shaper}, B={cfg.laconic.budget}")
                log(f"wrote {png}")
        return 0 if status == "finished" else 3
    finally:
        if lock is not None:
            lock.release()
        destroy_distributed()


def _warmup(cfg, actor, warmup_example, pad_id, info, log):
    import torch
    import torch.distributed as dist

    from laconic_nemo.grpo.warmup import supervised_warmup

    if warmup_example is None:
        raise ConfigError("warmup.num_steps > 0 needs a task with warm-up examples (data.kind = synthetic)")
    cache = _warmup_cache_dir(cfg)
    shard = cache / f"model_tp{actor.tp_rank:02d}_pp{actor.pp_rank:02d}.pt"
    if (cache / "done").is_file():
        actor.load_model_state(torch.load(shard, weights_only=False))
        log(f"warm-up: loaded cached policy {cache}")
    else:
        log(f"warm-up: {cfg.warmup.num_steps} supervised steps, batch {cfg.warmup.batch_size}")
        actor.set_learning_rate(float(cfg.warmup.lr))
        supervised_warmup(actor, warmup_example, int(cfg.warmup.num_steps), int(cfg.warmup.batch_size),
                          int(cfg.grpo.micro_batch_size), int(cfg.run.seed), pad_id, log=log)
        # rank 0 names the temporary folder (unique per process) and tells the other ranks
        tmp_list = [str(cache.with_name(f"{cache.name}.tmp{os.getpid()}"))]
        if dist.is_initialized():
            dist.broadcast_object_list(tmp_list, src=0)
        tmp = Path(tmp_list[0])
        if info.rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        if dist.is_initialized():
            dist.barrier()
        if actor.dp_rank == 0:
            torch.save(actor.model_state(), tmp / shard.name)
        if dist.is_initialized():
            dist.barrier()
        if info.rank == 0:
            (tmp / "done").write_text("ok")
            if cache.exists():  # another run with the same settings finished first: keep its copy
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                os.replace(tmp, cache)
        if dist.is_initialized():
            dist.barrier()
        log(f"warm-up: cached policy in {cache}")
    # RL starts from the warmed-up weights with a fresh optimiser at the RL learning rate; this
    # policy is also the reference for the KL term.
    actor.reset_optimizer(lr=float(cfg.optim.lr))
    actor.snapshot_reference()


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
