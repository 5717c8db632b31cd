"""`laconic-nemo eval`: pass@1 and mean response tokens on the math benchmarks (the paper's Table 1), or on
held-out problems of the tiny synthetic task for a synthetic-task run (``--benchmarks synthetic``), there also per
budget stated in the prompt (``--stated-budgets``, :mod:`laconic_nemo.eval.stated`)."""

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
    p.add_argument("--backend", choices=["transformers", "vllm", "megatron"], default=None,
                   help="default: megatron for --benchmarks synthetic (a one-process megatron-core actor), else vllm")
    p.add_argument("--benchmarks", default="aime2024,math500,minerva,olympiad_bench,amc",
                   help="comma-separated subset of aime2024,math500,minerva,olympiad_bench,amc, or 'all'; or "
                        "'synthetic': held-out problems of a synthetic-task run's task (--model: the run)")
    p.add_argument("--choice-files", default=None,
                   help="NAME=PATH[,NAME=PATH]: evaluate these multiple-choice JSONL files (GPQA / LSAT / MMLU style, "
                        "format in laconic_nemo/eval/choice.py) instead of --benchmarks")
    p.add_argument("--synthetic-problems", type=int, default=512,
                   help="synthetic: held-out problems asked for (fewer when a number of terms has too few unseen)")
    p.add_argument("--stated-budgets", default=None,
                   help="comma-separated budgets (e.g. 16,24,32 or 500,1000,2000); every problem is asked once per "
                        "budget, stated in the prompt (synthetic: by the run's data.target_instruction; math "
                        "benchmarks: by --target-instruction at the end of the user turn); prints per budget the "
                        "mean length, mean length / budget, pass@1, the share inside the band (--band) and within "
                        "10%%, writes stated.md, stated.json and stated_budgets.png")
    p.add_argument("--band", type=float, default=None,
                   help="with --stated-budgets: rho of the band [rho x B, B] whose share is reported and drawn "
                        "(default: the run's laconic.band where --model is a run with one, else 0.9)")
    p.add_argument("--target-instruction", default=" Think for {target} tokens.",
                   help="math benchmarks with --stated-budgets: the text stating a budget, {target} (or {budget}) "
                        "replaced by it; give the run's data.target_instruction (default: the schema's, L1's wording)")
    p.add_argument("--warmed-up", action="store_true",
                   help="synthetic: evaluate the run's cached warm-up policy (its RL starting point, the base)")
    p.add_argument("--warmup-cache", default=None,
                   help="synthetic --warmed-up: the warm-up cache root (default: the run's warmup.cache_dir)")
    p.add_argument("--n-samples", type=int, default=4, help="samples per problem (pass@1 = mean correctness)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="response limit (L_max at evaluation); default 32768, synthetic: the run's rollout.max_new_tokens")
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
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per generate call: transformers backend (default 8), megatron backend (default 256)")
    p.set_defaults(func=main)


def check_args(args) -> str | None:
    """The first user error in ``args`` (a message naming the flag), or None. Runs before any model,
    backend or network library is touched; a local model path that does not exist is an error, never a
    Hugging Face Hub lookup."""
    from laconic_nemo.eval.benchmarks import parse_benchmarks

    model = os.path.expanduser(args.model)
    if args.benchmarks.strip() == "synthetic":
        return _check_synthetic(args)
    if args.backend == "megatron":
        return "--backend megatron evaluates synthetic-task runs only (--benchmarks synthetic)"
    if args.warmed_up:
        return "--warmed-up applies to --benchmarks synthetic only"
    if getattr(args, "stated_budgets", None) is not None:
        from laconic_nemo.eval.stated import check_band, check_instruction, parse_stated_budgets

        if check_band(getattr(args, "band", None)):
            return check_band(args.band)
        if args.choice_files is not None:
            return "--stated-budgets and --choice-files exclude each other"
        try:
            parse_stated_budgets(args.stated_budgets)
        except ValueError as exc:
            return str(exc)
        error = check_instruction(str(args.target_instruction), "--target-instruction")
        if error:
            return error
    if not os.path.isdir(model):
        what = "is a file" if os.path.exists(model) else "does not exist"
        return (f"--model {args.model!r} {what}: give a local Hugging Face checkpoint folder (with config.json); "
                "models are never downloaded here")
    run_like = any(os.path.exists(os.path.join(model, f)) for f in ("trainer_state.json", "checkpoints", "latest"))
    if not os.path.isfile(os.path.join(model, "config.json")) and not run_like:
        return (f"--model {args.model!r} has no config.json: not a Hugging Face checkpoint folder, nor a training "
                "run or checkpoint to export")
    if not run_like:
        from laconic_nemo.bridge.hf_folder import HFConfigError, hf_config

        try:
            hf_config(model)  # a config.json that is not a JSON object: named with its line
        except HFConfigError as exc:
            return f"--model {args.model!r}: {exc}"
    try:
        parse_benchmarks(args.benchmarks)
        if args.choice_files is not None:
            from laconic_nemo.eval.choice import parse_choice_files

            for name, path in parse_choice_files(args.choice_files).items():
                if not os.path.isfile(path):
                    return f"--choice-files: {name}={path}: no such file"
    except ValueError as exc:
        return str(exc)
    error = _check_numbers(args)
    if error:
        return error
    return _check_common(args)


def _check_numbers(args) -> str | None:
    positive = {"--n-samples": args.n_samples, "--chunk-prompts": args.chunk_prompts,
                "--tensor-parallel-size": args.tensor_parallel_size, "--synthetic-problems": args.synthetic_problems}
    for flag, value in (("--max-tokens", args.max_tokens), ("--batch-size", args.batch_size), ("--limit", args.limit)):
        if value is not None:
            positive[flag] = value
    for flag, value in positive.items():
        if value < 1:
            return f"{flag} = {value} is invalid: allowed an integer >= 1"
    return None


def _check_synthetic(args) -> str | None:
    """--benchmarks synthetic: --model must be a synthetic-task run or checkpoint (with its warm-up cache for
    --warmed-up), evaluated by the megatron backend."""
    if args.backend not in (None, "megatron"):
        return f"--benchmarks synthetic is generated by --backend megatron, not {args.backend}"
    if args.choice_files is not None:
        return "--choice-files and --benchmarks synthetic exclude each other"
    error = _check_numbers(args)
    if error:
        return error
    from laconic_nemo.eval.synthetic import run_config, warmup_policy_dir
    from laconic_nemo.tools.export import ExportError

    try:
        cfg, world_size = run_config(os.path.expanduser(args.model))
    except ExportError as exc:
        return f"--model {args.model!r}: {exc}"
    if cfg.model.source != "synthetic" or cfg.data.kind != "synthetic":
        return (f"--model {args.model!r} is a model.source = {cfg.model.source} run; --benchmarks synthetic needs a "
                "synthetic-task run (data.kind = synthetic)")
    longest_prompt = 2 + 2 * cfg.data.synthetic.max_terms + 1
    if getattr(args, "stated_budgets", None) is not None:
        from laconic_nemo.config import states_a_target, synthetic_unencodable
        from laconic_nemo.eval.stated import check_band, parse_stated_budgets, stated_prompt

        if check_band(getattr(args, "band", None)):
            return check_band(args.band)
        try:
            budgets = parse_stated_budgets(args.stated_budgets)
        except ValueError as exc:
            return str(exc)
        instruction = cfg.data.target_instruction
        missing = synthetic_unencodable(instruction, template=True)
        if not states_a_target(instruction) or missing:
            return (f"--stated-budgets: the run's data.target_instruction {instruction!r} cannot state a budget to the "
                    "synthetic task (allowed a text holding {target}, in the synthetic tokenizer's characters"
                    + (f"; not encodable: {missing}" if missing else "") + ")")
        longest_prompt = len(stated_prompt("Q:" + "a0" * cfg.data.synthetic.max_terms + "\n", instruction,
                                           max(budgets)))
    limit = cfg.model.max_position_embeddings - longest_prompt
    if limit < 1:
        return (f"--stated-budgets: the longest stated prompt ({longest_prompt} tokens) leaves no room in the run's "
                f"model.max_position_embeddings = {cfg.model.max_position_embeddings}")
    if args.max_tokens is None and cfg.rollout.max_new_tokens > limit:
        return (f"--max-tokens: the run's rollout.max_new_tokens = {cfg.rollout.max_new_tokens} does not fit after the "
                f"longest stated prompt; allowed 1..{limit}")
    if args.max_tokens is not None and args.max_tokens > limit:
        return (f"--max-tokens = {args.max_tokens} is invalid: allowed 1..{limit} (the run's model.max_position_"
                f"embeddings {cfg.model.max_position_embeddings} minus the longest prompt)")
    if args.warmed_up:
        if world_size is None:
            return f"--model {args.model!r}: no checkpoint records the run's world size; the warm-up is not found"
        cache = warmup_policy_dir(cfg, int(world_size), args.warmup_cache)
        if not (cache / "done").is_file():
            return (f"--warmed-up: the run's warm-up cache {cache} is missing or incomplete; pass --warmup-cache DIR "
                    "(the folder holding policy_*)")
    return _check_common(args)


def _check_common(args) -> str | None:
    if args.grader_workers < 0:
        return f"--grader-workers = {args.grader_workers} is invalid: allowed an integer >= 0 (0: grade in-process)"
    if not args.temperature > 0:
        return f"--temperature = {args.temperature} is invalid: allowed > 0"
    if not 0 < args.top_p <= 1:
        return f"--top-p = {args.top_p} is invalid: allowed in (0, 1]"
    if not 0 < args.gpu_memory_utilization <= 1:
        return f"--gpu-memory-utilization = {args.gpu_memory_utilization} is invalid: allowed in (0, 1]"
    if args.base_summary is not None:
        error = check_base_summary(args.base_summary)
        if error:
            return error
    error = _check_output_dir(args.output_dir)
    if error:
        return error
    if args.backend in (None, "vllm") and args.benchmarks.strip() != "synthetic":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            return "--backend vllm needs the `vllm` package (GPU): install laconic-nemo[vllm], or use --backend transformers"
    return None


def check_base_summary(path: str) -> str | None:
    """``--base-summary`` is a summary.json that `laconic-nemo eval` wrote (``{"benchmarks": {name: {"pass@1",
    "tokens", ...}}, ...}``), checked before any model is loaded; the message names the file and the line."""
    import json

    if not os.path.isfile(path):
        return f"--base-summary {path!r} does not exist"
    try:
        data = json.loads(open(path, "rb").read().decode("utf-8"))
    except UnicodeDecodeError as exc:
        from laconic_nemo.config import not_utf8

        return f"--base-summary {path} {not_utf8(path, exc)}"
    except ValueError as exc:
        return (f"--base-summary {path} line {getattr(exc, 'lineno', '?')}: invalid JSON ({getattr(exc, 'msg', exc)}); "
                "allowed the summary.json of an earlier `laconic-nemo eval`")
    benchmarks = data.get("benchmarks") if isinstance(data, dict) else None
    if not isinstance(benchmarks, dict) or not all(
            isinstance(m, dict) and all(isinstance(m.get(k), (int, float)) for k in ("pass@1", "tokens"))
            for m in benchmarks.values()):
        return (f"--base-summary {path}: not a summary of `laconic-nemo eval` (allowed a JSON object whose "
                "'benchmarks' maps each benchmark to its 'pass@1' and 'tokens')")
    return None


def _check_output_dir(path: str) -> str | None:
    """``--output-dir`` is a writable folder or can be created, and its samples.jsonl (an earlier, interrupted
    evaluation that this one continues) is UTF-8 text."""
    from laconic_nemo.config import ConfigError
    from laconic_nemo.plan.preflight import check_writable_dir

    try:
        check_writable_dir(path, "--output-dir")
    except ConfigError as exc:
        return str(exc)
    samples = os.path.join(path, "samples.jsonl")
    if os.path.exists(samples):
        if not os.path.isfile(samples):
            return f"--output-dir {path!r}: {samples} is a folder; the evaluation writes its samples there"
        raw = open(samples, "rb").read()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            return f"--output-dir {path!r}: {samples} line {line} is not UTF-8 text"
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
    from laconic_nemo.rewards import MathReward
    from laconic_nemo.tools.export import ExportError, hf_model_dir

    if args.benchmarks.strip() == "synthetic":
        return _main_synthetic(args)
    benchmarks = parse_benchmarks(args.benchmarks)
    name = args.name or os.path.basename(os.path.normpath(args.model))
    if args.choice_files is not None:  # file format errors before any model is loaded
        from laconic_nemo.eval.choice import ChoiceGrader, chat_prompt, load_choice_file, parse_choice_files

        try:
            problems = {n: load_choice_file(n, f) for n, f in parse_choice_files(args.choice_files).items()}
        except ValueError as exc:
            print(f"laconic-nemo eval: --choice-files: {exc}", file=sys.stderr)
            return 2
    run_band = _run_band(args.model) if args.stated_budgets is not None else None
    try:  # a run directory or checkpoint: export it (once) next to the results
        args.model = hf_model_dir(args.model, os.path.join(args.output_dir, "model"), args.hf_config)
    except ExportError as exc:
        print(f"laconic-nemo eval: {exc}", file=sys.stderr)
        return 2
    sampling = EvalSampling(args.temperature, args.top_p, args.max_tokens or 32768)
    if args.backend in (None, "vllm"):
        backend = VLLMBackend(args.model, tensor_parallel_size=args.tensor_parallel_size,
                              gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed)
    else:
        backend = TransformersBackend(args.model, device=args.device, batch_size=args.batch_size or 8)
    if args.choice_files is not None:
        tokenizer = getattr(backend, "tokenizer", None)
        evaluate(backend, list(problems), args.output_dir, n_samples=args.n_samples, sampling=sampling,
                 limit=args.limit, grader=ChoiceGrader(), seed=args.seed, chunk_prompts=args.chunk_prompts,
                 model_name=name, base_summary=args.base_summary, problems=problems,
                 prompt_fn=lambda text: chat_prompt(text, tokenizer))
        return 0
    if args.stated_budgets is not None:
        return _stated_math(args, backend, benchmarks, sampling, name, run_band)
    with MathReward(num_workers=args.grader_workers) as grader:
        evaluate(backend, benchmarks, args.output_dir, n_samples=args.n_samples, sampling=sampling, limit=args.limit,
                 grader=grader, seed=args.seed, chunk_prompts=args.chunk_prompts, model_name=name,
                 base_summary=args.base_summary)
    return 0


def _run_band(model: str) -> float | None:
    """``laconic.band`` of the run or checkpoint ``model`` (None: not a run, or a run without the band)."""
    from laconic_nemo.eval.synthetic import run_config
    from laconic_nemo.tools.export import ExportError

    try:
        cfg, _ = run_config(os.path.expanduser(model))
    except (ExportError, OSError, ValueError):  # an HF folder, not a run
        return None
    return cfg.laconic.band


def _stated_math(args, backend, benchmarks: list[str], sampling, name: str, run_band: float | None = None) -> int:
    """``--stated-budgets`` on the math benchmarks: one benchmark ``stated_<b>`` per budget (every problem of
    ``benchmarks`` with b stated at the end of its user turn), graded by the math reward; the per-budget table
    (the band's share with rho :func:`~laconic_nemo.eval.stated.band_of` ``--band`` and ``run_band``, the run's)."""
    from laconic_nemo.eval.benchmarks import chat_prompt
    from laconic_nemo.eval.runner import evaluate
    from laconic_nemo.eval.stated import band_of, math_stated_problems, parse_stated_budgets, report_from_samples
    from laconic_nemo.rewards import MathReward

    budgets = parse_stated_budgets(args.stated_budgets)
    problems = math_stated_problems(benchmarks, budgets, args.target_instruction, args.limit)
    tokenizer = getattr(backend, "tokenizer", None)
    with MathReward(num_workers=args.grader_workers) as grader:
        evaluate(backend, list(problems), args.output_dir, n_samples=args.n_samples, sampling=sampling,
                 grader=grader, seed=args.seed, chunk_prompts=args.chunk_prompts, model_name=name, problems=problems,
                 prompt_fn=lambda user: chat_prompt(user, tokenizer))
    table = report_from_samples(args.output_dir, problems, budgets, None, args.n_samples, name, {
        "instruction": str(args.target_instruction), "benchmarks": benchmarks, "n_samples": args.n_samples,
        "limit": args.limit, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens, "seed": args.seed, "band": band_of(getattr(args, "band", None), run_band)})
    print(f"{name}: stated budgets (user turn + {str(args.target_instruction)!r})")
    print(table, end="")
    return 0


def _main_synthetic(args) -> int:
    import torch

    from laconic_nemo.eval.backends import EvalSampling
    from laconic_nemo.eval.runner import evaluate
    from laconic_nemo.eval.synthetic import (
        BENCHMARK,
        ExactAnswerGrader,
        MegatronBackend,
        benchmark_problems,
        run_config,
        warmup_policy_dir,
    )
    from laconic_nemo.runtime.cpu_isa import pin_cpu_isa
    from laconic_nemo.runtime.megatron_env import cpu_threads

    torch.set_num_threads(cpu_threads())  # the trainer's setting: the warm-up cache key names it
    pin_cpu_isa()  # the CPU trainer's kernels (before the first one here): the warm-up cache key names them too
    cfg, world_size = run_config(os.path.expanduser(args.model))
    policy = warmup_policy_dir(cfg, int(world_size), args.warmup_cache) if args.warmed_up else args.model
    name = args.name or os.path.basename(os.path.normpath(args.model)) + ("-warmup" if args.warmed_up else "")
    backend = MegatronBackend(cfg, batch_size=args.batch_size or 256)
    backend.load(policy, cfg)
    problems = benchmark_problems(cfg, args.synthetic_problems, seed=args.seed)
    sampling = EvalSampling(args.temperature, args.top_p, args.max_tokens or cfg.rollout.max_new_tokens)
    if args.stated_budgets is not None:
        return _stated(args, cfg, backend, sampling, name)
    evaluate(backend, [BENCHMARK], args.output_dir, n_samples=args.n_samples, sampling=sampling, limit=args.limit,
             grader=ExactAnswerGrader(), seed=args.seed, chunk_prompts=args.chunk_prompts, model_name=name,
             base_summary=args.base_summary, problems={BENCHMARK: problems}, prompt_fn=lambda text: text)
    return 0


def _stated(args, cfg, backend, sampling, name: str) -> int:
    """``--stated-budgets``: one benchmark ``stated_<b>`` per budget in one resumable evaluation, then the
    per-budget table (:mod:`laconic_nemo.eval.stated`)."""
    from laconic_nemo.eval.runner import evaluate
    from laconic_nemo.eval.stated import band_of, parse_stated_budgets, report_from_samples, stated_problems
    from laconic_nemo.eval.synthetic import ExactAnswerGrader

    budgets = parse_stated_budgets(args.stated_budgets)
    problems = stated_problems(cfg, budgets, args.synthetic_problems, seed=args.seed)
    evaluate(backend, list(problems), args.output_dir, n_samples=args.n_samples, sampling=sampling, limit=args.limit,
             grader=ExactAnswerGrader(), seed=args.seed, chunk_prompts=args.chunk_prompts, model_name=name,
             base_summary=args.base_summary, problems=problems, prompt_fn=lambda text: text)
    table = report_from_samples(args.output_dir, problems, budgets, args.limit, args.n_samples, name, {
        "instruction": cfg.data.target_instruction, "n_samples": args.n_samples, "limit": args.limit,
        "synthetic_problems": args.synthetic_problems, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens, "seed": args.seed,
        "band": band_of(getattr(args, "band", None), cfg.laconic.band)})
    print(f"{name}: stated budgets (prompt + {cfg.data.target_instruction!r})")
    print(table, end="")
    return 0
