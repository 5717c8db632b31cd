"""Benchmark evaluation: sample, grade, aggregate (pass@1 and mean response tokens), resumable.

Output directory layout:

* ``samples.jsonl`` one line per (benchmark, problem, sample): response, num_tokens, finish_reason,
  score (1.0 correct / 0.0), status. Appended as samples are graded; a rerun skips every
  (benchmark, problem, sample) already present.
* ``summary.json``  per benchmark pass@1 / mean tokens / counts, the macro average, the settings.
* ``table.md``      the paper's Table 1 layout (with the change to a base model when given).
* ``pass_vs_tokens.png`` pass@1 against mean tokens per benchmark, one marker per model.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import defaultdict
from typing import Callable

from laconic_nemo.eval.backends import EvalSampling
from laconic_nemo.eval.benchmarks import AVERAGE_OVER, BENCHMARKS, Problem, build_prompt, load_benchmark

SAMPLES = "samples.jsonl"
SUMMARY = "summary.json"
TABLE = "table.md"
PLOT = "pass_vs_tokens.png"


def sample_seed(seed: int, benchmark: str, index: int, first_sample: int) -> int:
    """A stable 31-bit seed for the samples of one problem (independent of batching and resumption)."""
    h = hashlib.sha256(f"{seed}/{benchmark}/{index}/{first_sample}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def read_samples(path: str) -> list[dict]:
    """Rows of a samples.jsonl (a torn last line from an interrupted run is ignored)."""
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def summarize(rows: list[dict], benchmarks: list[str], n_samples: int | None = None) -> dict:
    """Per benchmark: pass@1 = mean over problems of the mean score over that problem's samples; tokens =
    mean over problems of the mean num_tokens; plus counts. ``average``: macro mean of pass@1 and tokens over
    :data:`AVERAGE_OVER` benchmarks present (None when one of them is missing)."""
    by_problem: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in rows:
        if r["benchmark"] in benchmarks:
            by_problem[(r["benchmark"], r["index"])].append(r)
    out: dict = {"benchmarks": {}}
    for b in benchmarks:
        probs = {k: v for k, v in by_problem.items() if k[0] == b}
        if not probs:
            continue
        pass1 = [sum(s["score"] for s in v) / len(v) for v in probs.values()]
        toks = [sum(s["num_tokens"] for s in v) / len(v) for v in probs.values()]
        all_samples = [s for v in probs.values() for s in v]
        out["benchmarks"][b] = {
            "pass@1": sum(pass1) / len(pass1),
            "tokens": sum(toks) / len(toks),
            "problems": len(probs),
            "samples": len(all_samples),
            "truncated": sum(s["finish_reason"] == "length" for s in all_samples) / len(all_samples),
            "no_answer": sum(s["status"] == "no_answer" for s in all_samples) / len(all_samples),
            "complete": n_samples is None or all(len(v) >= n_samples for v in probs.values()),
        }
    avg = [out["benchmarks"].get(b) for b in AVERAGE_OVER]
    out["average"] = None if any(a is None for a in avg) else {
        "pass@1": sum(a["pass@1"] for a in avg) / len(avg),
        "tokens": sum(a["tokens"] for a in avg) / len(avg),
    }
    return out


def _cols(benchmarks: list[str]) -> list[str]:
    """The paper's benchmarks in Table 1 order, then any other benchmark (e.g. the synthetic task) as given."""
    return [b for b in BENCHMARKS if b in benchmarks] + [b for b in benchmarks if b not in BENCHMARKS]


def display_name(benchmark: str) -> str:
    """The column title of ``benchmark`` (the paper's spelling for its benchmarks)."""
    from laconic_nemo.eval import synthetic

    if benchmark == synthetic.BENCHMARK:
        return synthetic.DISPLAY
    return BENCHMARKS[benchmark][1] if benchmark in BENCHMARKS else benchmark


def markdown_table(summary: dict, name: str, base: dict | None = None, base_name: str = "base") -> str:
    """The paper's Table 1: per benchmark Pass@1 (%) and #Tokens, the average over AIME2024/MATH500/
    Minerva/OlympiadBench; with ``base`` a base row and a change row (pass@1 points, % tokens)."""
    if base is None:
        return comparison_table([(name, summary)], with_base=False)
    return comparison_table([(base_name, base), (name, summary)])


