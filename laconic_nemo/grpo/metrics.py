"""Where a run's per-step metrics go (rank 0): ``metrics.jsonl`` (one JSON object per step), the progress line
(with an ETA), the live dashboards (``logging.tensorboard``: TensorBoard event files; ``logging.wandb``: a
Weights & Biases run, online or offline), and the optional per-rank lambda trace (``logging.rank_trace``).

Every number of a ``metrics.jsonl`` row goes to each dashboard as a scalar of the same name at the row's step
(``lambda``, ``lambda_next``, ``mean_response_length``, ``budget``, ``task_reward``, ``frac_over_budget``,
``shaper/*``, ``reward/*``, ``train/*``, ``step_seconds``, ``time/*``; ``step`` itself is the x axis), and
``sample_response`` as TensorBoard text.

Resume (the checkpoint of step k is loaded, ``metrics.jsonl`` keeps rows 1..k): a run killed after its last
checkpoint may have sent steps k+1.. to the dashboards already, and the resumed run computes them again.
TensorBoard: each writer starts with a restart marker (``purge_step``, :func:`purge_step`), the resumed one at
k + 1, which makes TensorBoard drop every event at steps >= k + 1 written before it (its "purge orphaned data"
rule), so each curve holds one value per step, the later write. W&B: the run is resumed under the same run id (kept in
``<output_dir>/wandb/laconic_run.json``), and a step is sent only if it is past the last step W&B already
holds (W&B refuses to rewrite a step): on CPU the recomputed steps are equal bit for bit, on GPU the first
write of those few steps stays in W&B while metrics.jsonl and TensorBoard hold the later one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any, Protocol

from laconic_nemo.config import ConfigError, to_dict
from laconic_nemo.runtime.faults import armed, fire

WANDB_STATE = "laconic_run.json"


def tensorboard_available() -> bool:
    """True when the ``tensorboard`` package (which ``torch.utils.tensorboard`` writes through) is installed."""
    return importlib.util.find_spec("tensorboard") is not None


def tensorboard_enabled(logging_cfg) -> bool:
    """``logging.tensorboard``: null -> on when tensorboard is installed; true / false as given."""
    setting = logging_cfg.tensorboard
    return tensorboard_available() if setting is None else bool(setting)


def tensorboard_dir(cfg) -> Path:
    """Where the event files go: ``logging.tensorboard_dir``, default ``<run.output_dir>/tensorboard``."""
    return Path(cfg.logging.tensorboard_dir or Path(cfg.run.output_dir) / "tensorboard")


def check_sinks(cfg) -> None:
    """Refuse, before anything is started, a dashboard the recipe asks for whose package is missing."""
    lg = cfg.logging
    if lg.tensorboard and not tensorboard_available():
        raise ConfigError("logging.tensorboard = true needs the tensorboard package (pip install tensorboard, or "
                          "the [tensorboard] extra); allowed without it: null (on when installed) or false")
    if lg.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb = true needs the wandb package (pip install wandb, or the [wandb] extra); "
                          "allowed without it: false")


def split_row(m: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """A metrics.jsonl row -> (its numbers by name, its texts by name); ``step`` is the x axis, not a value."""
    scalars, texts = {}, {}
    for k, v in m.items():
        if k == "step":
            continue
        if isinstance(v, bool):
            scalars[k] = float(v)
        elif isinstance(v, (int, float)):
            scalars[k] = float(v)
        elif isinstance(v, str):
            texts[k] = v
    return scalars, texts


class MetricSink(Protocol):
    """A dashboard: one call per step with every number (and text) of the step's metrics.jsonl row."""

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        ...

    def close(self) -> None:
        ...

    def describe(self) -> str:
        """What and where, for the start-up line."""
        ...


def purge_step(resume_step: int) -> int:
    """The ``purge_step`` of a TensorBoard writer that continues after step ``resume_step`` (0: a fresh run).

    ``SummaryWriter(purge_step=s)`` writes a SessionLog.START at step s into its first event file (torch
    utils/tensorboard/writer.py, ``_get_file_writer``). TensorBoard's server (plugin_event_accumulator.py,
    ``_CheckForRestartAndMaybePurge``) takes the first START of a run for its beginning and every later START
    at step s as a restart that drops the events at steps >= s written before it. So every session writes one:
    a fresh run at step 1 (nothing to drop), a resumed one at resume_step + 1 (the steps past the checkpoint
    that a crashed run may have written)."""
    return int(resume_step) + 1


