"""Log-probs at the sampling temperature: the GRPO loss carries rollout.temperature, and the trainer asks for
old and reference log-probs at that temperature, as the authors' framework does (verl
``verl/workers/actor/dp_actor.py`` ``_forward_micro_batch``: ``logits.div_(temperature)`` before the
log-probs, for ``compute_log_prob`` and ``update_policy`` alike). The actors' numerics at T != 1 are
checked against float64 in tests/test_bridge_dp.py (megatron-core) and tests/test_nemo_aligner.py (NeMo)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from laconic_nemo.config import load_config
from laconic_nemo.grpo.interfaces import GenerationOutput
from laconic_nemo.grpo.loss import make_grpo_loss_fn, make_sft_loss_fn
from laconic_nemo.grpo.trainer import GRPOTrainer

TINY = Path(__file__).resolve().parent.parent / "recipes" / "tiny_cpu.yaml"


def test_loss_functions_carry_their_temperature():
    assert make_grpo_loss_fn(global_num_tokens=4.0, global_num_seqs=2.0, temperature=0.6).temperature == 0.6
    assert make_grpo_loss_fn(global_num_tokens=4.0, global_num_seqs=2.0).temperature == 1.0
    assert make_sft_loss_fn(4.0).temperature == 1.0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            make_grpo_loss_fn(global_num_tokens=4.0, global_num_seqs=2.0, temperature=bad)


class RecordingActor:
    """A PolicyActor that records the temperature of every log-prob request and loss."""

    dp_rank, dp_size, dp_group = 0, 1, None

    def __init__(self):
        self.logprob_temps, self.loss_temps = [], []

    def generate(self, prompts, sampling):
        n, p = len(prompts), max(len(x) for x in prompts)
        tokens = torch.ones(n, p + 3, dtype=torch.long)
        return GenerationOutput(tokens=tokens, prompt_lengths=torch.full((n,), p),
                                response_lengths=torch.full((n,), 3), lengths=torch.arange(n) % 3 + 1,
                                truncated=torch.zeros(n, dtype=torch.bool))

    def logprobs(self, batch, reference=False, temperature=1.0):
        self.logprob_temps.append((reference, temperature))
        return torch.zeros(batch.tokens.shape[0], batch.tokens.shape[1] - 1)

    def train_step(self, batch, loss_fn, micro_batch_size):
        self.loss_temps.append(loss_fn.temperature)
        return {"loss": 0.0, "grad_norm": 0.0, "lr": 1.0}


def test_trainer_computes_old_and_reference_logprobs_at_the_rollout_temperature():
    cfg = load_config(TINY, ["rollout.temperature=0.6", "grpo.kl_beta=0.01"])
    actor = RecordingActor()
    prompts = [(f"P{i}", str(i)) for i in range(50)]
    trainer = GRPOTrainer(cfg, actor, encode=lambda s: [2] * len(s), decode=str, prompts=prompts,
                          reward_fn=lambda texts, answers: ([float(i % 2) for i in range(len(texts))], {}), eos_id=1)
    trainer.train_step(0)
    assert actor.logprob_temps == [(False, 0.6), (True, 0.6)]
    assert actor.loss_temps and set(actor.loss_temps) == {0.6}


def test_megatron_token_logprobs_divide_by_temperature():
    """Logprobs.token_logprobs (the megatron-core actor's) on a single TP rank equals float64 log_softmax(logits / T)."""
    pytest.importorskip("megatron.core")
    from laconic_nemo.actors.megatron_logprobs import Logprobs
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    init_distributed(1, 1, seed=0)
    try:
        # sequence chunks of 2 positions (5 = 2 + 2 + 1), with and without autograd (checkpointed chunks)
        fake = SimpleNamespace(tp_rank=0, vocab_size=9, logprob_chunk_size=2)
        logits = torch.randn(2, 5, 10, generator=torch.Generator().manual_seed(0))  # one padded vocab column
        labels = torch.randint(0, 9, (2, 5), generator=torch.Generator().manual_seed(1))
        ref = torch.log_softmax(logits[..., :9].double() / 0.6, -1).gather(-1, labels[..., None]).squeeze(-1)
        got = Logprobs.token_logprobs(fake, logits, labels, 0.6)
        assert torch.allclose(got.double(), ref, atol=1e-5)
        leaf = logits.clone().requires_grad_(True)
        got = Logprobs.token_logprobs(fake, leaf, labels, 0.6)
        got.sum().backward()
        ref_leaf = logits.double().clone().requires_grad_(True)
        ref = torch.log_softmax(ref_leaf[..., :9] / 0.6, -1).gather(-1, labels[..., None]).squeeze(-1)
        ref.sum().backward()
        assert torch.allclose(got.double(), ref.detach(), atol=1e-5)
        assert torch.allclose(leaf.grad.double(), ref_leaf.grad, atol=1e-5)  # the padded column gets no gradient
    finally:
        destroy_distributed()
