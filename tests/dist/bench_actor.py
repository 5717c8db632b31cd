"""Timing of one train step and one rollout of a tiny GPT (2 layers, hidden 64, vocab 40, batch 64,
128 new tokens). Usage: python tests/dist/bench_actor.py <tp>   (spawns tp processes over gloo)."""

from __future__ import annotations

import os
import sys
import time

import torch


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from omegaconf import OmegaConf

    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.config import build_config
    from laconic_nemo.grpo.interfaces import SamplingParams, TrainBatch, response_mask
    from laconic_nemo.grpo.loss import make_grpo_loss_fn
    from laconic_nemo.runtime.megatron_env import init_distributed

    cfg = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "base.yaml"))
    cfg.model.update(vocab_size=40, num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256)
    cfg.parallel.update(tensor_model_parallel_size=world, backend="gloo")
    cfg.grpo.micro_batch_size = 16
    cfg = build_config(cfg)  # the checked, typed config the entry points hand on
    init_distributed(int(cfg.parallel.tensor_model_parallel_size), int(cfg.parallel.pipeline_model_parallel_size),
                     backend=str(cfg.parallel.backend), seed=int(cfg.run.seed))  # the entry point's part
    actor = MegatronCoreActor.from_config(cfg)
    prompts = [[1 + (i * 7 + j) % 38 for j in range(12)] for i in range(64)]
    sp = SamplingParams(max_new_tokens=128, eos_id=0, seed=1)  # random weights: EOS rarely stops early
    actor.generate(prompts[:4], SamplingParams(max_new_tokens=4, eos_id=0))
    t0 = time.perf_counter()
    out = actor.generate(prompts, sp)
    t_gen = time.perf_counter() - t0
    n, T = out.tokens.shape
    mask = response_mask(out.prompt_lengths, out.response_lengths, T)
    batch = TrainBatch(out.tokens, out.prompt_lengths, out.response_lengths, mask,
                       advantages=torch.randn(n, generator=torch.Generator().manual_seed(0)))
    t0 = time.perf_counter()
    batch.old_logprobs = actor.logprobs(batch)
    t_lp = time.perf_counter() - t0
    fn = make_grpo_loss_fn(global_num_tokens=float(mask.sum()), global_num_seqs=float(n))
    actor.train_step(batch, fn)
    t0 = time.perf_counter()
    actor.train_step(batch, fn)
    t_step = time.perf_counter() - t0
    if rank == 0:
        print(f"TP={world}: rollout {t_gen:.2f}s (64 x {int(out.response_lengths.max())} new tokens, mean "
              f"{out.response_lengths.float().mean():.0f}), logprobs {t_lp:.2f}s, train step {t_step:.2f}s "
              f"(micro-batch 16, T={T})", flush=True)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    world = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    from laconic_nemo.runtime.megatron_env import free_port

    mp.spawn(run, args=(world, free_port()), nprocs=world, join=True)