class TensorBoardSink:
    """Event files in ``log_dir`` through ``torch.utils.tensorboard.SummaryWriter``; flushed every step (a
    dashboard follows the run live); one restart marker at :func:`purge_step` per session."""

    def __init__(self, log_dir: str | Path, resume_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(str(self.log_dir), purge_step=purge_step(resume_step))

    def describe(self) -> str:
        return f"TensorBoard {self.log_dir} (tensorboard --logdir {self.log_dir})"

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, global_step=step)
        for k, v in texts.items():
            self.writer.add_text(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSteps:
    """The W&B run of an output dir: its id and the last step sent, in ``<out>/wandb/laconic_run.json`` (written
    atomically after every step), so a resumed run continues the same run and never sends a step W&B holds."""

    def __init__(self, out: str | Path):
        self.folder = Path(out) / "wandb"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file = self.folder / WANDB_STATE
        state = json.loads(self.file.read_text()) if self.file.is_file() else {}
        self.run_id = state.get("id") or secrets.token_hex(6)
        self.last_step = int(state.get("last_step", 0))
        self.save()

    def save(self) -> None:
        tmp = self.file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"id": self.run_id, "last_step": self.last_step}))
        os.replace(tmp, self.file)

    def take(self, step: int) -> bool:
        """True (and the step recorded) when W&B does not hold ``step`` yet: one sent before a crash after the last
        checkpoint is not sent again."""
        if step <= self.last_step:
            return False
        self.last_step = step
        self.save()
        return True


class WandbSink:
    """A Weights & Biases run (``wandb.init``: project, name, entity, mode online | offline, files under
    ``<out>/wandb``), resumed under the id of :class:`WandbSteps` (``resume="allow"``)."""

    def __init__(self, out: str | Path, project: str, name: str, mode: str, entity: str | None = None,
                 config: dict | None = None):
        import wandb

        self.steps = WandbSteps(out)
        self.run = wandb.init(project=project, name=name, entity=entity, mode=mode, dir=str(out),
                              id=self.steps.run_id, resume="allow", config=config)

    def describe(self) -> str:
        return f"W&B run {self.steps.run_id} ({self.run.settings.mode}, files in {self.steps.folder})"

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        if self.steps.take(step):
            self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits for W&B's service to write out the run (offline: its run file) before returning


class LightningLoggerSink:
    """One of the PyTorch Lightning loggers that NeMo's ``exp_manager`` attached to the trainer (the NeMo-Aligner
    path): ``log_metrics(scalars, step)`` then ``save()`` (TensorBoardLogger: a flush). ``wandb_steps``: for its
    WandbLogger, the :class:`WandbSteps` of the run (steps W&B holds are not sent again)."""

    def __init__(self, logger, wandb_steps: WandbSteps | None = None):
        self.logger, self.wandb_steps = logger, wandb_steps

    def describe(self) -> str:
        where = getattr(self.logger, "log_dir", None) or getattr(self.logger, "save_dir", None)
        return f"NeMo exp_manager {type(self.logger).__name__} ({where})"

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        if self.wandb_steps is not None and not self.wandb_steps.take(step):
            return
        self.logger.log_metrics(dict(scalars), step=step)
        self.logger.save()

    def close(self) -> None:
        self.logger.finalize("success")


def build_sinks(cfg, resume_step: int) -> list[MetricSink]:
    """The dashboards ``cfg.logging`` asks for, opened to continue after step ``resume_step`` (rank 0 only)."""
    sinks: list[MetricSink] = []
    lg = cfg.logging
    if tensorboard_enabled(lg):
        sinks.append(TensorBoardSink(tensorboard_dir(cfg), resume_step))
    if lg.wandb:
        sinks.append(WandbSink(cfg.run.output_dir, lg.wandb_project, lg.wandb_name or cfg.run.name, lg.wandb_mode,
                               lg.wandb_entity, config=to_dict(cfg)))
    return sinks


def nemo_logger_settings(cfg, resume_step: int, rank: int = 0) -> dict[str, Any]:
    """The ``exp_manager`` keys of NeMo's config (nemo/utils/exp_manager.py, ExpManagerConfig) that make NeMo
    create the dashboards ``cfg.logging`` asks for.

    TensorBoard: NeMo's TensorBoardLogger, built as ``TensorBoardLogger(save_dir=<log dir>, name, version,
    **summary_writer_kwargs)`` (exp_manager.py, ``configure_loggers``). At every start exp_manager moves the
    *files* of its log dir into ``run_<n>/`` (exp_manager.py, ``check_resume``), which would give each restart
    its own TensorBoard run; the events therefore go to the folder ``sub_dir`` below it (Lightning's
    TensorBoardLogger, pytorch/loggers/tensorboard.py, ``log_dir``): ``<output_dir>/nemo_logs/tensorboard``, or
    ``logging.tensorboard_dir``. The other keys reach torch's SummaryWriter: ``purge_step`` (:func:`purge_step`).
    W&B: NeMo's WandbLogger, whose ``wandb_logger_kwargs`` go to ``wandb.init``: the run id of
    :class:`WandbSteps`, resumed, files under ``<output_dir>/wandb``. Only rank 0 logs, so only rank 0 reads or
    creates the run id (other ranks' loggers never start a W&B run)."""
    lg = cfg.logging
    out = Path(cfg.run.output_dir)
    sub_dir = str(Path(lg.tensorboard_dir).resolve()) if lg.tensorboard_dir else "tensorboard"
    settings: dict[str, Any] = {
        "explicit_log_dir": str(out / "nemo_logs"),
        "create_tensorboard_logger": tensorboard_enabled(lg),
        "summary_writer_kwargs": {"sub_dir": sub_dir, "purge_step": purge_step(resume_step)},
        "create_wandb_logger": bool(lg.wandb),
    }
    if lg.wandb:
        settings["wandb_logger_kwargs"] = {
            "project": lg.wandb_project, "name": lg.wandb_name or cfg.run.name, "entity": lg.wandb_entity,
            "offline": lg.wandb_mode == "offline", "save_dir": str(out),
            "id": WandbSteps(out).run_id if rank == 0 else None, "resume": "allow"}
    return settings