def comparison_table(models: list[tuple[str, dict]], with_base: bool = True) -> str:
    """Table 1 for several models: one row per (name, summary); with ``with_base`` the first model is the base
    and every other model's row is followed by its change vs the base (pass@1 in points, tokens in %
    ``100 (ours - base) / base``). The Avg columns are left out when no model has an average (a benchmark
    set without the paper's four)."""
    cols = _cols(list(dict.fromkeys(b for _, s in models for b in s["benchmarks"])))
    show_avg = any(s.get("average") for _, s in models)
    head = ["Model"] + [f"{display_name(b)} {k}" for b in cols for k in ("Pass@1", "#Tokens")]
    head += ["Avg Pass@1", "Avg #Tokens"] if show_avg else []

    def row(label, s):
        cells = [label]
        for b in cols:
            m = s["benchmarks"].get(b)
            cells += ["-", "-"] if m is None else [f"{100 * m['pass@1']:.1f}", f"{m['tokens']:.0f}"]
        if show_avg:
            a = s.get("average")
            cells += ["-", "-"] if a is None else [f"{100 * a['pass@1']:.1f}", f"{a['tokens']:.0f}"]
        return cells

    def delta(m0, m):
        if m is None or m0 is None:
            return ["-", "-"]
        dp = 100 * (m["pass@1"] - m0["pass@1"])
        dt = 100 * (m["tokens"] - m0["tokens"]) / m0["tokens"] if m0["tokens"] else float("nan")
        return [f"{dp:+.1f}", f"{dt:+.1f}%"]

    base = models[0][1] if with_base else None
    rows = []
    for i, (label, s) in enumerate(models):
        rows.append(row(label, s))
        if base is not None and i > 0:
            cells = ["change" if len(models) == 2 else f"change ({label})"]
            for b in cols:
                cells += delta(base["benchmarks"].get(b), s["benchmarks"].get(b))
            if show_avg:
                cells += delta(base.get("average"), s.get("average"))
            rows.append(cells)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([" --- "] * len(head)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_pass_vs_tokens(path: str, models: list[tuple[str, dict]]) -> None:
    """Scatter of pass@1 (%) against mean tokens, one panel per benchmark (and the average), one marker per
    model; arrows from the first model (the base) to the others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = _cols(list(models[-1][1]["benchmarks"]))
    panels = [(display_name(b), lambda s, b=b: s["benchmarks"].get(b)) for b in cols]
    if models[-1][1].get("average"):
        panels.append(("Average", lambda s: s.get("average")))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), squeeze=False)
    for ax, (title, get) in zip(axes[0], panels):
        pts = []
        for i, (label, s) in enumerate(models):
            m = get(s)
            if m is None:
                continue
            pts.append((m["tokens"], 100 * m["pass@1"]))
            ax.scatter([m["tokens"]], [100 * m["pass@1"]], label=label, marker="os^D"[i % 4], zorder=3)
        for p in pts[1:]:
            ax.annotate("", xy=p, xytext=pts[0], arrowprops={"arrowstyle": "->", "color": "gray"})
        ax.set_title(title)
        ax.set_xlabel("mean response tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("pass@1 (%)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluate(backend, benchmarks: list[str], output_dir: str, n_samples: int = 4,
             sampling: EvalSampling | None = None, limit: int | None = None, grader=None, seed: int = 0,
             chunk_prompts: int = 64, model_name: str = "model", base_summary: str | dict | None = None,
             base_name: str = "base", log: Callable[[str], None] | None = None, data_dir: str | None = None,
             problems: dict[str, list[Problem]] | None = None, prompt_fn: Callable[[str], str] | None = None) -> dict:
    """Evaluate ``backend`` on ``benchmarks``; returns the summary (also written to ``output_dir``).

    grader: object with ``score(responses, answers) -> RewardResult`` (default
    ``laconic_nemo.rewards.MathReward(num_workers=2)``). Prompts are generated in chunks of
    ``chunk_prompts`` problems; samples are appended to samples.jsonl after each chunk, so an interrupted run
    loses at most one chunk and a rerun generates only the missing (problem, sample) pairs.
    problems: benchmark -> its problems, for benchmarks that are not files of ``data_dir`` (the synthetic task,
    :mod:`laconic_nemo.eval.synthetic`); prompt_fn: problem text -> prompt (default :func:`build_prompt` with
    the backend's tokenizer)."""
    if n_samples < 1:
        raise ValueError(f"--n-samples must be >= 1, got {n_samples}")
    sampling = sampling or EvalSampling()
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, SAMPLES)
    done = defaultdict(set)
    for r in read_samples(path):
        done[(r["benchmark"], r["index"])].add(r["sample"])
    own_grader = grader is None
    if own_grader:
        from laconic_nemo.rewards import MathReward

        grader = MathReward(num_workers=2)
    tokenizer = getattr(backend, "tokenizer", None)
    prompt_fn = prompt_fn or (lambda text: build_prompt(text, tokenizer))
    _end_with_newline(path)  # a torn last line from an interrupted run must not swallow the next row
    try:
        with open(path, "a") as out:
            for b in benchmarks:
                rows_b = problems[b][:limit] if problems and b in problems else load_benchmark(b, limit, data_dir)
                todo = [(p, [s for s in range(n_samples) if s not in done[(b, p.index)]]) for p in rows_b]
                todo = [(p, missing) for p, missing in todo if missing]
                total = sum(len(m) for _, m in todo)
                log(f"[eval] {b}: {len(rows_b)} problems x {n_samples} samples, {total} to generate")
                t0, produced = time.time(), 0
                for c in range(0, len(todo), chunk_prompts):
                    _run_chunk(backend, grader, todo[c: c + chunk_prompts], sampling, seed, prompt_fn, out)
                    produced += sum(len(m) for _, m in todo[c: c + chunk_prompts])
                    rate = produced / max(time.time() - t0, 1e-9)
                    log(f"[eval] {b}: {produced}/{total} samples, {rate:.2f} samples/s, "
                        f"eta {(total - produced) / rate if rate else 0:.0f}s")
    finally:
        if own_grader:
            grader.close()
    rows = read_samples(path)
    summary = summarize(rows, benchmarks, n_samples)
    summary.update({"model": model_name, "n_samples": n_samples, "temperature": sampling.temperature,
                    "top_p": sampling.top_p, "max_tokens": sampling.max_tokens, "limit": limit, "seed": seed})
    with open(os.path.join(output_dir, SUMMARY), "w") as f:  # this model's results first, whatever follows
        json.dump(summary, f, indent=2)
    base = None
    if base_summary is not None:
        if isinstance(base_summary, dict):
            base = base_summary
        else:
            with open(base_summary) as f:
                base = json.load(f)
        base_name = base.get("model", base_name)
    table = markdown_table(summary, model_name, base, base_name)
    with open(os.path.join(output_dir, TABLE), "w") as f:
        f.write(table)
    models = ([(base_name, base)] if base else []) + [(model_name, summary)]
    plot_pass_vs_tokens(os.path.join(output_dir, PLOT), models)
    log(table)
    return summary


def _end_with_newline(path: str) -> None:
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def _run_chunk(backend, grader, chunk: list[tuple[Problem, list[int]]], sampling: EvalSampling, seed: int,
               prompt_fn, out) -> None:
    # one generate call per distinct number of missing samples (usually one call with n = n_samples)
    by_n: dict[int, list[tuple[Problem, list[int]]]] = defaultdict(list)
    for p, missing in chunk:
        by_n[len(missing)].append((p, missing))
    for n, items in by_n.items():
        prompts = [prompt_fn(p.problem) for p, _ in items]
        seeds = [sample_seed(seed, p.benchmark, p.index, missing[0]) for p, missing in items]
        completions = backend.generate(prompts, n, sampling, seeds)
        flat = [(p, s, c) for (p, missing), comps in zip(items, completions) for s, c in zip(missing, comps)]
        result = grader.score([c.text for _, _, c in flat], [p.answer for p, _, _ in flat])
        statuses = result.statuses or ["graded"] * len(flat)
        for (p, s, c), score, status in zip(flat, result.scores, statuses):
            out.write(json.dumps({"benchmark": p.benchmark, "index": p.index, "sample": s, "score": float(score),
                                  "status": status, "num_tokens": c.num_tokens, "finish_reason": c.finish_reason,
                                  "response": c.text}) + "\n")
        out.flush()
