"""Stated-budget evaluation of a tiny-task run: does the policy follow the budget its prompt states?

``laconic-nemo eval --benchmarks synthetic --stated-budgets 16,24,32 --model RUN --output-dir DIR`` asks every
held-out problem (:func:`laconic_nemo.eval.synthetic.heldout_problems`) once per stated budget b, the prompt
stating b exactly as training stated its targets: the problem text followed by the run's
``data.target_instruction`` with ``{target}`` = b (the L1 data path, ``GRPOTrainer._prompt_texts``;
:func:`stated_prompt`). Each budget is a benchmark of its own, ``stated_<b>``, of one resumable evaluation
(:func:`laconic_nemo.eval.runner.evaluate`: ``samples.jsonl``, ``summary.json``), and per budget the command
prints and writes (:func:`stated_rows`):

* mean length: the mean generated tokens L over all samples (EOS not counted, as the cost counts L);
* mean length / budget;
* pass@1: the mean correctness over all samples (the training reward's rule);
* share within 10%: the share of samples with ``|L - b| <= 0.1 b``;
* share in the band: the share with ``rho b <= L <= b`` (the band constraint's ``[B_lo, B]``,
  :mod:`laconic_nemo.core.band`; rho: ``--band``, default the run's ``laconic.band``, else :data:`DEFAULT_BAND`);
* share over budget: the share with ``L > b``.

Files: ``stated.md`` (the table), ``stated.json`` (its rows and the settings, ``band`` among them) and
``stated_budgets.png`` (stated budget on x, measured mean length on y, the diagonal L = b and the band
``[rho b, b]`` shaded; pass@1 per budget beside).
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from laconic_nemo.core.constraints import WITHIN  # "within 10%" of the stated budget, as training reports it

PREFIX = "stated_"
TABLE = "stated.md"
JSON = "stated.json"
PLOT = "stated_budgets.png"
DEFAULT_BAND = 0.9  # rho of the reported band [rho b, b] when neither --band nor the run's laconic.band gives one


def band_of(flag: float | None, run_band: float | None) -> float:
    """rho of the reported band: ``--band``, else the run's ``laconic.band``, else :data:`DEFAULT_BAND`."""
    return float(flag if flag is not None else run_band if run_band is not None else DEFAULT_BAND)


def check_band(value: float | None) -> str | None:
    """None when ``--band`` is unset or in (0, 1), else the error naming the flag."""
    if value is None or 0.0 < value < 1.0:
        return None
    return f"--band = {value} is invalid: allowed a number in (0, 1) (the band [band x B, B])"


def parse_stated_budgets(text: str, flag: str = "--stated-budgets") -> list[int]:
    """``"16,24,32"`` -> ``[16, 24, 32]``; an empty list, a value that is not an integer, a budget < 1 or a
    repeated budget is a ValueError naming ``flag``."""
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise ValueError(f"{flag} = {text!r} is invalid: allowed a comma-separated list of integers >= 1, e.g. 16,24,32")
    out: list[int] = []
    for p in parts:
        try:
            b = int(p)
        except ValueError:
            raise ValueError(f"{flag}: {p!r} is not an integer (allowed a comma-separated list of integers >= 1)") \
                from None
        if b < 1:
            raise ValueError(f"{flag}: budget {b} is invalid: allowed an integer >= 1")
        if b in out:
            raise ValueError(f"{flag}: budget {b} is given twice")
        out.append(b)
    return out


def stated_prompt(prompt: str, instruction: str, budget: int) -> str:
    """The prompt stating ``budget``: ``prompt + instruction.format(target=budget, budget=budget)``, the rule by
    which training states each prompt's target (``GRPOTrainer._prompt_texts``; a test holds the two equal)."""
    from laconic_nemo.config import state_target

    return prompt + state_target(instruction, budget)


def math_stated_problems(benchmarks: Iterable[str], budgets: Iterable[int], instruction: str,
                         limit: int | None = None, data_dir: str | None = None) -> dict[str, list]:
    """``stated_<b>`` -> the first ``limit`` problems of each math benchmark (numbered across them), each as the
    user turn of :func:`laconic_nemo.eval.benchmarks.build_prompt` with ``instruction`` stating b at its end (where
    the trainer states a target, ``laconic_nemo.data.datasets.state_in_user_turn``); the same problems for every
    budget. The problem text is the whole user turn: wrap it with ``chat_prompt``."""
    from laconic_nemo.config import state_target
    from laconic_nemo.eval.benchmarks import Problem, load_benchmark, user_turn

    base = [p for b in benchmarks for p in load_benchmark(b, limit, data_dir)]
    return {benchmark_name(b): [Problem(benchmark_name(b), i, user_turn(p.problem, state_target(instruction, b)),
                                        p.answer) for i, p in enumerate(base)] for b in budgets}


def check_instruction(instruction: str, flag: str) -> str | None:
    """None when ``instruction`` can state a budget ({target} or {budget}), else the error naming ``flag``."""
    from laconic_nemo.config import states_a_target

    if not states_a_target(instruction):
        return f"{flag} = {instruction!r} is invalid: allowed a text holding {{target}} or {{budget}}"
    return None