def nemo_sinks(loggers, cfg) -> list[MetricSink]:
    """Sinks over the Lightning loggers NeMo's exp_manager attached (``trainer.loggers``)."""
    sinks: list[MetricSink] = []
    for logger in loggers:
        is_wandb = type(logger).__name__ == "WandbLogger"
        sinks.append(LightningLoggerSink(logger, WandbSteps(cfg.run.output_dir) if is_wandb else None))
    return sinks


def format_duration(seconds: float) -> str:
    """``75`` -> ``1m15s``, ``3725`` -> ``1h02m``, ``9`` -> ``9s``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class ProgressClock:
    """ETA of a loop from its measured mean step time: ``(elapsed / steps done) * steps left``, counted from
    the step this process started at (a resumed run does not count the steps it did not run)."""

    def __init__(self, start_step: int, total: int):
        self.start_step, self.total = int(start_step), int(total)
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def eta(self, step: int) -> str:
        done = step - self.start_step
        if done <= 0:
            return "?"
        return format_duration(self.elapsed() / done * max(self.total - step, 0))


class MetricsWriter:
    """Metric sinks of one rank.

    out: ``run.output_dir``.
    rank, dp_rank: this process's global and data-parallel ranks (rank 0 writes ``metrics.jsonl``, prints the
        progress line and feeds the dashboards).
    num_steps, log_every: the progress line is printed every ``log_every`` steps and at the last step.
    """

    def __init__(self, out: Path, rank: int, dp_rank: int, num_steps: int, log_every: int):
        self.out, self.rank, self.dp_rank = Path(out), int(rank), int(dp_rank)
        self.num_steps, self.log_every = int(num_steps), int(log_every)
        self.is_logger = self.rank == 0
        self.sinks: list[MetricSink] = []
        self.clock = ProgressClock(0, self.num_steps)

    def start(self, resume_step: int, sinks: list[MetricSink] | None = None, checkpoint: Path | None = None):
        """At the start of training (after step ``resume_step`` was restored from ``checkpoint``): ``metrics.jsonl``
        keeps rows 1..resume_step (:meth:`truncate`), the ETA counts from here, ``sinks`` (rank 0) receive every
        later row."""
        self.truncate(resume_step, checkpoint)
        self.clock = ProgressClock(resume_step, self.num_steps)
        if self.is_logger:
            self.sinks = list(sinks or [])
            if self.sinks:
                print("dashboards: " + "; ".join(sink.describe() for sink in self.sinks), flush=True)

    def write(self, m: dict[str, Any]):
        """Append the step's row to ``metrics.jsonl``, send it to the dashboards and print the progress line
        (rank 0)."""
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
        scalars, texts = split_row(m)
        for sink in self.sinks:
            sink.log(int(m["step"]), scalars, texts)
        if m["step"] % self.log_every == 0 or m["step"] == self.num_steps:
            print(
                f"step {m['step']:>4}/{self.num_steps} | lambda {m['lambda']:.4f} | "
                f"mean_len {m['mean_response_length']:7.1f} (B {m['budget']:.0f}) | "
                f"task_reward {m['task_reward']:.3f} | over_budget {m['frac_over_budget']:.2f} | "
                f"{m['step_seconds']:.2f}s | eta {self.clock.eta(int(m['step']))}",
                flush=True,
            )

    def close(self):
        """Flush and close the dashboards (rank 0)."""
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def rank_trace(self, m: dict[str, Any]):
        """This rank's lambda, next lambda, mean length and the constraints' multipliers and measured values of the
        step as exact float hex strings."""
        folder = self.out / "rank_trace"
        folder.mkdir(parents=True, exist_ok=True)
        row = {"step": m["step"], "rank": self.rank, "dp_rank": self.dp_rank,
               "lambda": float(m["lambda"]).hex(), "lambda_next": float(m["lambda_next"]).hex(),
               "mean_response_length": float(m["mean_response_length"]).hex()}
        # the constraints' multipliers and measured values (laconic/...), null where a class had no response
        row.update({k: None if v is None else float(v).hex() for k, v in m.items() if k.startswith("laconic/")})
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
