"""One-GPU benchmark of the megatron-core actor: rollout and training throughput at the paper's shapes.

    python benchmarks/gpu_step.py --device cuda                 # Qwen2.5-1.5B shapes, bf16 (about 10 minutes)
    python benchmarks/gpu_step.py --device cuda --profile       # + kernels per decode step beside a plain step
    python benchmarks/gpu_step.py --device cuda --shape small   # a 0.1B model with the same layout
    python benchmarks/gpu_step.py --device cpu                  # tiny shapes, fp32: keeps the script alive in CI

Builds a random-weight model from a config written here (no download) through the bridge, once as a
megatron-core GPTModel (the actor) and once as the Hugging Face model with the same weights, and prints:

1. rollout tokens/s on the same weights and batch (64 prompts of 200 tokens, 1024 new tokens, temperature 1,
   EOS = the last vocabulary id, rarely hit by random weights): Hugging Face ``generate``; today's megatron
   loop before the decode engine (``megatron_sampler.sample_on_device`` over megatron's ``InferenceParams``
   cache, tests/dist/reference_loop.py; and the host float64 loop for a few tokens); the decode engine
   (``laconic_nemo/rollout/engine.py``, device sampler, CUDA graphs, compaction on) at 64 and 256 rows. Each as
   tok/s, the ratio to ``generate`` and the share of the bandwidth bound computed in the run (every decode step
   reads the weights once plus each row's cached keys / values: rows x bandwidth / (weight bytes + rows x mean
   cached tokens x KV bytes per token); bandwidth: the H100 data sheet's 3.35 TB/s on an H100, else a
   device-to-device copy measured in the run);
2. the log-prob mismatch: the largest |log p| difference between the engine's forward (the sampled tokens'
   log-probs it returns) and the training forward (``actor.logprobs``) on the same rollout;
3. a DeepSeek-shaped rollout (DeepSeek-R1-Distill-Qwen-1.5B: Qwen2 1.5B, untied output): 48 rows per GPU as in
   the flagship layout (768 responses over DP 16), up to 4,096 new tokens, response lengths geometric with mean
   ~3,000 capped at 4,096 (inferred from the paper's start-of-training lengths): the output layer is zeroed so
   the engine's draws are uniform over its first ``1/h`` token ids (``vocab_size`` of the engine), which ends a
   row on EOS (id 0) with probability h per token; the output matmul still runs over the whole vocabulary;
4. the projected wall time of the paper's 500-step run on 16 H100 (2 x 8, DP 16): per step one rank's rollout
   (3.) + old and reference log-probs of its 48 responses + 4 optimiser steps of 12 responses (packed, the
   default),
   each measured here on that rollout's tokens; not measured (listed in the output): the DP gradient all-reduce,
   reward grading, checkpoints;
5. one GRPO optimiser step at the paper's shapes (prompts ~200 tokens, responses of 300-4096 tokens):
   tokens/s, MFU against the device's bf16 peak (the data-sheet value, and a bf16 matmul measured in the same
   run), peak memory, and the share of processed tokens that are padding, for the packed micro-batches (the
   default, ``grpo.micro_batch_tokens``: rows concatenated, document-causal attention) beside today's padded
   micro-batches of ``--micro-batch`` rows, length-sorted (``grpo.sort_by_length``) and not; attention sdpa vs
   megatron's local one. Every training row also prints the activation memory per micro-batch that
   ``laconic_nemo.actors.memory`` predicts, the recompute setting it picks for the device, and its predicted
   peak for the setting used (on CPU: for an H100 80 GB).
6. the chunked log-prob backward of both actors: seconds and peak memory before (per-chunk slices of the logits)
   and after (one gradient buffer), and that their gradients are identical (``benchmarks/logprob_backward.py``).

``--profile``: at each engine row count, the kernels per decode step (CUDA: ``torch.profiler``, prefill excluded;
CPU: operators counted at the dispatcher, ``laconic_nemo/rollout/opcount.py``) of the engine's fused step, of the
engine through the model's modules (``EngineSettings.fused = False``) and of the plain graphed decode step of
``benchmarks/plain_decode.py`` at the same shape, rows and mean KV length, measured in the same process; then a
ratio row (kernels, and speed: the plain step's ms per step over the engine's). The engine rows print the first
rollout's graph captures and their seconds. The ``deepseek`` section also prints the window schedule of the
paper's 48-row draw for three bucket lists (``schedule`` rows: graphs, compactions, KV positions read) and, on its
rollout, what reading each row's own KV length (``varlen_attn``'s ``seqused_k``) would save.
Out-of-memory in one configuration is reported in its row and the script goes on.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from gpu_common import (
    H100_BF16_PEAK,
    H100_HBM_TBS,
    PAPER_ROWS_PER_GPU,
    SHAPES,
    build_actor,
    copy_bandwidth_tbs,
    free,
    hf_config,
    matmul_tflops,
    params_count,
    recompute_label,
    recompute_setting,
    size,
    train_flops,
)
from gpu_rollout import deepseek_section, engine_section, schedule_rows, time_hf_generate, time_rollout
from gpu_train import (
    micro_batch_memory,
    packed_padding_share,
    padding_share,
    reference_placements,
    time_train,
    train_batch,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: qwen2.5-1.5b on cuda, tiny on cpu")
    ap.add_argument("--prompts", type=int, default=None, help="rollout batch (default 64; 8 on cpu)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 200; 16 on cpu)")
    ap.add_argument("--new-tokens", type=int, default=None, help="rollout tokens per row (default 1024; 32 on cpu)")
    ap.add_argument("--exact-tokens", type=int, default=16, help="new tokens for the (slow) host float64 sampler")
    ap.add_argument("--train-rows", type=int, default=None, help="rows of the GRPO minibatch (default 16; 8 on cpu)")
    ap.add_argument("--max-response", type=int, default=None, help="longest response (default 4096; 48 on cpu)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="token budget of a packed micro-batch (grpo.micro_batch_tokens; default 16384, 128 on cpu; "
                         "0 skips the packed step)")
    ap.add_argument("--recompute-layers", default="all",
                    help="GPU: comma list of settings to train the padded micro-batches with, each a number of layers "
                         "whose activations are recomputed in backward (all = every layer; 0 = none); e.g. all,14")
    ap.add_argument("--engine-rows", default=None, help="rows of the engine rollouts (default 64,256; 8,32 on cpu)")
    ap.add_argument("--deepseek-rows", type=int, default=PAPER_ROWS_PER_GPU, help="rows of the DeepSeek-shaped "
                    "rollout (default 48: one rank of the flagship layout)")
    ap.add_argument("--deepseek-new-tokens", type=int, default=None, help="its L_max (default 4096; 64 on cpu)")
    ap.add_argument("--deepseek-mean", type=float, default=None,
                    help="its mean response length (default 3000; 0.73 x L_max elsewhere)")
    ap.add_argument("--bandwidth-tbs", type=float, default=None,
                    help="memory bandwidth of the bound (default: 3.35 on an H100, else a copy measured in the run)")
    ap.add_argument("--profile", action="store_true", help="torch.profiler summary of the engine's decode steps")
    ap.add_argument("--packed-recompute", default="auto,0",
                    help="GPU: comma list of recompute settings for the packed step (auto = chosen by the memory "
                         "model, all, or a number of layers)")
    ap.add_argument("--skip", default="",
                    help="comma list of sections to skip: rollout,hf,local,local-rollout,engine,deepseek,train,"
                         "reference,logprob")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_step: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    cpu = device.type == "cpu"
    if cpu:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    shape = args.shape or ("tiny" if cpu else "qwen2.5-1.5b")
    n_prompts = args.prompts or (8 if cpu else 64)
    prompt_len = args.prompt_len or (16 if cpu else 200)
    new_tokens = args.new_tokens or (32 if cpu else 1024)
    train_rows = args.train_rows or (8 if cpu else 16)
    max_resp = args.max_response or (48 if cpu else 4096)
    engine_rows = [int(x) for x in (args.engine_rows or ("8,32" if cpu else "64,256")).split(",")]
    ds_new = args.deepseek_new_tokens or (64 if cpu else 4096)
    ds_mean = args.deepseek_mean or (3000.0 if ds_new == 4096 else 0.73 * ds_new)
    if args.micro_batch_tokens is None:
        args.micro_batch_tokens = 128 if cpu else 16384
    skip = set(filter(None, args.skip.split(",")))
    dtype = torch.float32 if cpu else torch.bfloat16

    from laconic_nemo.bridge import ModelArch, load_hf_state_dict

    arch = ModelArch(**SHAPES[shape])
    dev_name = torch.cuda.get_device_name(0) if not cpu else "cpu"
    peak_meas = matmul_tflops(device)
    copy_tbs = copy_bandwidth_tbs(device)
    if args.bandwidth_tbs:
        tbs, tbs_src = args.bandwidth_tbs, "--bandwidth-tbs"
    elif "H100" in dev_name:
        tbs, tbs_src = H100_HBM_TBS, "H100 data sheet"
    else:
        tbs, tbs_src = copy_tbs, "measured copy"
    print(f"# gpu_step: device {dev_name} | torch {torch.__version__} | shape {shape} "
          f"({params_count(arch) / 1e9:.3f} B params) | {str(dtype).replace('torch.', '')}")
    if peak_meas:
        print(f"# bf16 8192^3 matmul measured: {peak_meas:.0f} TFLOP/s; data-sheet peak {H100_BF16_PEAK / 1e12:.0f}")
    print(f"# memory bandwidth of the bound: {1e3 * tbs:,.0f} GB/s ({tbs_src}); copy measured in this run "
          f"{1e3 * copy_tbs:,.0f} GB/s")
    from laconic_nemo.runtime.kernels import describe_packed_attention

    print(f"# packed attention (sdpa) on a GPU: {describe_packed_attention('sdpa', dtype if not cpu else None)}")

    # the Hugging Face model with random weights, its state dict feeds the megatron actor
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(Qwen2Config(**hf_config(arch)), dtype=dtype,
                                              attn_implementation="sdpa")
    hf.eval()
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(1, arch.vocab_size, (n_prompts, prompt_len), generator=g).tolist()
    eos_id = arch.vocab_size - 1  # a single id of 150k: hit with probability ~1e-5 per token; counted if hit

    rows = []  # (section, variant, measured, throughput, ratio or MFU), printed as they come and as a table

    def add(*row):
        rows.append(row)
        print("  " + " | ".join(row), flush=True)

    hf_tps = None
    if "hf" not in skip and "rollout" not in skip:
        time_hf_generate(hf, [p[:8] for p in prompts[:2]], 4, device)  # warm-up
        dt, ntok = time_hf_generate(hf, prompts, new_tokens, device)
        hf_tps = ntok / dt
        add("rollout", "HF generate (sdpa)", f"{ntok} tok in {dt:.1f} s", f"{hf_tps:,.0f} tok/s", "1.00")
    hf_sd = {k: v.detach().to("cpu", copy=True) for k, v in hf.state_dict().items()}
    hf = None
    free()

    attentions = ["sdpa"] + ([] if "local" in skip else ["local"])
    for attention in attentions:
        actor = build_actor(arch, attention, device, dtype, args)
        load_hf_state_dict(actor.model, hf_sd, arch)
        if hasattr(actor.optimizer, "reload_model_params"):
            actor.optimizer.reload_model_params()
        if "rollout" not in skip and not (attention == "local" and "local-rollout" in skip):
            time_rollout(actor, [p[:8] for p in prompts[:2]], 4, "device", eos_id, device)  # warm-up
            try:
                dt, ntok = time_rollout(actor, prompts, new_tokens, "device", eos_id, device)
                tps = ntok / dt
                ratio = f"{tps / hf_tps:.2f}" if hf_tps else "-"
                add("rollout", f"megatron device sampler, {attention}", f"{ntok} tok in {dt:.1f} s",
                    f"{tps:,.0f} tok/s", ratio)
            except torch.cuda.OutOfMemoryError:
                add("rollout", f"megatron device sampler, {attention}", "OOM", "-", "-")
            if attention == "sdpa":
                n_ex = min(args.exact_tokens, new_tokens)
                dt, ntok = time_rollout(actor, prompts, n_ex, "exact", eos_id, device)
                tps = ntok / dt
                ratio = f"{tps / hf_tps:.2f}" if hf_tps else "-"
                add("rollout", f"megatron host float64 sampler ({n_ex} tok), {attention}",
                    f"{ntok} tok in {dt:.1f} s", f"{tps:,.0f} tok/s", ratio)
            actor.sampler = "device"
        free()
        if attention == "sdpa" and "engine" not in skip:
            engine_section(actor, arch, prompts, prompt_len, new_tokens, engine_rows, eos_id, device, hf_tps, tbs,
                           add, cpu, args.profile)
            actor.generation.engine = None
            free()
        if "train" not in skip:
            batch = train_batch(arch, train_rows, prompt_len, max_resp)
            lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
            flops = train_flops(arch, lengths)
            settings = args.recompute_layers.split(",") if not cpu else ["0"]
            # (packed?, length-sorted?, recompute setting): the packed step first, then today's padded ones
            variants = []
            if attention == "sdpa" and args.micro_batch_tokens > 0:
                packed_settings = args.packed_recompute.split(",") if not cpu else ["auto"]
                variants += [(True, True, st) for st in packed_settings]
            variants += [(False, True, st) for st in (settings if attention == "sdpa" else settings[:1])]
            variants.append((False, False, settings[0]))
            for packed, sort, setting in variants:
                actor.micro_batch_tokens = args.micro_batch_tokens if packed else 0
                actor.sort_by_length = sort
                actor.recompute_setting = recompute_setting(setting, arch.num_layers)
                layout = (f"packed micro-batches of <= {args.micro_batch_tokens} tokens" if packed else
                          f"{'length-sorted' if sort else 'fixed-width'} micro-batches of {args.micro_batch} rows")
                plan_line, peaks = micro_batch_memory(actor, batch, packed, device)
                try:
                    r = time_train(actor, batch, device, args.train_steps)
                except torch.cuda.OutOfMemoryError:
                    add("train", f"GRPO step, {attention}, {layout}, recompute {setting}",
                        f"{train_rows} x <= {prompt_len + max_resp} tok", "OOM", "-")
                    add("memory", f"{attention}, {layout}", plan_line, "-", "-")
                    free()
                    continue
                label = (f"GRPO step, {attention}, {layout}, "
                         f"{recompute_label(actor.recompute_layers, arch.num_layers, actor.recompute_setting)}")
                tps = sum(lengths) / r["s_per_step"]
                mfu = flops / r["s_per_step"] / H100_BF16_PEAK
                extra = f"MFU {100 * mfu:.1f}% (peak 989)"
                if peak_meas:
                    extra += f", {100 * flops / r['s_per_step'] / (peak_meas * 1e12):.1f}% (measured)"
                pad = packed_padding_share(actor, batch) if packed else padding_share(batch, args.micro_batch, sort)
                measured = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] == r["peak_gib"] else "n/a (CPU)"
                add("train", label, f"{r['s_per_step']:.2f} s/step, peak {measured} (predicted "
                    f"{size(peaks[actor.recompute_layers])}), padding {100 * pad:.1f}%",
                    f"{tps:,.0f} tok/s", extra)
                add("memory", f"{attention}, {layout}", plan_line, "-", "-")
                free()
            actor.micro_batch_tokens, actor.recompute_setting = args.micro_batch_tokens, None
        if attention == "sdpa" and "reference" not in skip:
            reference_placements(actor, arch, prompt_len, max_resp, device, add)
        actor = None
        free()

    if "logprob" not in skip:  # the chunked log-prob backward, before / after (benchmarks/logprob_backward.py)
        from logprob_backward import rows as logprob_backward_rows

        logprob_backward_rows(device, dtype, add, repeats=3)
    if "deepseek" not in skip:
        schedule_rows(add)
        deepseek_section("tiny-untied" if cpu else "deepseek-1.5b", args, device, dtype, prompt_len, ds_new,
                         ds_mean, cpu, add)

    print()
    print("| section | variant | measured | throughput | ratio / MFU |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"\n# rollout: {n_prompts} prompts x {prompt_len} tokens, {new_tokens} new tokens (EOS id {eos_id}); "
          f"engine rows {engine_rows} (the prompts repeated); train: {train_rows} rows, prompt {prompt_len}, "
          f"responses {min(300, max_resp // 6)}..{max_resp}, micro-batch {args.micro_batch} rows or packs of <= "
          f"{args.micro_batch_tokens} tokens; bound at {1e3 * tbs:,.0f} GB/s ({tbs_src})")
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
