"""The GRPO policy loss (clipped surrogate + optional k3 KL) and a masked-NLL SFT loss. Pure torch.

Shapes follow :mod:`laconic_nemo.grpo.interfaces`: n sequences of padded length T, per-token tensors
are [n, T-1] (position t scores token t+1), the response mask is 1.0 on positions that score
response tokens.

Normalisation: a loss built by :func:`make_grpo_loss_fn` / :func:`make_sft_loss_fn` is applied to one
micro-batch of one data-parallel rank, and is already divided by the GLOBAL normaliser of the
optimiser minibatch (tokens or sequences over all micro-batches and all DP ranks). The actor SUMS
gradients over micro-batches and DP ranks, so the total gradient is exactly the gradient of the
global objective. The returned metrics follow the same rule: every metric is this micro-batch's
share of a global mean, so the actor SUMS metrics over micro-batches and DP ranks.

Temperature: a loss function carries the attribute ``temperature``; the actor computes the log-probs it is
fed from ``logits / temperature``. The GRPO loss uses the rollout temperature, so the importance ratio
and the KL compare the distribution the responses were sampled from (as in verl's ``dp_actor.py``,
which divides the logits by ``temperature`` for old, new and reference log-probs alike); the old and
reference log-probs must be computed at the same temperature (``PolicyActor.logprobs(...,
temperature=...)``). The SFT loss uses temperature 1.
"""

from __future__ import annotations

import math

import torch

from laconic_nemo.grpo.interfaces import LossFn, TrainBatch

AGGREGATIONS = ("token_mean", "seq_mean_token_mean")


def grpo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_beta: float = 0.0,
    clip_dual: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GRPO loss.

    logprobs: [n, T-1] log pi_theta of the sampled tokens (differentiable).
    old_logprobs: [n, T-1] log pi_old (behaviour policy); no gradient flows into it.
    advantages: [n] one advantage per sequence, or [n, T-1] per token.
    mask: [n, T-1] 1.0 on response positions; off-mask positions get loss 0 (and finite gradients).
    ref_logprobs: [n, T-1] log pi_ref; required when ``kl_beta > 0``.
    clip_eps: lower (and, unless ``clip_eps_high`` is given, upper) clip of the ratio, > 0.
    clip_eps_high: upper clip (DAPO clip-higher); None = clip_eps.
    kl_beta: coefficient of the k3 estimator of KL(pi || pi_ref), >= 0.
    clip_dual: the constant C > 1 of dual-clip PPO (Ye et al. 2020, arXiv:1912.09729); None = off. Where
        A < 0 the surrogate loss is bounded by C |A|: ``min(-min(ratio A, clip(ratio) A), -C A)``, so a
        token whose ratio has grown far above 1 cannot push the loss without bound (EasyR1's
        ``compute_policy_loss``, ``clip_ratio_dual`` 3.0).

    Returns (per_token_loss [n, T-1], {"ratio", "clipped", "dual_clipped", "kl"} each [n, T-1]) with
    ratio = exp(logp - logp_old), per_token_loss = -min(ratio A, clip(ratio, 1-eps, 1+eps_high) A)
    (then dual-clipped where A < 0) + kl_beta * (exp(ref - logp) - (ref - logp) - 1), "clipped" = 1.0
    where the clipped term is the active (strictly smaller) one, "dual_clipped" = 1.0 where the dual
    bound is active, all zero off the mask.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [n, T-1], got shape {tuple(logprobs.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("mask", mask)):
        if t.shape != logprobs.shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(t.shape)}")
    if not clip_eps > 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not eps_high > 0:
        raise ValueError(f"clip_eps_high must be > 0 (or None), got {clip_eps_high}")
    if kl_beta < 0:
        raise ValueError(f"kl_beta must be >= 0, got {kl_beta}")
    if clip_dual is not None and not clip_dual > 1:
        raise ValueError(f"clip_dual must be > 1 (or None), got {clip_dual}")
    if kl_beta > 0 and ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs")
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(f"advantages [n] must have n={logprobs.shape[0]}, got {advantages.shape[0]}")
        adv = advantages.to(logprobs.dtype).unsqueeze(1).expand_as(logprobs)
    elif advantages.shape == logprobs.shape:
        adv = advantages.to(logprobs.dtype)
    else:
        raise ValueError(f"advantages must be [n] or [n, T-1], got {tuple(advantages.shape)}")

    on = mask > 0
    mask = mask.to(logprobs.dtype)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # Off the mask old/ref log-probs are arbitrary (0 by convention): keep exp() finite there.
    log_ratio = torch.where(on, logprobs - old_logprobs.detach().to(logprobs.dtype), zero)
    ratio = torch.exp(log_ratio)
    surr_unclipped = ratio * adv
    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high) * adv
    per_token = -torch.minimum(surr_unclipped, surr_clipped)
    clipped = (surr_clipped < surr_unclipped).to(logprobs.dtype) * mask
    if clip_dual is not None:
        dual_bound = -clip_dual * adv
        dual_active = (adv < 0) & (per_token > dual_bound)
        per_token = torch.where(dual_active, dual_bound, per_token)
        dual_clipped = dual_active.to(logprobs.dtype) * mask
    else:
        dual_clipped = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        delta = torch.where(on, ref_logprobs.detach().to(logprobs.dtype) - logprobs, zero)
        kl = torch.exp(delta) - delta - 1.0
    else:
        kl = torch.zeros_like(logprobs)
    if kl_beta > 0:
        per_token = per_token + kl_beta * kl
    per_token = per_token * mask
    return per_token, {"ratio": ratio * mask, "clipped": clipped, "dual_clipped": dual_clipped, "kl": kl * mask}


