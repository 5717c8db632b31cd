"""The contract between the GRPO loop and the things it drives.

The trainer (``laconic_nemo.grpo.trainer``) knows nothing of Megatron, NeMo or vLLM: it talks to
a :class:`PolicyActor` (a sharded policy that can generate, score log-probs and take optimiser
steps) through the types below. The bare megatron-core actor
(``laconic_nemo.actors.megatron_core``) and the NeMo-Aligner actor
(``laconic_nemo.actors.nemo_aligner``) both implement it.

Token layout used everywhere (N sequences, T = padded total length):

* ``tokens``           LongTensor [N, T]  prompt tokens followed by response tokens, right-padded
  with ``pad_id``. The response includes the EOS token when the sample stopped on EOS.
* ``prompt_lengths``   LongTensor [N]     number of prompt tokens of each row.
* ``response_lengths`` LongTensor [N]     number of response tokens present in ``tokens``
  (EOS included when present).
* per-token tensors (log-probs, masks) are [N, T - 1]: position ``t`` scores ``tokens[:, t + 1]``
  given ``tokens[:, : t + 1]``. The response mask is 1 exactly at positions
  ``prompt_len - 1 .. prompt_len + response_len - 2``.
* ``lengths``          the paper's L: generated tokens EXCLUDING the EOS token. A response cut at
  the generation limit (``truncated``) has L = max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch


@dataclass
class SamplingParams:
    """Sampling settings for one rollout call.

    temperature: softmax temperature (> 0; 1.0 = plain sampling).
    top_p: nucleus mass in (0, 1]; 1.0 disables nucleus filtering.
    max_new_tokens: generation limit L_max (per response).
    eos_id: token id that ends a response.
    seed: base seed; the engine derives per-sample streams so results do not depend on batching.
    stop_ids: further ids that end a response as EOS does (the chat template's end-of-turn token when it differs
        from EOS, e.g. Qwen's ``<|im_end|>``; NeMo's single-token end strings). The ending id is kept in the
        response and, as EOS, not counted in L.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 4096
    eos_id: int = 0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def stops(self) -> tuple[int, ...]:
        """Every id that ends a response: EOS first, then the other stop ids (sorted, without repeats)."""
        eos = int(self.eos_id)
        return (eos,) + tuple(sorted({int(i) for i in self.stop_ids} - {eos}))


@dataclass
class GenerationOutput:
    """What a rollout engine returns for N prompts (already repeated G times by the caller).

    tokens: LongTensor [N, T] prompt + response (EOS included when emitted), right-padded.
    prompt_lengths: LongTensor [N].
    response_lengths: LongTensor [N] response tokens in ``tokens`` (EOS counted).
    lengths: LongTensor [N] generated tokens WITHOUT EOS (the L of the cost).
    truncated: BoolTensor [N] True when the response hit max_new_tokens without EOS.
    logprobs: optional FloatTensor [N, T-1]: log p of each response token under the engine's own forward at
    the sampling temperature (position t scores token t+1, 0 elsewhere; the per-token layout of
    :class:`TrainBatch`), for the rollout / training log-prob mismatch; None unless asked for.
    """

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    lengths: torch.Tensor
    truncated: torch.Tensor
    logprobs: torch.Tensor | None = None


@dataclass
class TrainBatch:
    """One rollout batch (this data-parallel rank's share), ready for the policy update.

    tokens, prompt_lengths, response_lengths: as in :class:`GenerationOutput`.
    response_mask: FloatTensor [N, T-1] 1.0 on positions that score response tokens.
    advantages: FloatTensor [N] one advantage per response (broadcast over its tokens).
    old_logprobs: FloatTensor [N, T-1] log pi_old of the sampled tokens (0 off the mask).
    ref_logprobs: FloatTensor [N, T-1] or None; log pi_ref, needed when kl_beta > 0.
    extras: anything else a loss may need (e.g. SFT targets).
    """

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def select(self, index: torch.Tensor | slice) -> "TrainBatch":
        """Rows ``index`` of every per-sample tensor (a minibatch or micro-batch view)."""

        def pick(x):
            return x[index] if isinstance(x, torch.Tensor) else x

        return TrainBatch(
            tokens=pick(self.tokens),
            prompt_lengths=pick(self.prompt_lengths),
            response_lengths=pick(self.response_lengths),
            response_mask=pick(self.response_mask),
            advantages=pick(self.advantages),
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            extras={k: pick(v) for k, v in self.extras.items()},
        )


# A loss over one micro-batch: (per-token log-probs [n, T-1] of the current policy, the micro-batch)
# -> (scalar loss already divided by its share of the GLOBAL normaliser, dict of float metrics).
# Its attribute ``temperature`` (default 1.0 when absent) is the temperature the actor computes those
# log-probs at (log_softmax(logits / temperature)).
# The actor sums the gradients of all micro-batches and all data-parallel ranks (SUM, not mean),
# so a loss normalised by a global count yields exactly the global-batch objective.
LossFn = Callable[[torch.Tensor, TrainBatch], "tuple[torch.Tensor, dict[str, float]]"]


@runtime_checkable
class PolicyActor(Protocol):
    """A (possibly TP/PP/DP-sharded) policy: exactly what the trainer (``laconic_nemo.grpo.trainer``, with
    ``grpo.checkpoint``) uses. Every method is called on every rank (SPMD).

    dp_rank, dp_size, dp_group: this rank's data-parallel coordinate and group (None without torch.distributed);
        the trainer sums token counts, lengths and metrics over ``dp_group``.
    tp_rank, pp_rank: this rank's tensor / pipeline coordinate (names the checkpoint shard
        ``model_tpXX_ppYY.pt``; stand-ins without model parallelism may omit them: 0).
    model_parallel_group: the TP x PP group holding the same data (the reward is graded once there and
        broadcast; stand-ins may omit it: None).

    The supervised warm-up needs more (:class:`laconic_nemo.app.warmup.WarmupActor`).
    """

    dp_rank: int
    dp_size: int
    dp_group: Any
    tp_rank: int
    pp_rank: int
    model_parallel_group: Any

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample one response per prompt (this DP rank's prompts). Returns CPU tensors."""
        ...

    def logprobs(self, batch: TrainBatch, reference: bool = False, temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probs [N, T-1] of ``batch.tokens`` under the current (or reference) policy at
        ``temperature`` (log_softmax(logits / temperature)), computed from vocab-parallel logits;
        identical on every TP/PP rank of the DP group."""
        ...

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, micro_batch_size: int) -> dict[str, float]:
        """One optimiser step on ``batch`` (this DP rank's minibatch), gradient accumulation over
        micro-batches, gradients SUMMED over DP, grad-norm clipping. Returns metrics including
        ``grad_norm`` and ``lr``."""
        ...

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """This rank's model + optimiser (+ scheduler) state, for ``torch.save``."""
        ...

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict_for_checkpoint` returned (same layout)."""
        ...

    def memory_prediction(self) -> str | None:
        """The memory model's prediction (:mod:`laconic_nemo.actors.memory`) for the last :meth:`train_step`'s
        micro-batches, in words, for the line of a step that ran out of memory; None when there is none (the trainer
        reads it with ``getattr``: stand-ins may omit it)."""
        ...


def response_mask(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N, seq_len - 1] float mask, 1 where position t scores a response token (token t + 1).

    prompt_lengths, response_lengths: LongTensor [N]."""
    t = torch.arange(seq_len - 1).unsqueeze(0)
    start = (prompt_lengths - 1).unsqueeze(1)
    end = (prompt_lengths + response_lengths - 1).unsqueeze(1)
    return ((t >= start) & (t < end)).float()
