"""A trained megatron-core policy checkpointed by the trainer at TP=2 or PP=2 (2 processes over gloo), for
tests/test_export.py.

The actor is built from a tiny Hugging Face Qwen2 folder (model.source=hf), takes one GRPO step with a large
learning rate (so the policy differs from the source weights), and GRPOTrainer.save_checkpoint writes
``<run>/checkpoints/step_000001``. Rank 0 then saves ``<run>/policy_logprobs.pt``: token ids [N, T], the
trained policy's log-probs [N, T-1] and the source weights' log-probs [N, T-1] of the same tokens.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

N, T = 3, 12
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def make_config(tp: int, pp: int, model_dir: str, run_dir: str):
    from omegaconf import OmegaConf

    from laconic_nemo.config import build_config

    root = Path(__file__).resolve().parents[2]
    cfg = OmegaConf.load(root / "recipes" / "base.yaml")
    cfg.model.update(source="hf", path=model_dir, attention="local")
    cfg.parallel.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, backend="gloo")
    cfg.optim.update(lr=1e-2, warmup_steps=0)
    cfg.grpo.update(kl_beta=0.0, micro_batch_size=N, num_prompts_per_step=1, group_size=N, minibatch_size=N)
    cfg.run.update(output_dir=run_dir, num_steps=1)
    return build_config(cfg)  # the checked, typed config the entry points hand on


def run(rank: int, world: int, layout: str, port: int, model_dir: str, run_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.grpo.interfaces import TrainBatch
    from laconic_nemo.grpo.loss import make_grpo_loss_fn
    from laconic_nemo.grpo.trainer import GRPOTrainer
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    cfg = make_config(*LAYOUTS[layout], model_dir, run_dir)
    init_distributed(int(cfg.parallel.tensor_model_parallel_size), int(cfg.parallel.pipeline_model_parallel_size),
                     backend=str(cfg.parallel.backend), seed=int(cfg.run.seed))  # the entry point's part
    actor = MegatronCoreActor.from_config(cfg)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, actor.vocab_size, (N, T), generator=g)
    prompt = torch.full((N,), 2)
    mask = torch.ones(N, T - 1)
    mask[:, 0] = 0.0  # position 0 scores the second prompt token
    batch = TrainBatch(tokens, prompt, T - prompt, mask, advantages=torch.randn(N, generator=g))
    source_lp = actor.logprobs(batch)
    batch.old_logprobs = source_lp
    loss_fn = make_grpo_loss_fn(cfg.grpo.clip_eps, cfg.grpo.clip_eps_high, 0.0, cfg.grpo.loss_aggregation,
                                global_num_tokens=float(N * (T - 1)), global_num_seqs=float(N))
    actor.train_step(batch, loss_fn)
    trainer = GRPOTrainer(cfg, actor, encode=list, decode=str, prompts=[("p", "a")], reward_fn=None, eos_id=0)
    trainer.save_checkpoint(1)
    trained_lp = actor.logprobs(batch)
    if rank == 0:
        torch.save({"tokens": tokens, "trained": trained_lp, "source": source_lp},
                   Path(run_dir) / "policy_logprobs.pt")
    destroy_distributed()


def launch(layout: str, model_dir: str, run_dir: str, world: int = 2) -> None:
    import torch.multiprocessing as mp

    from laconic_nemo.runtime.megatron_env import free_port

    port = free_port()
    mp.spawn(run, args=(world, layout, port, model_dir, run_dir), nprocs=world, join=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    launch(*sys.argv[1:4])
