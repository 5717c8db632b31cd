"""Where a run's per-step metrics go: ``metrics.jsonl`` (one JSON object per step, rank 0), the progress line,
and the optional per-rank lambda trace (``logging.rank_trace``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from laconic_nemo.faults import armed, fire


class MetricsWriter:
    """Metric sinks of one rank.

    out: ``run.output_dir``.
    rank, dp_rank: this process's global and data-parallel ranks (rank 0 writes ``metrics.jsonl``).
    num_steps, log_every: the progress line is printed every ``log_every`` steps and at the last step.
    """

    def __init__(self, out: Path, rank: int, dp_rank: int, num_steps: int, log_every: int):
        self.out, self.rank, self.dp_rank = Path(out), int(rank), int(dp_rank)
        self.num_steps, self.log_every = int(num_steps), int(log_every)
        self.is_logger = self.rank == 0

    def write(self, m: dict[str, Any]):
        """Append the step's row to ``metrics.jsonl`` and print the progress line (rank 0)."""
        if not self.is_logger:
            return
        line = json.dumps(m) + "\n"
        with (self.out / "metrics.jsonl").open("a") as f:
            action = armed("metrics_torn", m["step"])
            if action is not None:  # fault injection: a row cut short by a crash
                f.write(line[: len(line) // 2])
                f.flush()
                fire(action)
            f.write(line)
        if m["step"] % self.log_every == 0 or m["step"] == self.num_steps:
            print(
                f"step {m['step']:>4}/{self.num_steps} | lambda {m['lambda']:.4f} | "
                f"mean_len {m['mean_response_length']:7.1f} (B {m['budget']:.0f}) | "
                f"task_reward {m['task_reward']:.3f} | over_budget {m['frac_over_budget']:.2f} | "
                f"{m['step_seconds']:.2f}s",
                flush=True,
            )

    def rank_trace(self, m: dict[str, Any]):
        """This rank's lambda, next lambda and mean length of the step as exact float hex strings."""
        folder = self.out / "rank_trace"
        folder.mkdir(parents=True, exist_ok=True)
        row = {"step": m["step"], "rank": self.rank, "dp_rank": self.dp_rank,
               "lambda": float(m["lambda"]).hex(), "lambda_next": float(m["lambda_next"]).hex(),
               "mean_response_length": float(m["mean_response_length"]).hex()}
        with (folder / f"rank{self.rank:05d}.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")

    def truncate(self, upto_step: int, checkpoint: Path | None = None):
        """Keep the rows of the steps the resumed ``checkpoint`` holds; drop a torn last row (a crash while it
        was written); refuse any other corrupt line, naming the file and the line. When the file lacks a row
        of steps 1..``upto_step`` (removed, or cut short), the rows come back from the checkpoint's copy."""
        from laconic_nemo.grpo.resume import METRICS_COPY, ResumeError, missing_steps, read_metrics

        path = self.out / "metrics.jsonl"
        if not self.is_logger or (not path.is_file() and not upto_step):
            return
        rows, torn = read_metrics(path)
        if torn:
            print(f"{path}: dropped a torn last line (the run died while writing it)", flush=True)
        lost = missing_steps(rows, upto_step)
        if lost:
            copy = None if checkpoint is None else Path(checkpoint) / METRICS_COPY
            if copy is None or not copy.is_file():
                raise ResumeError(f"{path} lacks the rows of steps {_span(lost)} of the checkpoint it resumes, and "
                                  "the checkpoint holds no copy of them: restore the file")
            rows = read_metrics(copy)[0]
            print(f"{path}: the rows of step{'s' if len(lost) > 1 else ''} {_span(lost)} were missing; restored the "
                  f"rows of steps 1-{upto_step} from {copy}", flush=True)
        keep = [json.dumps(r) for r in rows if r["step"] <= upto_step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)


def _span(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3, 7"."""
    parts, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            parts.append(f"{start}" if start == s else f"{start}-{s}")
            start = None
    return ", ".join(parts)
