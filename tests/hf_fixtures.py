"""Tiny Hugging Face checkpoints built locally (no download): a character-level tokenizer and a random model."""

from __future__ import annotations

import string
from pathlib import Path

import torch

CHAT = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"


def char_tokenizer():
    """A character-level fast tokenizer over printable ASCII with <pad>, <eos>, <unk> and a chat template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models

    specials = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + [c for c in string.printable if c not in "\x0b\x0c"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")
    fast.chat_template = CHAT
    return fast


def save_tiny_qwen2(path: str | Path, hidden: int = 32, layers: int = 1, seed: int = 0, kv_heads: int = 1,
                    tie: bool = False) -> str:
    """A random Qwen2ForCausalLM (2 query heads, ``kv_heads`` key/value heads) + the char tokenizer saved
    at ``path``; returns the path. Tensor parallelism over T ranks needs ``kv_heads`` divisible by T;
    ``tie``: the LM head shares the embedding matrix."""
    import transformers

    tok = char_tokenizer()
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                                   num_key_value_heads=kv_heads, intermediate_size=2 * hidden, vocab_size=len(tok),
                                   max_position_embeddings=4096, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id, tie_word_embeddings=tie)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


# Chat special tokens of the two tokenizer families the recipes use (a subset).
DEEPSEEK_R1_DISTILL_SPECIALS = ["<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
QWEN25_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_bpe_tokenizer_json_only(path: str | Path, specials: list[str], eos: str) -> str:
    """A byte-level BPE tokenizer (the Qwen2 / DeepSeek-R1-Distill family), trained here on a few lines,
    saved as ``tokenizer.json`` + ``tokenizer_config.json`` only (no ``vocab.json`` / ``merges.txt``), the way
    the DeepSeek-R1-Distill repositories ship it. ``specials`` become single special tokens; ``eos`` is one
    of them. Returns the folder."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The answer is \\boxed{42}. Let me think step by step about the problem.",
              "Solve for x: 2x + 3 = 7, so x = 2. Therefore the final answer is 2."] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    tok.save(str(p / "tokenizer.json"))
    (p / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "eos_token": eos, "bos_token": None, "pad_token": eos,
        "model_max_length": 16384, "add_bos_token": False, "add_eos_token": False}))
    return str(p)