def report_from_samples(output_dir: str, problems: dict[str, list], budgets: list[int], limit: int | None,
                        n_samples: int, name: str, settings: dict) -> str:
    """The table of this evaluation's samples (an output folder may hold more, from an earlier one with other
    settings), written by :func:`write_report`; ``settings["band"]``: rho of the reported band (default
    :data:`DEFAULT_BAND`); returns the table."""
    from laconic_nemo.eval.runner import SAMPLES, read_samples

    asked = {(b, p.index) for b, ps in problems.items() for p in ps[:limit]}
    samples = [r for r in read_samples(os.path.join(output_dir, SAMPLES))
               if (r["benchmark"], r["index"]) in asked and r["sample"] < n_samples]
    band = float(settings.get("band", DEFAULT_BAND))
    return write_report(output_dir, name, stated_rows(samples, budgets, band), {**settings, "band": band})


def benchmark_name(budget: int) -> str:
    return f"{PREFIX}{int(budget)}"


def stated_problems(cfg, budgets: Iterable[int], num_problems: int, seed: int = 0) -> dict[str, list]:
    """``stated_<b>`` -> the held-out problems of run config ``cfg`` (:func:`benchmark_problems`) with their prompt
    stating b in the run's ``data.target_instruction``; the same problems for every budget."""
    from laconic_nemo.eval.benchmarks import Problem
    from laconic_nemo.eval.synthetic import benchmark_problems

    base = benchmark_problems(cfg, num_problems, seed=seed)
    instruction = cfg.data.target_instruction
    return {benchmark_name(b): [Problem(benchmark_name(b), p.index, stated_prompt(p.problem, instruction, b), p.answer)
                                for p in base] for b in budgets}


def stated_rows(samples: list[dict], budgets: Iterable[int], band: float = DEFAULT_BAND) -> list[dict]:
    """Per stated budget b (in the given order), from the evaluation's sample rows (``benchmark``, ``num_tokens``,
    ``score``): n (samples), mean_length, length_ratio (mean_length / b), pass@1, within_10 (share with
    ``|L - b| <= 0.1 b``), in_band (share with ``band * b <= L <= b``), over_budget (share with ``L > b``). A
    budget without samples is a ValueError."""
    out = []
    for b in budgets:
        rows = [r for r in samples if r["benchmark"] == benchmark_name(b)]
        if not rows:
            raise ValueError(f"no samples of stated budget {b}")
        n = len(rows)
        lengths = [int(r["num_tokens"]) for r in rows]
        mean_len = sum(lengths) / n
        out.append({"budget": int(b), "n": n, "mean_length": mean_len, "length_ratio": mean_len / b,
                    "pass@1": sum(float(r["score"]) for r in rows) / n,
                    "within_10": sum(abs(L - b) <= WITHIN * b for L in lengths) / n,
                    "in_band": sum(band * b <= L <= b for L in lengths) / n,
                    "over_budget": sum(L > b for L in lengths) / n})
    return out


def markdown(rows: list[dict], band: float = DEFAULT_BAND) -> str:
    lines = [f"| stated budget | mean length | mean length / budget | pass@1 | share in band [{band:g} B, B] | "
             "share within 10% | share over budget |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['budget']} | {r['mean_length']:.1f} | {r['length_ratio']:.2f} | {r['pass@1']:.3f} | "
              f"{r['in_band']:.3f} | {r['within_10']:.3f} | {r['over_budget']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(path: str, runs: list[tuple[str, list[dict]]], band: float = DEFAULT_BAND) -> None:
    """Stated budget (x) against measured mean length (y), one line per run, with the diagonal L = b, the band
    ``[band b, b]`` shaded and the 10% lines dotted; beside it pass@1 per stated budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    budgets = sorted({r["budget"] for _, rows in runs for r in rows})
    lo, hi = min(budgets), max(budgets)
    top = max([hi] + [r["mean_length"] for _, rows in runs for r in rows]) * 1.1
    ax.plot([0, top], [0, top], color="gray", lw=1, ls="--", label="diagonal (L = budget)")
    ax.fill_between([0, top], [0, band * top], [0, top], color="tab:green", alpha=0.15,
                    label=f"band [{band:g} B, B]")
    for f in (1 - WITHIN, 1 + WITHIN):
        ax.plot([0, top], [0, f * top], color="gray", lw=0.8, ls=":", label="within 10%" if f > 1 else None)
    for i, (name, rows) in enumerate(runs):
        xs = [r["budget"] for r in rows]
        ax.plot(xs, [r["mean_length"] for r in rows], marker="os^Dv"[i % 5], label=name)
        ax2.plot(xs, [r["pass@1"] for r in rows], marker="os^Dv"[i % 5], label=name)
    pad = 0.15 * (hi - lo or hi)
    ax.set_xlim(max(0, lo - pad), hi + pad)
    ax.set_ylim(0, top)
    ax.set_xlabel("stated budget (tokens)")
    ax.set_ylabel("measured mean length (tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax2.set_xlabel("stated budget (tokens)")
    ax2.set_ylabel("pass@1")
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(output_dir: str, name: str, rows: list[dict], settings: dict) -> str:
    """``stated.md``, ``stated.json`` and ``stated_budgets.png`` in ``output_dir`` (the band of ``settings["band"]``,
    default :data:`DEFAULT_BAND`); returns the table."""
    band = float(settings.get("band", DEFAULT_BAND))
    table = markdown(rows, band)
    with open(os.path.join(output_dir, TABLE), "w") as f:
        f.write(table)
    with open(os.path.join(output_dir, JSON), "w") as f:
        json.dump({"model": name, "rows": rows, **settings}, f, indent=2)
    plot(os.path.join(output_dir, PLOT), [(name, rows)], band)
    return table
