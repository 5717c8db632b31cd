"""MegatronCoreActor on the Hugging Face bridge path (``model.source: hf``) at DP=2 over gloo, against a
float64 transformers reference of the same checkpoint, at a sampling temperature T != 1.

Run by tests/test_bridge_dp.py through torch.multiprocessing; each rank writes ``<out>/rank<r>.pt``.
Each DP rank holds half of a global batch of N rows and takes one GRPO step with 2 micro-batches (packed, the
default, with a budget of one row: each row is a pack of its own); the reference computes the global loss of all
N rows in float64 with ``log_softmax(logits / T)``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

N, T_LEN, TEMP = 4, 12, 0.6


def make_config(hf_path: str):
    from omegaconf import OmegaConf

    from laconic_nemo.config import build_config

    cfg = OmegaConf.load(ROOT / "recipes" / "base.yaml")
    cfg.model.update(source="hf", path=hf_path, precision="fp32")
    cfg.parallel.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, backend="gloo")
    cfg.optim.update(lr=1e-3, grad_clip=0.0, warmup_steps=0)  # no clipping: the raw gradient is compared
    cfg.grpo.update(kl_beta=0.0, micro_batch_size=1, clip_eps=0.2, clip_eps_high=0.28, micro_batch_tokens=T_LEN)
    return build_config(cfg)  # the checked, typed config the entry points hand on


def reference_logprobs(hf64, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of the next tokens [N, T_LEN-1], float64."""
    logits = hf64(input_ids=tokens).logits / temperature
    return torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)


def make_batch(hf64, vocab: int):
    from laconic_nemo.grpo.interfaces import TrainBatch, response_mask

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (N, T_LEN), generator=g)
    prompt = torch.tensor([3, 4, 5, 3])
    resp = torch.tensor([6, 8, 4, 9])
    mask = response_mask(prompt, resp, T_LEN)
    with torch.no_grad():
        lp = reference_logprobs(hf64, tokens, TEMP).float()
    old = (lp + 0.2 * torch.randn(N, T_LEN - 1, generator=g)) * mask
    return TrainBatch(tokens, prompt, resp, mask, advantages=torch.randn(N, generator=g), old_logprobs=old)


HF_TO_MEGATRON = {  # tensors whose layout is the same in both (the vocabulary rows padded in megatron)
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "lm_head.weight": "output_layer.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
}


def run(rank: int, world: int, port: int, hf_path: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import transformers

    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.grpo.loss import make_grpo_loss_fn
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    cfg = make_config(hf_path)
    init_distributed(int(cfg.parallel.tensor_model_parallel_size), int(cfg.parallel.pipeline_model_parallel_size),
                     backend=str(cfg.parallel.backend), seed=int(cfg.run.seed))  # the entry point's part
    actor = MegatronCoreActor.from_config(cfg)
    hf64 = transformers.AutoModelForCausalLM.from_pretrained(hf_path, torch_dtype=torch.float64,
                                                             attn_implementation="eager")
    batch = make_batch(hf64, actor.vocab_size)
    rows = slice(actor.dp_rank * N // actor.dp_size, (actor.dp_rank + 1) * N // actor.dp_size)
    local = batch.select(rows)
    res: dict = {"dp_size": actor.dp_size, "calculate_per_token_loss": bool(actor.config.calculate_per_token_loss)}

    ref_lp = reference_logprobs(hf64, batch.tokens, TEMP)
    # positions up to each row's end (prompt + response); the actor's log-probs are 0 past it
    ends = (local.prompt_lengths + local.response_lengths).unsqueeze(1)
    inside = torch.arange(1, batch.tokens.shape[1]).unsqueeze(0) < ends
    res["logprob_err"] = float(((actor.logprobs(local, temperature=TEMP).double() - ref_lp[rows].detach())
                                * inside).abs().max())
    res["logprob_t1_gap"] = float(((actor.logprobs(local).double() - ref_lp[rows].detach()) * inside).abs().max())

    def loss_fn():
        return make_grpo_loss_fn(0.2, 0.28, 0.0, str(cfg.grpo.loss_aggregation),
                                 global_num_tokens=float(batch.response_mask.sum()), global_num_seqs=float(N),
                                 temperature=TEMP)

    # float64 reference of the global objective
    b64 = batch.select(slice(None))
    b64.response_mask, b64.advantages = batch.response_mask.double(), batch.advantages.double()
    b64.old_logprobs = batch.old_logprobs.double()
    hf64.zero_grad()
    ref_loss, _ = loss_fn()(ref_lp, b64)
    ref_loss.backward()
    named = dict(hf64.named_parameters())
    ref_norm = float(torch.sqrt(sum((p.grad**2).sum() for p in hf64.parameters() if p.grad is not None)))

    metrics = actor.train_step(local, loss_fn(), micro_batch_size=1)
    grads = actor.full_grad_dict()
    res["loss"], res["ref_loss"] = metrics["loss"], float(ref_loss)
    res["grad_norm"], res["ref_grad_norm"] = metrics["grad_norm"], ref_norm
    res["grad_err"] = {hf: float((grads[mg].double() - named[hf].grad).abs().max()) for hf, mg in HF_TO_MEGATRON.items()}
    res["grad_scale"] = {hf: float(named[hf].grad.abs().max()) for hf in HF_TO_MEGATRON}
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    destroy_distributed()


def launch(hf_path: str, out: str, world: int = 2) -> None:
    import torch.multiprocessing as mp

    from laconic_nemo.runtime.megatron_env import free_port

    mp.spawn(run, args=(world, free_port(), hf_path, out), nprocs=world, join=True)
