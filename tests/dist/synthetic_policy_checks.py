"""A synthetic-task run at TP=2 (2 processes over gloo) for tests/test_eval_synthetic.py.

The trainer's own warm-up (``app.warmup.warm_up``, 3 supervised steps) writes the warm-up cache, one GRPO step
with a large learning rate moves the policy away from it, and GRPOTrainer.save_checkpoint writes
``<run>/checkpoints/step_000001``. Rank 0 saves ``<run>/policy_logprobs.pt``: token ids [N, T] and the log-probs
[N, T-1] of the warmed-up and of the trained policy on them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

N, T = 4, 14


def make_config(run_dir: str):
    from laconic_nemo.config import load_config

    return load_config("tiny_cpu", [
        "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.attention=local", "warmup.num_steps=3", "warmup.batch_size=8", f"warmup.cache_dir={run_dir}/warmup",
        f"run.output_dir={run_dir}", "run.num_steps=1", "grpo.micro_batch_size=4", "optim.lr=1e-2",
        "optim.warmup_steps=0", "data.num_prompts=64",
        "data.target_instruction=max{target}"])  # how --stated-budgets states a budget to this run


def run(rank: int, world: int, port: int, run_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from laconic_nemo.runtime.cpu_isa import pin_cpu_isa

    pin_cpu_isa()  # before the first kernel, as the trainer's launcher pins its ranks
    torch.set_num_threads(1)
    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.app.task import build_task
    from laconic_nemo.app.warmup import warm_up
    from laconic_nemo.grpo.interfaces import TrainBatch
    from laconic_nemo.grpo.loss import make_grpo_loss_fn
    from laconic_nemo.grpo.trainer import GRPOTrainer
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    cfg = make_config(run_dir)
    info = init_distributed(2, 1, backend="gloo", seed=int(cfg.run.seed))
    task = build_task(cfg)
    encode, decode, eos_id, pad_id, vocab = task.encode, task.decode, task.eos_id, task.pad_id, task.vocab_size
    prompts, reward_fn, warmup_example = task.prompts, task.reward_fn, task.warmup_example
    cfg.model.vocab_size = vocab
    actor = MegatronCoreActor.from_config(cfg)
    assert warm_up(cfg, actor, warmup_example, pad_id, info.rank, log=lambda s: None)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, vocab, (N, T), generator=g)
    mask = torch.ones(N, T - 1)
    batch = TrainBatch(tokens, torch.full((N,), 1), torch.full((N,), T - 1), mask,
                       advantages=torch.randn(N, generator=g))
    warm_lp = actor.logprobs(batch)
    batch.old_logprobs = warm_lp
    loss_fn = make_grpo_loss_fn(cfg.grpo.clip_eps, cfg.grpo.clip_eps_high, 0.0, cfg.grpo.loss_aggregation,
                                global_num_tokens=float(N * (T - 1)), global_num_seqs=float(N))
    actor.train_step(batch, loss_fn)
    trainer = GRPOTrainer(cfg, actor, encode, decode, prompts, reward_fn, eos_id)
    trainer.save_checkpoint(1)
    trained_lp = actor.logprobs(batch)
    if rank == 0:
        torch.save({"tokens": tokens, "warmup": warm_lp, "trained": trained_lp}, Path(run_dir) / "policy_logprobs.pt")
    destroy_distributed()


def launch(run_dir: str, world: int = 2) -> None:
    import torch.multiprocessing as mp

    from laconic_nemo.runtime.megatron_env import free_port

    mp.spawn(run, args=(world, free_port(), run_dir), nprocs=world, join=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    launch(sys.argv[1])