def _check_counts(global_num_tokens: float | None, global_num_seqs: float | None, aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if global_num_tokens is None or not (global_num_tokens > 0 and math.isfinite(global_num_tokens)):
        raise ValueError(f"global_num_tokens must be > 0, got {global_num_tokens}")
    if aggregation == "seq_mean_token_mean" and (global_num_seqs is None or not global_num_seqs > 0):
        raise ValueError(f"global_num_seqs must be > 0 for seq_mean_token_mean, got {global_num_seqs}")


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, global_num_tokens: float, global_num_seqs: float
) -> torch.Tensor:
    """This micro-batch's share of the global aggregate of ``per_token`` [n, T-1] (already masked or not).

    token_mean: sum(x * mask) / global_num_tokens.
    seq_mean_token_mean: sum_i (sum_t x_it mask_it / n_tokens_i) / global_num_seqs (rows with an
    empty mask contribute 0).
    """
    mask = mask.to(per_token.dtype)
    if aggregation == "token_mean":
        return (per_token * mask).sum() / global_num_tokens
    if aggregation == "seq_mean_token_mean":
        n_tok = mask.sum(dim=1).clamp(min=1.0)
        return ((per_token * mask).sum(dim=1) / n_tok).sum() / global_num_seqs
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def make_grpo_loss_fn(
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_beta: float = 0.0,
    aggregation: str = "seq_mean_token_mean",
    global_num_tokens: float | None = None,
    global_num_seqs: float | None = None,
    clip_dual: float | None = None,
    temperature: float = 1.0,
) -> LossFn:
    """GRPO loss over one micro-batch (see module docstring for the global normalisation).

    clip_eps / clip_eps_high / kl_beta / clip_dual: as in :func:`grpo_token_loss`.
    global_num_tokens: response tokens (mask sum) of the whole optimiser minibatch over ALL DP ranks.
    global_num_seqs: sequences of that minibatch over ALL DP ranks (seq_mean_token_mean).
    temperature: > 0, the sampling temperature; set as ``loss_fn.temperature`` for the actor, which computes
    the log-probs from ``logits / temperature`` (see the module docstring).
    The returned function maps (logprobs [n, T-1], TrainBatch) to (scalar loss, metrics) where metrics
    are this micro-batch's additive shares of: "loss", "pg_loss" (surrogate only), "kl" (mean k3),
    "clip_fraction" and "ratio_mean" (token means over the global minibatch).
    """
    _check_counts(global_num_tokens, global_num_seqs, aggregation)
    if not (math.isfinite(float(temperature)) and float(temperature) > 0):
        raise ValueError(f"temperature must be > 0 (rollout.temperature), got {temperature}")
    if global_num_seqs is None:
        global_num_seqs = 1.0

    def loss_fn(logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        if batch.advantages is None or batch.old_logprobs is None:
            raise ValueError("GRPO loss needs batch.advantages and batch.old_logprobs")
        mask = batch.response_mask.to(logprobs.device)
        per_token, parts = grpo_token_loss(
            logprobs,
            batch.old_logprobs.to(logprobs.device),
            batch.advantages.to(logprobs.device),
            mask,
            ref_logprobs=None if batch.ref_logprobs is None else batch.ref_logprobs.to(logprobs.device),
            clip_eps=clip_eps,
            clip_eps_high=clip_eps_high,
            kl_beta=kl_beta,
            clip_dual=clip_dual,
        )
        loss = aggregate(per_token, mask, aggregation, global_num_tokens, global_num_seqs)
        with torch.no_grad():
            kl_part = aggregate(parts["kl"], mask, aggregation, global_num_tokens, global_num_seqs)
            metrics = {
                "loss": float(loss.detach()),
                "pg_loss": float(loss.detach() - kl_beta * kl_part),
                "kl": float(kl_part),
                "clip_fraction": float(parts["clipped"].sum() / global_num_tokens),
                "ratio_mean": float(parts["ratio"].sum() / global_num_tokens),
            }
        return loss, metrics

    loss_fn.temperature = float(temperature)
    return loss_fn


def make_sft_loss_fn(global_num_tokens: float) -> LossFn:
    """Masked negative log-likelihood of the response tokens: -sum(logp * mask) / global_num_tokens.

    global_num_tokens: response tokens of the whole minibatch over ALL DP ranks (> 0).
    Metrics: "loss" (this micro-batch's additive share of the global mean NLL).
    """
    _check_counts(global_num_tokens, None, "token_mean")

    def loss_fn(logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        mask = batch.response_mask.to(logprobs.device, logprobs.dtype)
        if mask.shape != logprobs.shape:
            raise ValueError(f"response_mask {tuple(mask.shape)} must match logprobs {tuple(logprobs.shape)}")
        loss = -(logprobs * mask).sum() / global_num_tokens
        return loss, {"loss": float(loss.detach())}

    loss_fn.temperature = 1.0
    return loss_fn
