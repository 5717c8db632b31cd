"""`laconic-nemo eval`: pass@1 and mean response tokens on the math benchmarks (the paper's Table 1)."""

from __future__ import annotations

import os


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


def check_args(args) -> str | None:
    """The first user error in ``args`` (a message naming the flag), or None. Runs before any model,
    backend or network library is touched; a local model path that does not exist is an error, never a
    Hugging Face Hub lookup."""
    from laconic_nemo.eval.benchmarks import parse_benchmarks

    model = os.path.expanduser(args.model)
    if not os.path.isdir(model):
        what = "is a file" if os.path.exists(model) else "does not exist"
        return (f"--model {args.model!r} {what}: give a local Hugging Face checkpoint folder (with config.json); "
                "models are never downloaded here")
    run_like = any(os.path.exists(os.path.join(model, f)) for f in ("trainer_state.json", "checkpoints", "latest"))
    if not os.path.isfile(os.path.join(model, "config.json")) and not run_like:
        return (f"--model {args.model!r} has no config.json: not a Hugging Face checkpoint folder, nor a training "
                "run or checkpoint to export")
    try:
        parse_benchmarks(args.benchmarks)
    except ValueError as exc:
        return str(exc)
    positive = {"--n-samples": args.n_samples, "--max-tokens": args.max_tokens, "--chunk-prompts": args.chunk_prompts,
                "--tensor-parallel-size": args.tensor_parallel_size,
                "--batch-size": args.batch_size}
    if args.limit is not None:
        positive["--limit"] = args.limit
    for flag, value in positive.items():
        if value < 1:
            return f"{flag} = {value} is invalid: allowed an integer >= 1"
    if args.grader_workers < 0:
        return f"--grader-workers = {args.grader_workers} is invalid: allowed an integer >= 0 (0: grade in-process)"
    if not args.temperature > 0:
        return f"--temperature = {args.temperature} is invalid: allowed > 0"
    if not 0 < args.top_p <= 1:
        return f"--top-p = {args.top_p} is invalid: allowed in (0, 1]"
    if not 0 < args.gpu_memory_utilization <= 1:
        return f"--gpu-memory-utilization = {args.gpu_memory_utilization} is invalid: allowed in (0, 1]"
    if args.base_summary is not None and not os.path.isfile(args.base_summary):
        return f"--base-summary {args.base_summary!r} does not exist"
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        return f"--output-dir {args.output_dir!r} is a file, not a folder"
    if args.backend == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return "--backend vllm needs the `vllm` package (GPU): install laconic-nemo[vllm], or use --backend transformers"
    return None


def main(args) -> int:
    import sys

    error = check_args(args)
    if error is not None:
        print(f"laconic-nemo eval: {error}", file=sys.stderr)
        return 2
    # every model path is local (checked above): the Hub is never contacted
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
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
