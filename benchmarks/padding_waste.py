"""Padding waste of the megatron-core actor on the paper's length distribution (CPU, about a minute).

    python benchmarks/padding_waste.py [--rows 128] [--group 8] [--max-new 4096] [--seed 0]

Response lengths: a rollout of ``rows`` responses (prompts of 60-300 tokens, G per prompt) whose lengths are
log-normal around a median of 1500 tokens, clipped to [150, L_max], with responses that reach L_max
truncated there - the shape of a DeepSeek-R1-Distill-1.5B rollout at L_max = 4096 early in training (about
a tenth truncated; inferred, the paper gives only means). Both phases are measured by running the real code
paths on a stand-in model whose next token is EOS exactly at each row's length:

* rollout: positions fed to the model by ``sample_on_device`` per rollout, without row compaction (every row
  runs to the longest) and with it (``rollout.compact``, checked every ``sync_every`` steps); useful = each
  row's prompt + response but its last token (which is sampled, never fed);
* training: positions of the micro-batches the actor builds (``MicroBatches.micro_batches``) for a
  minibatch, fixed width ``[mbs, T]`` vs length-sorted micro-batches cut to their longest row
  (``grpo.sort_by_length``), and the packed micro-batches (``grpo.micro_batch_tokens``, the default: rows
  concatenated without padding; with pipeline parallelism each pack's tail is padded to the longest pack);
  useful = each row's prompt + response.

Waste = 1 - useful / processed. Target: under 15% in both phases.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from laconic_nemo.actors.megatron_batches import MicroBatches  # noqa: E402
from laconic_nemo.actors.packing import build_packs  # noqa: E402
from laconic_nemo.grpo.interfaces import SamplingParams, TrainBatch  # noqa: E402
from laconic_nemo.rollout.megatron_sampler import sample_on_device  # noqa: E402

EOS = 0


def draw_lengths(n: int, group: int, max_new: int, seed: int, median: float) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(60, 301, (n // group,), generator=g).repeat_interleave(group)
    resp = torch.exp(torch.randn(n, generator=g) * 0.7 + torch.log(torch.tensor(float(median))))
    resp = resp.clamp(min(150, max_new // 4), max_new).round().long()
    return prompts.tolist(), resp.tolist()


class EndsAt:
    """Stand-in model: logits [b, 2] that put the next token at EOS exactly when the row reaches its end
    (prompt + response length) and at token 1 before; counts the positions it is fed."""

    def __init__(self, ends: torch.Tensor):
        self.ends, self.fed = ends, 0

    def step(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        self.fed += tokens.numel()
        eos_now = (start + tokens.shape[1]) >= self.ends
        logits = torch.zeros(tokens.shape[0], 2)
        logits[:, EOS] = torch.where(eos_now, 1e4, -1e4)
        return logits

    def keep(self, idx: torch.Tensor) -> None:
        self.ends = self.ends[idx]


def rollout_work(prompt_lens, resp_lens, max_new, compact: bool, sync_every: int, rows_per_batch: int):
    """Positions fed to the model (summed over rollout batches of ``rows_per_batch`` rows) and useful ones."""
    fed = 0
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new, eos_id=EOS, seed=0)
    for a in range(0, len(prompt_lens), rows_per_batch):
        P, R = prompt_lens[a : a + rows_per_batch], resp_lens[a : a + rows_per_batch]
        model = EndsAt(torch.tensor([p + r for p, r in zip(P, R)]))
        out = sample_on_device(model.step, lambda x, b: x, [[1] * p for p in P], sp,
                               compact=model.keep if compact else None, sync_every=sync_every)
        assert out.response_lengths.tolist() == [min(r + 1, max_new) for r in R]  # r tokens, then EOS
        fed += model.fed
    # every position but the last generated token has to be fed once
    useful = sum(p + min(r + 1, max_new) - 1 for p, r in zip(prompt_lens, resp_lens))
    return fed, useful


def training_work(prompt_lens, resp_lens, mbs: int, minibatch: int, sort: bool, pack_tokens: int = 0,
                  pp: int = 1):
    """Positions processed and useful over the minibatches: padded micro-batches of ``mbs`` rows, or packs of
    ``pack_tokens`` (``pp`` > 1: tails padded to one size per minibatch)."""
    processed = useful = 0
    batches = MicroBatches(mbs, 0, sort, 1, None, torch.device("cpu"))
    for a in range(0, len(prompt_lens), minibatch):
        P = torch.tensor(prompt_lens[a : a + minibatch])
        R = torch.tensor(resp_lens[a : a + minibatch])
        T = int((P + R).max())
        n = len(P)
        batch = TrainBatch(torch.zeros(n, T, dtype=torch.long), P, R, torch.zeros(n, T - 1))
        if pack_tokens:
            processed += sum(p.size for p in build_packs(batch, pack_tokens, pad_to_longest=pp > 1))
        else:
            micro, _ = batches.micro_batches(batch, mbs)
            processed += sum(mb.tokens.numel() for mb in micro)
        useful += int((P + R).sum())
    return processed, useful


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128, help="responses (a rollout of rows / group prompts)")
    ap.add_argument("--group", type=int, default=8, help="G")
    ap.add_argument("--max-new", type=int, default=4096, help="L_max")
    ap.add_argument("--rollout-batch", type=int, default=64, help="rows per generate call")
    ap.add_argument("--sync-every", type=int, default=8, help="rollout.sync_every")
    ap.add_argument("--micro-batch", type=int, default=4, help="grpo.micro_batch_size")
    ap.add_argument("--minibatch", type=int, default=64, help="rows per optimiser step on one DP rank")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="grpo.micro_batch_tokens")
    ap.add_argument("--median", type=float, default=1500.0, help="median response length (tokens)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    prompts, resp = draw_lengths(args.rows, args.group, args.max_new, args.seed, args.median)
    trunc = sum(r >= args.max_new for r in resp) / len(resp)
    print(f"# {args.rows} responses: mean {sum(resp) / len(resp):.0f} tokens, min {min(resp)}, max {max(resp)}, "
          f"{100 * trunc:.0f}% at L_max = {args.max_new}; prompts 60-300 tokens")
    rows = []
    t = time.perf_counter()
    for compact in (False, True):
        fed, useful = rollout_work(prompts, resp, args.max_new, compact, args.sync_every, args.rollout_batch)
        layout = f"compacted every {args.sync_every} steps" if compact else "all rows to the end"
        rows.append(("rollout", layout, fed, useful))
    for sort in (False, True):
        processed, useful = training_work(prompts, resp, args.micro_batch, args.minibatch, sort)
        rows.append(("training", "length-sorted, cut micro-batches" if sort else "fixed-width micro-batches",
                     processed, useful))
    for pp in (1, 2):
        processed, useful = training_work(prompts, resp, args.micro_batch, args.minibatch, True,
                                          args.micro_batch_tokens, pp)
        how = "PP 1" if pp == 1 else "PP > 1: tails padded to the longest pack"
        rows.append(("training", f"packed micro-batches of <= {args.micro_batch_tokens} tokens ({how})", processed,
                     useful))
    print("| phase | layout | positions processed | useful | waste |")
    print("| --- | --- | --- | --- | --- |")
    for phase, layout, processed, useful in rows:
        print(f"| {phase} | {layout} | {processed:,} | {useful:,} | {100 * (1 - useful / processed):.1f}% |")
    for phase in ("rollout", "training"):
        before, after = [r for r in rows if r[0] == phase][:2]
        print(f"# {phase}: {before[2] / after[2]:.2f}x fewer positions processed")
    print(f"# {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
