"""Multi-process checks of MegatronCoreActor against the float64 reference GPT.

Run by tests/test_megatron_actor.py through torch.multiprocessing (one job per layout); each rank writes
``<out>/<layout>_rank<r>.pt`` with the measured errors and flags, the test asserts on them.
Layouts: tp2 (TP=2, KL on), pp2 (PP=2), dp2 (DP=2 at TP=1, each rank holding half of the batch). Every layout runs
the ``sdpa`` core attention (``scaled_dot_product_attention``; megatron's local attention is checked against
Hugging Face in tests/test_bridge.py) and both samplers (host float64 and on-device with row compaction).
Training and log-probs run packed (the default; a budget of MICRO_BATCH_TOKENS makes several packs of 1-3 rows,
with PP 2 padded at their tails to one size) and, once each, unpacked (micro-batches of 3 padded rows) from the same
weights; both are compared with the reference and with each other.
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from pathlib import Path

import engine_checks
import reference_gpt as R  # the folder of this file: sys.path[0] as a script, tests/conftest.py under pytest
import reference_loop
import torch

LAYERS, HIDDEN, HEADS, FFN, VOCAB = 2, 64, 4, 256, 41
N, T, EOS = 8, 18, 3
MICRO_BATCH_TOKENS = 24  # rows of 4..18 tokens: several packs per rank, also with DP 2 (4 rows each)
LAYOUTS = {"tp2": (2, 1, 0.05), "pp2": (1, 2, 0.0), "dp2": (1, 1, 0.0)}  # tp, pp, kl_beta


def make_config(tp: int, pp: int, kl_beta: float):
    from omegaconf import OmegaConf

    from laconic_nemo.config import build_config

    root = Path(__file__).resolve().parents[2]
    cfg = OmegaConf.load(root / "recipes" / "base.yaml")
    cfg.model.update(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                     vocab_size=VOCAB, max_position_embeddings=128, attention="sdpa")
    cfg.parallel.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, backend="gloo")
    cfg.optim.update(lr=1e-3, adam_eps=1e-3, grad_clip=0.5, warmup_steps=0)
    cfg.grpo.update(kl_beta=kl_beta, micro_batch_size=3, clip_eps=0.2, clip_eps_high=0.28,
                    micro_batch_tokens=MICRO_BATCH_TOKENS)
    return build_config(cfg)  # the checked, typed config the entry points hand on


def make_batch(w64):
    """Global batch of N rows with prompts of 3..6 tokens, right-padded responses and GRPO fields."""
    from laconic_nemo.grpo.interfaces import TrainBatch

    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (N, T), generator=g)
    prompt = torch.randint(3, 7, (N,), generator=g)
    resp = torch.stack([torch.randint(1, int(T - p) + 1, (1,), generator=g)[0] for p in prompt])
    mask = torch.zeros(N, T - 1)
    for i in range(N):
        p, r = int(prompt[i]), int(resp[i])
        mask[i, p - 1 : p + r - 1] = 1.0
        tokens[i, p + r :] = EOS
    ref_lp = R.token_logprobs(w64, tokens, LAYERS, HEADS).float()
    old = (ref_lp + 0.3 * torch.randn(N, T - 1, generator=g)) * mask
    adv = torch.randn(N, generator=g)
    return TrainBatch(tokens, prompt, resp, mask, advantages=adv, old_logprobs=old)


def reference_step(w32, batch, cfg, kl_beta):
    """Float64 loss, gradients, grad norm and the Adam-updated weights for the whole global batch."""
    from laconic_nemo.grpo.loss import make_grpo_loss_fn

    w = {k: v.double().clone().requires_grad_(True) for k, v in w32.items()}
    lp = R.token_logprobs(w, batch.tokens, LAYERS, HEADS)
    b64 = batch.select(slice(None))
    b64.response_mask = batch.response_mask.double()
    b64.advantages = batch.advantages.double()
    b64.old_logprobs = batch.old_logprobs.double()
    if batch.ref_logprobs is not None:
        b64.ref_logprobs = batch.ref_logprobs.double()
    fn = make_grpo_loss_fn(cfg.grpo.clip_eps, cfg.grpo.clip_eps_high, kl_beta, cfg.grpo.loss_aggregation,
                           float(batch.response_mask.sum()), float(N))
    loss, metrics = fn(lp, b64)
    loss.backward()
    grads = {k: v.grad.detach().clone() for k, v in w.items()}
    norm = torch.sqrt(sum((g**2).sum() for g in grads.values()))
    coeff = min(1.0, cfg.optim.grad_clip / (float(norm) + 1e-6))
    clipped = {k: g * coeff for k, g in grads.items()}
    params = [v.detach().clone() for v in w.values()]
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2),
                            eps=cfg.optim.adam_eps, weight_decay=0.0)
    for p, g in zip(params, clipped.values()):
        p.grad = g
    opt.step()
    return float(loss.detach()), metrics, clipped, float(norm), dict(zip(w.keys(), params))


def max_err(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


def run(rank: int, world: int, layout: str, port: int, out_dir: str) -> None:
    # every FutureWarning / DeprecationWarning raised while the actor is built and used, each occurrence (what a
    # user of the actor would see printed: deprecated calls the actor makes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        warnings.simplefilter("always", DeprecationWarning)
        res = checks(rank, world, layout, port)
    res["deprecations"] = sorted({f"{w.category.__name__}: {w.message} ({Path(w.filename).name}:{w.lineno})"
                                  for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))})
    torch.save(res, Path(out_dir) / f"{layout}_rank{rank}.pt")
    from laconic_nemo.runtime.megatron_env import destroy_distributed

    destroy_distributed()


def checks(rank: int, world: int, layout: str, port: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from laconic_nemo.actors.megatron_core import MegatronCoreActor
    from laconic_nemo.grpo.interfaces import SamplingParams
    from laconic_nemo.grpo.loss import make_grpo_loss_fn
    from laconic_nemo.rollout import megatron_sampler
    from laconic_nemo.runtime.megatron_env import init_distributed

    tp, pp, kl_beta = LAYOUTS[layout]
    cfg = make_config(tp, pp, kl_beta)
    init_distributed(int(cfg.parallel.tensor_model_parallel_size), int(cfg.parallel.pipeline_model_parallel_size),
                     backend=str(cfg.parallel.backend), seed=int(cfg.run.seed))  # the entry point's part
    actor = MegatronCoreActor.from_config(cfg)
    res: dict = {"layout": layout, "dp_size": actor.dp_size}
    w32 = R.init_full_weights(LAYERS, HIDDEN, FFN, VOCAB, seed=0)
    w64 = {k: v.double() for k, v in w32.items()}
    actor.load_full_state_dict(w32)
    if kl_beta > 0:
        actor.reset_reference()
    res["roundtrip_weights_err"] = max_err(actor.full_state_dict(), w32)

    batch = make_batch(w64)
    rows = slice(actor.dp_rank * N // actor.dp_size, (actor.dp_rank + 1) * N // actor.dp_size)
    local = batch.select(rows)

    # 1. log-probs
    ref_lp = R.token_logprobs(w64, batch.tokens, LAYERS, HEADS)
    lp = actor.logprobs(local)
    # positions up to each row's end (prompt + response); past it log-probs are 0
    ends = batch.prompt_lengths + batch.response_lengths
    inside = (torch.arange(T - 1).unsqueeze(0) < (ends - 1).unsqueeze(1))[rows]
    res["logprob_err"] = float(((lp.double() - ref_lp[rows]) * inside).abs().max())
    res["logprob_past_end_max"] = float((lp * ~inside).abs().max())
    packs = actor.batches.packs(local)
    res["pack_sizes"] = [p.size for p in packs]
    res["pack_real_tokens"] = [p.real_tokens for p in packs]
    actor.micro_batch_tokens = 0  # the unpacked path on the same weights
    lp_rows = actor.logprobs(local)
    actor.micro_batch_tokens = MICRO_BATCH_TOKENS
    res["unpacked_logprob_err"] = float(((lp_rows.double() - ref_lp[rows]) * inside).abs().max())
    res["packed_vs_unpacked_logprob"] = float((lp - lp_rows).abs().max())
    if kl_beta > 0:
        local.ref_logprobs = actor.logprobs(local, reference=True)
        batch.ref_logprobs = ref_lp.float()
        batch.ref_logprobs[rows] = local.ref_logprobs

    # 2. one GRPO step vs the float64 reference
    loss_fn = make_grpo_loss_fn(cfg.grpo.clip_eps, cfg.grpo.clip_eps_high, kl_beta, cfg.grpo.loss_aggregation,
                                global_num_tokens=float(batch.response_mask.sum()), global_num_seqs=float(N))
    ref_loss, ref_metrics, ref_grads, ref_norm, ref_new = reference_step(w32, batch, cfg, kl_beta)
    # first the unpacked path, then back to the initial weights and a fresh optimiser for the packed one
    actor.micro_batch_tokens = 0
    m_rows = actor.train_step(local, loss_fn, micro_batch_size=3)
    grads_rows = actor.full_grad_dict()
    res["unpacked_loss"], res["unpacked_grad_norm"] = m_rows["loss"], m_rows["grad_norm"]
    res["unpacked_grad_err"] = max_err(grads_rows, ref_grads)
    actor.load_full_state_dict(w32)
    actor.reset_optimizer(float(cfg.optim.lr))
    actor.micro_batch_tokens = MICRO_BATCH_TOKENS
    metrics = actor.train_step(local, loss_fn, micro_batch_size=3)
    res["loss"], res["ref_loss"] = metrics["loss"], ref_loss
    res["clip_fraction"], res["ref_clip_fraction"] = metrics["clip_fraction"], ref_metrics["clip_fraction"]
    res["grad_norm"], res["ref_grad_norm"] = metrics["grad_norm"], ref_norm
    grads = actor.full_grad_dict()
    res["grad_err"] = max_err(grads, ref_grads)
    res["packed_vs_unpacked_grad"] = max_err(grads, grads_rows)
    res["grad_scale"] = max(float(g.abs().max()) for g in ref_grads.values())
    res["update_err"] = max_err(actor.full_state_dict(), ref_new)
    res["update_scale"] = max(float((ref_new[k] - w64[k]).abs().max()) for k in w64)
    if kl_beta > 0:  # reference weights survive the update
        res["ref_logprob_err_after_step"] = float(((actor.logprobs(local, reference=True).double() - ref_lp[rows])
                                                   * inside).abs().max())

    # 3. generation
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(2, 7, (16,),
                                                                                               generator=g)]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=30, eos_id=EOS, seed=7)
    out = actor.generate(prompts, sp)
    out_again = actor.generate(prompts, sp)
    out_other = actor.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=30, eos_id=EOS,
                                                       seed=8))
    out_prefix = actor.generate(prompts[:5], sp)
    res["gen"] = {k: getattr(out, k) for k in ("tokens", "prompt_lengths", "response_lengths", "lengths",
                                                "truncated")}
    res["gen_same_seed"] = all(torch.equal(getattr(out, k), getattr(out_again, k)) for k in res["gen"])
    res["gen_other_seed_differs"] = not torch.equal(out.tokens, out_other.tokens)
    w_new = actor.full_state_dict()
    w_new64 = {k: v.double() for k, v in w_new.items()}
    T5 = out_prefix.tokens.shape[1]
    res["gen_prefix_same"] = torch.equal(out_prefix.tokens, out.tokens[:5, :T5]) and torch.equal(
        out_prefix.lengths, out.lengths[:5])
    gathered = [None] * world
    dist.all_gather_object(gathered, out.tokens)
    res["gen_identical_across_ranks_of_dp_group"] = all(
        torch.equal(gathered[r], out.tokens) for r in range(world) if (actor.dp_size == 1)
    )

    _cache: dict = {}

    def ref_step(tokens, start):
        _cache.setdefault("seq", torch.empty(tokens.shape[0], 0, dtype=torch.long))
        _cache["seq"] = torch.cat([_cache["seq"], tokens], dim=1)
        return R.forward(w_new64, _cache["seq"], LAYERS, HEADS)[:, -1]

    ref_out = megatron_sampler.sample(ref_step, lambda x, b: x, prompts, sp, stream=actor.dp_rank)
    res["gen_matches_float64_recompute"] = torch.equal(ref_out.tokens, out.tokens)
    res["gen_float64_tokens"] = ref_out.tokens

    # 3b. the on-device sampler (finished rows compacted out of the KV cache every 4 steps) against the same
    # loop on the float64 reference model, whose "cache" (the fed sequences) is compacted alike
    actor.sampler, actor.sync_every = "device", 4
    dev_out = actor.generate(prompts, sp)
    res["dev_gen"] = {k: getattr(dev_out, k) for k in res["gen"]}
    dev_prefix = actor.generate(prompts[:5], sp)
    res["dev_gen_prefix_same"] = torch.equal(dev_prefix.tokens, dev_out.tokens[:5, : dev_prefix.tokens.shape[1]])
    _cache.clear()

    def compact(keep):
        _cache["seq"] = _cache["seq"][keep]

    ref_dev = megatron_sampler.sample_on_device(ref_step, lambda x, b: x, prompts, sp, stream=actor.dp_rank,
                                                compact=compact, sync_every=4)
    res["dev_gen_matches_float64_recompute"] = torch.equal(ref_dev.tokens, dev_out.tokens)
    actor.sampler = "exact"
    res["gen_matches_reference_loop"] = torch.equal(reference_loop.actor_reference(actor, prompts, sp).tokens,
                                                    out.tokens)

    # 3c. the decode engine against today's sampler loop (tests/dist/engine_checks.py)
    engine_checks.run_checks(actor, EOS, res)

    # 4. checkpoint round trip: state after step 1, step 2 twice from it
    buf = io.BytesIO()
    torch.save(actor.state_dict_for_checkpoint(), buf)
    m2 = actor.train_step(local, loss_fn, micro_batch_size=3)
    w2 = actor.full_state_dict()
    buf.seek(0)
    actor.load_checkpoint_state(torch.load(buf, weights_only=False))
    m2b = actor.train_step(local, loss_fn, micro_batch_size=3)
    w2b = actor.full_state_dict()
    res["ckpt_bitwise"] = m2 == m2b and all(torch.equal(w2[k], w2b[k]) for k in w2)
    res["ckpt_step_changed_weights"] = max_err(w2, w_new) > 0
    return res


def launch(layout: str, out: str, world: int = 2) -> None:
    import torch.multiprocessing as mp

    from laconic_nemo.runtime.megatron_env import free_port

    port = free_port()
    mp.spawn(run, args=(world, layout, port, out), nprocs=world, join=True)


if __name__ == "__main__":
    launch(sys.argv[1], sys.argv[2])
