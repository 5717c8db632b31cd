"""Today's sampler, the reference of the decode engine's equivalence tests: the loops of
``laconic_nemo.rollout.megatron_sampler`` (``sample``: host float64; ``sample_on_device``: counter uniforms,
finished rows compacted) driven by a megatron-core forward step with megatron's ``InferenceParams`` KV cache
- the step the megatron-core actor generated with before the engine.

* :func:`model_reference`: one ``GPTModel`` (any TP size, PP 1), its forward called directly;
* :func:`actor_reference`: a ``MegatronCoreActor`` at any TP / PP, its forward through megatron's pipeline
  schedule (as the actor's ``generate`` did), tokens broadcast from TP rank 0 of the last stage.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from laconic_nemo.rollout import megatron_sampler
from laconic_nemo.runtime.megatron_compat import kv_cache_forward


def gathered_forward(model, tokens, position_ids, mask, cache):
    """The model's forward over the KV cache ``cache`` with megatron's own TP gather of the logits
    (``runtime_gather_output``; laconic_nemo.runtime.megatron_compat.kv_cache_forward serves every megatron-core
    release). The gather's torch call (all_gather_into_tensor) is deprecated in torch 2.13: a FutureWarning of this
    reference, not of the code under test (tests/test_megatron_actor.py records those), so it is not shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return kv_cache_forward(model, tokens, position_ids, mask, cache)


def _loop(step, broadcast, compact, prompts, sampling, sampler, stream, sync_every, device="cpu"):
    if sampler == "exact":
        return megatron_sampler.sample(step, broadcast, prompts, sampling, stream=stream)
    return megatron_sampler.sample_on_device(step, broadcast, prompts, sampling, stream=stream, device=device,
                                             compact=compact, sync_every=sync_every)


@torch.no_grad()
def model_reference(model, vocab_size: int, prompts, sampling, sampler: str = "exact", stream: int = 0,
                    sync_every: int = 4, compact: bool = True, causal_mask: bool = False):
    """Today's loop on ``model`` (a GPTModel, PP 1) with an ``InferenceParams`` cache. causal_mask: hand the
    prefill its causal mask (True = masked, the values of megatron's ``get_default_causal_mask``) instead of
    letting megatron's local attention build it on ``device="cuda"`` (a process without the CPU patches)."""
    from megatron.core.inference_params import InferenceParams

    max_len = max(len(p) for p in prompts) + int(sampling.max_new_tokens)
    params = InferenceParams(max_batch_size=len(prompts), max_sequence_length=max_len)
    was = model.training
    model.eval()

    def step(tokens, start):
        b, q = tokens.shape
        pos = torch.arange(start, start + q).unsqueeze(0).expand(b, q)
        mask = None
        if causal_mask and q > 1:
            mask = torch.ones(q, start + q, dtype=torch.bool).triu(start + 1).expand(b, 1, q, start + q)
        out = gathered_forward(model, tokens, pos, mask, params)
        params.sequence_len_offset += tokens.shape[1]
        return out[:, -1, :vocab_size].float()

    def do_compact(keep):
        for layer, (k, v) in params.key_value_memory_dict.items():
            params.key_value_memory_dict[layer] = (k.index_select(1, keep), v.index_select(1, keep))
        params.max_batch_size = params.current_batch_size = len(keep)

    try:
        return _loop(step, lambda x, b: x, do_compact if compact else None, prompts, sampling, sampler, stream,
                     sync_every)
    finally:
        model.train(was)


@torch.no_grad()
def actor_reference(actor, prompts, sampling, sampler: str = "exact", sync_every: int = 4, compact: bool = True):
    """Today's loop on a MegatronCoreActor (any TP / PP): the forward step the actor's ``generate`` ran before
    the decode engine (megatron's schedule over one micro-batch with an ``InferenceParams`` cache; logits
    gathered over TP on the last stage; tokens broadcast from its TP rank 0, then over the pipeline)."""
    from megatron.core import parallel_state
    from megatron.core.inference_params import InferenceParams

    max_len = max(len(p) for p in prompts) + int(sampling.max_new_tokens)
    params = InferenceParams(max_batch_size=len(prompts), max_sequence_length=max_len)
    on_device = sampler == "device"

    def step(tokens, start):
        tok = tokens.to(actor.device)
        box = []

        def forward_step(data_iterator, model):
            next(data_iterator)
            out = gathered_forward(model, tok, actor.batches.position_ids(*tok.shape, start=start), None, params)

            def loss_func(output):
                last = output[:, -1, :].float()
                box.append(last[:, : actor.vocab_size])
                return last.sum() * 0.0, torch.tensor(1, dtype=torch.int), {}

            return out, loss_func

        actor.schedule.run(forward_step, [None], tok.shape[1], tok.shape[0], forward_only=True)
        params.sequence_len_offset += tok.shape[1]
        if actor.is_last_stage and actor.tp_rank == 0:
            return box[0] if on_device else box[0].cpu()
        return None

    def broadcast(sampled, b):
        buf = sampled.to(actor.device) if sampled is not None else torch.empty(b, dtype=torch.long,
                                                                               device=actor.device)
        if actor.is_last_stage and actor.info.tp_size > 1:
            dist.broadcast(buf, src=parallel_state.get_tensor_model_parallel_src_rank(),
                           group=parallel_state.get_tensor_model_parallel_group())
        buf = actor.schedule.pp_broadcast(buf)
        return buf if on_device else buf.cpu()

    def do_compact(keep):
        for layer, (k, v) in params.key_value_memory_dict.items():
            params.key_value_memory_dict[layer] = (k.index_select(1, keep), v.index_select(1, keep))
        params.max_batch_size = params.current_batch_size = len(keep)

    with actor.schedule.eval_mode():
        return _loop(step, broadcast, do_compact if compact else None, prompts, sampling, sampler, actor.dp_rank,
                     sync_every, device=actor.device)
