"""GRPO with LACONIC in Hugging Face TRL: a plain GRPOTrainer script plus the three lines marked LACONIC.

    pip install -e ".[hf,trl]"
    python examples/integrations/trl_grpo_laconic.py --model Qwen/Qwen2.5-0.5B-Instruct --budget 64
    accelerate launch --num_processes 2 examples/integrations/trl_grpo_laconic.py --model Qwen/Qwen2.5-0.5B-Instruct
    python examples/integrations/trl_grpo_laconic.py --tiny --max-steps 3   # CPU, a tiny random model, no download

The task: sums of two digits ("3+4="), reward 1 when the completion starts with the right number. The mean
completion length is priced against the budget B: lambda rises while the global mean is above B and falls below it.
Add ``--resume-from-checkpoint OUTPUT_DIR/checkpoint-N`` to continue a run, lambda included.
"""

from __future__ import annotations

import argparse
import random

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from laconic_nemo.integrations.trl import Laconic

TINY_CHARS = list("0123456789+=abcdxyzQ: ")


def sum_is_correct(prompts, completions, answer, **kwargs):
    """Task reward r: 1.0 when the completion starts with the prompt's answer (the dataset column ``answer``)."""
    return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]


def sums_dataset(n: int = 64, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})


def tiny_tokenizer():
    """A character tokenizer built here (no download): one token per character, <pad>, <eos>, <unk>."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(TINY_CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_model(tokenizer, seed: int = 0):
    """A random 2-layer Qwen2 (hidden 32) over ``tokenizer``; EOS made likely so that lengths vary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight[tokenizer.eos_token_id].mul_(4.0)
    return model


def main(argv: list[str] | None = None) -> tuple[GRPOTrainer, Laconic]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    p.add_argument("--tiny", action="store_true", help="a tiny random model and tokenizer built here, on CPU")
    p.add_argument("--budget", type=float, default=64, help="B, tokens")
    p.add_argument("--eta", type=float, default=0.01, help="dual step size")
    p.add_argument("--max-completion-length", type=int, default=256, help="L_max")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--output-dir", default="outputs/trl_grpo_laconic")
    p.add_argument("--resume-from-checkpoint", default=None)
    a = p.parse_args(argv)
    if a.tiny:
        tokenizer = tiny_tokenizer()
        model, processing_class = tiny_model(tokenizer), tokenizer
        a.budget, a.max_completion_length = min(a.budget, 5), 8
    else:
        model, processing_class = a.model, None

    laconic = Laconic(budget=a.budget, eta=a.eta, max_length=a.max_completion_length)   # LACONIC
    args = GRPOConfig(output_dir=a.output_dir, max_steps=a.max_steps, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=a.max_completion_length, logging_steps=1,
                      save_steps=50, report_to="none", use_cpu=a.tiny or not torch.cuda.is_available())
    trainer = GRPOTrainer(
        model=model, args=args, processing_class=processing_class, train_dataset=sums_dataset(),
        reward_funcs=[laconic.reward(sum_is_correct)],                                    # LACONIC
        callbacks=[laconic.callback],                                                     # LACONIC
    )
    trainer.train(resume_from_checkpoint=a.resume_from_checkpoint)
    print(f"lambda after {trainer.state.global_step} steps: {laconic.state.lam:.6g}")
    return trainer, laconic


if __name__ == "__main__":
    main()
