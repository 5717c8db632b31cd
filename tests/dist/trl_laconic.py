"""The real TRL ``GRPOTrainer`` with the LACONIC plug-in, on CPU, one process of ``torchrun --nproc_per_node 2``
(two processes over gloo; tests/test_integrations_trl.py starts it once and checks what it writes).

A tiny Qwen2 (2 layers, hidden 32) and a character tokenizer are built (examples/integrations/trl_grpo_laconic.py),
nothing is downloaded. Two runs:

- run ``full``: ``max_steps`` optimiser steps, a checkpoint every 2 steps;
- run ``resumed``: a new trainer and a new plug-in in a new output folder, ``resume_from_checkpoint`` = the
  full run's ``checkpoint-2``, to the same ``max_steps``;
- the documented example (examples/integrations/trl_grpo_laconic.py ``--tiny``) for 2 steps.

The task reward records, per call, the completion lengths this process scored (``<out>/<run>.lengths.rank<r>.jsonl``),
so that the test can rebuild the global batch of every step from both processes' files without the plug-in. Each
process writes ``<out>/<run>.rank<r>.json``: its plug-in history and final state and the Trainer's log history.

    torchrun --nproc_per_node 2 tests/dist/trl_laconic.py OUT_DIR [--max-steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from laconic_nemo.integrations.trl import Laconic

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "integrations"))
import trl_grpo_laconic  # noqa: E402  (the documented example; its tiny model and tokenizer, one copy)
from trl_grpo_laconic import tiny_model, tiny_tokenizer  # noqa: E402

BUDGET, ETA, CEILING, L_MAX = 5, 0.05, 1.0, 8


def run(name: str, out: Path, max_steps: int, resume: str | None) -> None:
    rank = int(os.environ.get("RANK", "0"))
    tokenizer = tiny_tokenizer()
    lengths_file = out / f"{name}.lengths.rank{rank}.jsonl"
    lengths_file.unlink(missing_ok=True)

    def has_a(prompts, completions, completion_ids, trainer_state=None, **kwargs):
        """The task reward: 1 when the completion contains an 'a'. Also records what this process scored."""
        with lengths_file.open("a") as f:
            f.write(json.dumps({"global_step": trainer_state.global_step,
                                "lengths": [len(ids) for ids in completion_ids]}) + "\n")
        return [1.0 if "a" in c else 0.0 for c in completions]

    laconic = Laconic(budget=BUDGET, eta=ETA, max_length=L_MAX, ceiling=CEILING)
    args = GRPOConfig(
        output_dir=str(out / name), use_cpu=True, report_to="none", seed=3, data_seed=3,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=L_MAX, temperature=1.0,
        learning_rate=5e-2, beta=0.0, max_steps=max_steps, logging_steps=1, save_strategy="steps", save_steps=2,
        disable_tqdm=True, dataloader_num_workers=0, bf16=False, fp16=False,
    )
    prompts = [f"Q:{a}{b}" for a in "abcd" for b in "xyz"]
    trainer = GRPOTrainer(model=tiny_model(tokenizer), args=args, processing_class=tokenizer,
                          reward_funcs=[laconic.reward(has_a)], callbacks=[laconic.callback],
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train(resume_from_checkpoint=resume)
    (out / f"{name}.rank{rank}.json").write_text(json.dumps({
        "history": laconic.history, "state": laconic.state.state_dict(),
        "log_history": trainer.state.log_history, "global_step": trainer.state.global_step,
    }))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--max-steps", type=int, default=4)
    a = parser.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    run("full", out, a.max_steps, None)
    run("resumed", out, a.max_steps, str(out / "full" / "checkpoint-2"))
    # the documented example, as a user runs it (--tiny), in these same two processes
    trainer, laconic = trl_grpo_laconic.main(["--tiny", "--max-steps", "2", "--output-dir", str(out / "example")])
    rank = int(os.environ.get("RANK", "0"))
    (out / f"example.rank{rank}.json").write_text(json.dumps({
        "global_step": trainer.state.global_step, "history": laconic.history,
        "logged_lambda": [e["laconic/lambda"] for e in trainer.state.log_history if "laconic/lambda" in e]}))
    # leave the process group before the interpreter exits: a gloo group torn down at exit can abort a rank
    # ("terminate called without an active exception", status -6) after all its work is written
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
