"""A paper-shape GRPO + LACONIC step through the real trainer on one device, phase by phase.

    python benchmarks/paper_step.py --device cuda    # recipes/gpu_check_1.5b.yaml: DeepSeek-R1-Distill-Qwen-1.5B's
                                                     # shape, random weights, one rank of the flagship (3 steps)
    python benchmarks/paper_step.py --device cpu     # the same recipe at a tiny shape in fp32 (CI keeps it alive)

Runs ``laconic-nemo train`` (the command's entry point, in this process, one rank) on the recipe for ``--steps``
steps: 48 responses (8 prompts x G 6) up to L_max 4,096 tokens on the decode engine, old and reference (KL)
log-probs, 4 optimiser steps of 12 responses on packed micro-batches, the dual step, the checkpoint at the end.
Prints, per phase (rollout = generation + reward; old and reference log-probs; each optimiser step; dual step;
checkpoint), the steady-state seconds (mean of the steps after the first) and the first step's extra seconds
(graph captures, allocations, any compilation: step 1 minus the steady value), then training MFU (model FLOPs of
the optimiser steps, ``gpu_common.train_flops``, over their seconds, against the H100's 989 TFLOP/s data-sheet bf16
peak and a bf16 matmul measured in the run), peak device memory, the packed-attention kernel, and the projected
wall time of the paper's 500-step run on 16 GPUs (each GPU doing this rank's step; the checkpoint at the
flagship's ``checkpoint.every_n_steps``; not measured: the DP gradient all-reduce over 16 GPUs, grading real
math answers). The phases come from the trainer's ``time/<phase>`` metrics (what metrics.jsonl receives); the
checkpoint at the end and the optimiser steps' rows are recorded by wrapping the trainer's and the actor's methods.
The phase table, MFU and peak memory are printed right after the last step, before the final checkpoint (about
25 GB of weights and Adam state at this shape), so a time cap that cuts the checkpoint still leaves them.

Random weights rarely draw EOS out of 151,936 ids, so responses run to L_max: an upper bound on a step's work
(the paper's starting lengths average ~3,000 of 4,096). On CPU: a tiny Qwen2 shape (``gpu_common.SHAPES``), 24
new tokens, packs of 128 tokens, fp32 over gloo, the sdpa core attention (its CPU packed kernel: dense).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_common import (  # noqa: E402
    H100_BF16_PEAK,
    PAPER_GPUS,
    PAPER_OPT_STEPS,
    PAPER_STEPS,
    SHAPES,
    hf_config,
    matmul_tflops,
    sync,
    train_flops,
)

from laconic_nemo.config import load_config  # noqa: E402

RECIPE = ROOT / "recipes" / "gpu_check_1.5b.yaml"
FLAGSHIP = ROOT / "recipes" / "deepseek_1.5b_b1500.yaml"  # its checkpoint frequency enters the projection
TARGET_STEP_S, TARGET_HOURS = 30.0, 4.2  # one H100, steady state; 500 steps on 16 GPUs


def cpu_overrides(out: Path) -> list[str]:
    """The recipe at a tiny shape on CPU: the tiny untied Qwen2 of gpu_common, fp32, gloo, short responses."""
    from laconic_nemo.bridge import ModelArch

    shape = out / "tiny_shape"
    shape.mkdir(parents=True, exist_ok=True)
    (shape / "config.json").write_text(json.dumps(hf_config(ModelArch(**SHAPES["tiny-untied"]))))
    return [f"model.shape_from={shape}", "model.precision=fp32", "parallel.backend=gloo",
            "rollout.max_new_tokens=24", "laconic.budget=12", "rollout.kv_block=16", "rollout.batch_buckets=[8,16,32,64]",
            "grpo.micro_batch_tokens=128", "model.attention=sdpa"]


class Recorder:
    """What the run's metrics do not hold, recorded by wrapping the trainer's and the actor's methods: the rows of
    every optimiser step (for their FLOPs), the checkpoint's seconds (the one at the end is in no metrics row), the
    packed kernel used; a line per finished step as it comes, and the summary right after the last step (before
    the final checkpoint, which a device check's time cap may cut)."""

    def __init__(self, device: torch.device, num_steps: int, summary):
        self.device, self.num_steps, self.summary = device, num_steps, summary
        self.rows: list[dict] = []  # the trainer's metrics of every step (what metrics.jsonl receives)
        self.opt_lengths: list[list[int]] = []  # per optimiser step: tokens the model read per row
        self.checkpoints: list[float] = []
        self.kernels: set[str] = set()

    def install(self) -> None:
        from laconic_nemo.actors.megatron_core import MegatronCoreActor
        from laconic_nemo.grpo.trainer import GRPOTrainer
        from laconic_nemo.runtime import kernels

        rec = self
        train_step, save, step, packed = (MegatronCoreActor.train_step, GRPOTrainer.save_checkpoint,
                                          GRPOTrainer.train_step, kernels.packed_attention)

        def actor_train_step(actor, batch, *a, **kw):
            ends = (batch.prompt_lengths + batch.response_lengths).clamp(max=batch.tokens.shape[1])
            rec.opt_lengths.append([int(x) for x in ends])
            return train_step(actor, batch, *a, **kw)

        def save_checkpoint(trainer, *a, **kw):
            sync(rec.device)
            t = time.perf_counter()
            out = save(trainer, *a, **kw)
            rec.checkpoints.append(time.perf_counter() - t)
            print(f"| checkpoint (at the end of the run) | {rec.checkpoints[-1]:.2f} | - |", flush=True)
            return out

        def trainer_step(trainer, k):
            m = step(trainer, k)
            rec.rows.append(m)
            print(f"  step {k + 1}: {m['step_seconds']:.1f} s (rollout {m['time/generate'] + m['time/reward']:.1f}, "
                  f"log-probs {m['time/logprobs']:.1f}, optimiser steps {m['time/policy_update']:.1f}), "
                  f"mean length {m['mean_response_length']:.0f}", flush=True)
            if len(rec.rows) == rec.num_steps:
                rec.summary(rec)
            return m

        def packed_attention(query, key, value, params, scale, kernel="auto", dropout=0.0):
            rec.kernels.add(kernels.resolve_packed_kernel(kernel, query.device, query.dtype))
            return packed(query, key, value, params, scale, kernel, dropout)

        MegatronCoreActor.train_step = actor_train_step
        GRPOTrainer.save_checkpoint = save_checkpoint
        GRPOTrainer.train_step = trainer_step
        kernels.packed_attention = packed_attention


def phase_rows(rows: list[dict], opt_steps: int) -> list[tuple[str, list[float]]]:
    """(phase, seconds per step) from the metrics rows: rollout, log-probs, each optimiser step, dual step, rest."""
    def col(*keys):
        return [sum(float(r.get(k, 0.0)) for k in keys) for r in rows]

    out = [("rollout (generation + reward)", col("time/generate", "time/reward")),
           ("old log-probs", col("time/logprobs/old")),
           ("reference log-probs", col("time/logprobs/reference"))]
    out += [(f"optimiser step {k}", col(f"time/policy_update/{k}")) for k in range(1, opt_steps + 1)]
    out.append(("dual step", col("time/dual_step")))
    named = ("time/generate", "time/reward", "time/logprobs", "time/policy_update", "time/dual_step")
    out.append(("other (shaping, advantages, metrics)",
                [float(r["step_seconds"]) - sum(float(r.get(k, 0.0)) for k in named) for r in rows]))
    return out


class Summary:
    """The printout of a finished run: the phase table after the last step, the rest once the checkpoint is out."""

    def __init__(self, cfg, arch, device: torch.device):
        self.cfg, self.arch, self.device = cfg, arch, device
        g = cfg.grpo
        self.opt_steps = g.num_prompts_per_step * g.group_size // g.minibatch_size
        self.step_s = float("nan")

    def __call__(self, rec: Recorder) -> None:
        """After the last step: the phases (steady s/step, first step's extra), MFU, peak memory so far."""
        rows, k = rec.rows, self.opt_steps
        print(f"\npacked kernel used: {', '.join(sorted(rec.kernels)) or 'none'}")
        print("\n| phase | steady s/step | first step's extra s |\n| --- | ---: | ---: |")
        for label, values in phase_rows(rows, k):
            s = statistics.mean(values[1:])
            print(f"| {label} | {s:.2f} | {values[0] - s:+.2f} |")
        self.step_s = statistics.mean(float(r["step_seconds"]) for r in rows[1:])
        print(f"| step (checkpoint excluded) | {self.step_s:.2f} | {float(rows[0]['step_seconds']) - self.step_s:+.2f} |")
        # training MFU over the steady steps' optimiser steps (each call's rows: prompt + response tokens)
        steady = rec.opt_lengths[k:k * len(rows)]
        flops = sum(train_flops(self.arch, lengths) for lengths in steady)
        seconds = sum(float(r.get(f"time/policy_update/{j}", 0.0)) for r in rows[1:] for j in range(1, k + 1))
        measured = matmul_tflops(self.device)
        mfu = f"MFU {100 * flops / seconds / H100_BF16_PEAK:.1f}% of {H100_BF16_PEAK / 1e12:.0f} TFLOP/s (H100 data sheet)"
        if measured:
            mfu += f", {100 * flops / seconds / (measured * 1e12):.1f}% of a bf16 matmul measured here ({measured:.0f})"
        tokens = sum(sum(lengths) for lengths in steady)
        print(f"\ntraining: {tokens / seconds:,.0f} tokens/s over the optimiser steps; {mfu}")
        peak = (f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated (torch.cuda.max_memory_allocated)"
                if self.device.type == "cuda" else "n/a (CPU)")
        print(f"peak memory: {peak}\n", flush=True)

    def projection(self, rec: Recorder) -> str:
        """The 500-step run on 16 GPUs from the steady step and the checkpoint at the flagship's frequency."""
        cfg = self.cfg
        ckpt = rec.checkpoints[-1] if rec.checkpoints else float("nan")
        every = load_config(FLAGSHIP).checkpoint.every_n_steps
        n_ckpt = PAPER_STEPS // every if every else 1
        hours = (PAPER_STEPS * self.step_s + n_ckpt * ckpt) / 3600
        target = (f" (target <= {TARGET_STEP_S:.0f} s/step on one H100, <= {TARGET_HOURS} h)"
                  if self.device.type == "cuda" else "")
        mean_length = statistics.mean(float(r["mean_response_length"]) for r in rec.rows)
        rows = cfg.grpo.num_prompts_per_step * cfg.grpo.group_size
        return (f"projection: {PAPER_STEPS} steps on {PAPER_GPUS} GPUs (DP {PAPER_GPUS}, {rows} responses per GPU, "
                f"{PAPER_OPT_STEPS} optimiser steps) = {PAPER_STEPS} x {self.step_s:.1f} s + {n_ckpt} checkpoints x "
                f"{ckpt:.1f} s = {hours:.2f} h{target}; mean response length {mean_length:.0f} of L_max "
                f"{cfg.rollout.max_new_tokens}; not measured: the DP all-reduce, grading real math answers")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--recipe", default=str(RECIPE))
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps (>= 2: the first, then steady ones)")
    ap.add_argument("--output-dir", default=None, help="run.output_dir (default: a fresh temporary folder)")
    ap.add_argument("overrides", nargs="*", help="more recipe overrides key=value")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step, then steady ones)")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("paper_step: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if device.type == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="paper_step_"))
    overrides = (cpu_overrides(out) if device.type == "cpu" else []) + [
        f"run.num_steps={args.steps}", f"run.output_dir={out / 'run'}", *args.overrides]

    from laconic_nemo.app.train_cli import main as train_main
    from laconic_nemo.bridge import arch_from_hf_config
    from laconic_nemo.plan.layout import packed_kernel_line

    cfg = load_config(args.recipe, overrides)
    arch = arch_from_hf_config(str(cfg.model.shape_from))
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    print(f"# paper_step: device {name} | torch {torch.__version__} | {args.recipe} | {arch.num_layers} layers x "
          f"{arch.hidden_size}, vocab {arch.vocab_size} | {cfg.model.precision}")
    print(f"# {cfg.grpo.num_prompts_per_step} prompts x G {cfg.grpo.group_size}, L_max {cfg.rollout.max_new_tokens}, "
          f"minibatch {cfg.grpo.minibatch_size}, packs of <= {cfg.grpo.micro_batch_tokens} tokens, kl_beta "
          f"{cfg.grpo.kl_beta}, rollout engine {cfg.rollout.engine}; {args.steps} steps")
    print(f"# packed attention on a GPU here: {packed_kernel_line(cfg)}")
    print("laconic-nemo train " + " ".join([args.recipe, *overrides]), flush=True)

    summary = Summary(cfg, arch, device)
    rec = Recorder(device, args.steps, summary)
    rec.install()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    code = train_main([args.recipe, *overrides, "--nprocs", "1"])
    if code != 0:
        print(f"paper_step: laconic-nemo train exited with status {code}", file=sys.stderr)
        return code
    print(f"\n{len(rec.rows)} steps and the checkpoint in {time.perf_counter() - t0:.1f} s (model build and start-up "
          f"included)")
    print(summary.projection(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
