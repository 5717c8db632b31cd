"""What a run trains on: the prompts, the tokenizer's encode / decode, the task reward and the special ids.

:func:`build_task` builds it for ``laconic-nemo train`` (megatron-core actor); the NeMo-Aligner entry point
builds it from the ``.nemo``'s tokenizer (:mod:`laconic_nemo.app.nemo_entry`). Both hand it to
:func:`laconic_nemo.app.run.run`.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from laconic_nemo.config import Config, ConfigError, LayoutError, state_target
from laconic_nemo.grpo.trainer import RewardFn


@dataclass
class Task:
    """A dataset with its tokenizer and reward.

    prompts: the dataset, a list of (prompt text, reference answer).
    encode: text -> token ids (no special tokens added).
    decode: token ids -> text (special tokens dropped).
    reward_fn: (responses, reference answers) -> (scores in [0, 1], metrics); see
        :data:`laconic_nemo.grpo.trainer.RewardFn`.
    eos_id: the token that ends a response.
    pad_id: fills the rows of a batch after their end.
    vocab_size: the tokenizer's vocabulary when the model is built from the recipe (synthetic GPT), else None
        (an HF or .nemo checkpoint states its own).
    warmup_example: Random -> (prompt ids, response ids with EOS) for the supervised warm-up, or None when
        the task has no worked solutions.
    stop_ids: the ids that end a response besides EOS (the chat template's end-of-turn token:
        :func:`laconic_nemo.bridge.end_tokens.end_token_ids`), handed to the rollout engine.
    budgets: each prompt's budget B_i read from its data row's field ``data.budget_key`` (the synthetic rows';
        None: the trainer reads the data files, or the run has no per-prompt budgets from data).
    """

    prompts: list[tuple[str, Any]]
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    reward_fn: RewardFn
    eos_id: int
    pad_id: int
    vocab_size: int | None = None
    warmup_example: Callable[[random.Random], tuple[list[int], list[int]]] | None = None
    stop_ids: tuple[int, ...] = ()
    budgets: list[float] | None = None


def build_task(cfg: Config) -> Task:
    """The recipe's task for the megatron-core actor: the synthetic task with its character tokenizer
    (``data.kind = synthetic``), or the math prompts with the checkpoint's HF tokenizer (``data.kind = math``,
    ``model.source = hf``; a prompt that leaves no room for ``rollout.max_new_tokens`` is a ConfigError)."""
    if cfg.data.kind == "synthetic":
        from laconic_nemo.data.datasets import row_budgets
        from laconic_nemo.data.synthetic import CharTokenizer, SyntheticTask
        from laconic_nemo.rewards import exact_answer_status

        tok = CharTokenizer()
        task = SyntheticTask(**dataclasses.asdict(cfg.data.synthetic))
        key = cfg.data.budget_key
        rows = task.rows(cfg.data.num_prompts, seed=cfg.run.seed, budget_key=key)
        prompts = [(r["problem"], r["answer"]) for r in rows]
        budgets = None
        if key is not None:
            budgets = row_budgets(rows, key, cfg.data.budget_missing, cfg.laconic.budget, cfg.rollout.max_new_tokens)
        instruction = cfg.data.target_instruction

        def reward_fn(texts, answers):
            statuses = [exact_answer_status(t, a) for t, a in zip(texts, answers)]
            scores = [1.0 if s == "correct" else 0.0 for s in statuses]
            no_answer = statuses.count("no_answer")
            return scores, {"accuracy": sum(scores) / len(scores), "no_answer": no_answer / len(scores)}

        def warmup_example(rng: random.Random):  # a stated budget in the RL prompts' words (data.target_instruction)
            prompt, response = task.warmup_example(rng, state=lambda b: state_target(instruction, b))
            return tok.encode(prompt), tok.encode(response) + [tok.eos_id]

        return Task(prompts=prompts, encode=tok.encode, decode=tok.decode, reward_fn=reward_fn, eos_id=tok.eos_id,
                    pad_id=tok.pad_id, vocab_size=tok.vocab_size, warmup_example=warmup_example, budgets=budgets)

    from laconic_nemo.data.datasets import load_math_prompts
    from laconic_nemo.rewards.format import build_reward_fn

    if cfg.model.source != "hf":
        raise ConfigError("data.kind = math with the megatron-core actor needs model.source = hf (a tokenizer)")
    from laconic_nemo.bridge.end_tokens import end_token_ids, hf_text_to_ids
    from laconic_nemo.bridge.hf_folder import HFConfigError, hf_config, load_hf_tokenizer

    tok = load_hf_tokenizer(cfg.model.path)
    items = load_math_prompts(list(cfg.data.train_files), cfg.data.prompt_template)
    from laconic_nemo.data.datasets import check_prompt_lengths

    try:
        hf = hf_config(str(cfg.model.path)) or {}
    except HFConfigError as exc:
        raise LayoutError(str(exc)) from None
    context = int(hf.get("max_position_embeddings", cfg.model.max_position_embeddings))
    try:  # the pre-flight checked this already (laconic_nemo.plan.preflight); under torchrun / srun too
        check_prompt_lengths(items, lambda t: len(tok.encode(t, add_special_tokens=False)), context,
                             cfg.rollout.max_new_tokens)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    reward_fn, _grader = build_reward_fn(cfg.reward)

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    return Task(prompts=[(i.prompt, i.answer) for i in items], encode=encode, decode=decode, reward_fn=reward_fn,
                eos_id=tok.eos_token_id, pad_id=tok.pad_token_id or tok.eos_token_id,
                stop_ids=tuple(end_token_ids(hf_text_to_ids(tok), tok.eos_token_id)))
