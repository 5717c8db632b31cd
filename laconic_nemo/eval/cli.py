"""`laconic-nemo eval`: pass@1 and mean response tokens on the math benchmarks (the paper's Table 1)."""

from __future__ import annotations

import os
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="evaluate a checkpoint on the math benchmarks (paper Table 1)",
                              description=__doc__)
    p.add_argument("--model", required=True,
                   help="HF checkpoint directory, or a training run / checkpoint folder (exported to "
                        "OUTPUT_DIR/model first, see `laconic-nemo export`)")
    p.add_argument("--hf-config", default=None,
                   help="with a run as --model: folder with the base config.json and tokenizer (default: model.path)")
    p.add_argument("--backend", choices=["transformers", "vllm"], default="vllm")
    p.add_argument("--benchmarks", default="aime2024,math500,minerva,olympiad_bench,amc",
                   help="comma-separated subset of aime2024,math500,minerva,olympiad_bench,amc, or 'all'")
    p.add_argument("--n-samples", type=int, default=4, help="samples per problem (pass@1 = mean correctness)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=32768, help="response limit (L_max at evaluation)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--base-summary", default=None, help="summary.json of the base model, for the change row")
    p.add_argument("--limit", type=int, default=None, help="first K problems of each benchmark")
    p.add_argument("--name", default=None, help="model name in the table (default: the model directory name)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-prompts", type=int, default=64, help="problems per generate call (resume granularity)")
    p.add_argument("--grader-workers", type=int, default=2)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm backend")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vllm backend")
    p.add_argument("--device", default="cpu", help="transformers backend")
    p.add_argument("--batch-size", type=int, default=8, help="transformers backend: sequences per generate call")
    p.set_defaults(func=main)


def main(args) -> int:
    from laconic_nemo.eval.backends import EvalSampling, TransformersBackend, VLLMBackend
    from laconic_nemo.eval.benchmarks import parse_benchmarks
    from laconic_nemo.eval.runner import evaluate
    from laconic_nemo.export import ExportError, hf_model_dir
    from laconic_nemo.rewards import MathReward

    benchmarks = parse_benchmarks(args.benchmarks)
    name = args.name or os.path.basename(os.path.normpath(args.model))
    try:  # a run directory or checkpoint: export it (once) next to the results
        args.model = hf_model_dir(args.model, os.path.join(args.output_dir, "model"), args.hf_config)
    except ExportError as exc:
        print(f"laconic-nemo eval: {exc}", file=sys.stderr)
        return 2
    sampling = EvalSampling(args.temperature, args.top_p, args.max_tokens)
    if args.backend == "vllm":
        backend = VLLMBackend(args.model, tensor_parallel_size=args.tensor_parallel_size,
                              gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed)
    else:
        backend = TransformersBackend(args.model, device=args.device, batch_size=args.batch_size)
    with MathReward(num_workers=args.grader_workers) as grader:
        evaluate(backend, benchmarks, args.output_dir, n_samples=args.n_samples, sampling=sampling, limit=args.limit,
                 grader=grader, seed=args.seed, chunk_prompts=args.chunk_prompts, model_name=name,
                 base_summary=args.base_summary)
    return 0
