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
``<output_dir>/wandb/laconic_run.json``). A step counts as sent only once W&B holds it durably: W&B's service
keeps what it is sent in memory (offline: its run file grows in 32 KiB blocks and at the run's end), so a
kill -9 loses the steps it had not written out. Each session therefore starts from what W&B holds
(:meth:`WandbSteps.held`: the steps in the run files of the earlier offline sessions of the run, or the online
run's ``starting_step``), re-sends every row of ``metrics.jsonl`` after that step (:meth:`WandbSink.catch_up`)
and sends each later step once (W&B refuses to rewrite a step): on CPU the recomputed steps are equal bit for
bit, on GPU the first write of those few steps stays in W&B while metrics.jsonl and TensorBoard hold the later one.

A dashboard never costs a step or a run: a dashboard that cannot be opened or written (a folder that cannot
be written, a full disk, W&B's service gone) is named once on the console and in the run notes of
``metrics.jsonl`` (the ``notes`` list of the row of the step when it failed: what, where and why), left out for
the rest of the session, and training goes on; ``laconic-nemo train`` checks the folders before it starts
(:func:`laconic_nemo.plan.preflight.check_dashboard_dirs`). W&B, which does not report a write it could not make,
is checked by :class:`WandbSink` itself (:mod:`laconic_nemo.grpo.wandb_writes`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import struct
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Iterator, Protocol

from laconic_nemo.config import ConfigError, to_dict
from laconic_nemo.grpo.wandb_writes import LogWriteErrors, no_space
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

        _quiet_writer_threads()
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


def wandb_dir(out: str | Path) -> Path:
    """Where the W&B files of a run go: ``<run.output_dir>/wandb`` (the run id's file and the offline runs)."""
    return Path(out) / "wandb"


def _wandb_log_records(data: bytes) -> Iterator[bytes]:
    """The records of a W&B run file: a 7-byte header, then the leveldb log format (32 KiB blocks; each piece a
    7-byte header CRC-32 u32, length u16, type u8 FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4, then its bytes). Stops
    at the first piece that is cut short or fails its CRC-32 (the tail of a file whose writer was killed)."""
    block, pos, parts = 32768, 7, []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's zero trailer
            pos += room
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        body = data[pos + 7: pos + 7 + length]
        if kind == 0 and length == 0:  # the zero-filled rest of a block
            pos += room
            continue
        if len(body) < length or zlib.crc32(bytes([kind]) + body) & 0xFFFFFFFF != crc:
            return
        pos += 7 + length
        parts = [body] if kind in (1, 2) else parts + [body]
        if kind in (1, 4):
            yield b"".join(parts)
            parts = []


def wandb_offline_steps(folder: str | Path, run_id: str, key: str | None = None) -> list[int]:
    """The steps that the offline W&B runs of ``run_id`` under ``folder`` (``offline-run-*-<id>/run-<id>.wandb``)
    hold on disk: each history record's step (``key``: the value it logged under that name instead, as NeMo's
    WandbLogger logs ``trainer/global_step``)."""
    from wandb.proto import wandb_internal_pb2

    steps = []
    for f in sorted(Path(folder).glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        data = f.read_bytes()
        if not data.startswith(b":W&B"):
            continue
        for payload in _wandb_log_records(data):
            rec = wandb_internal_pb2.Record()
            try:
                rec.ParseFromString(payload)
            except Exception:  # protobuf's DecodeError: not a record of this wandb version
                continue
            if rec.WhichOneof("record_type") != "history":
                continue
            if key is None:
                steps.append(int(rec.history.step.num))
                continue
            for item in rec.history.item:
                if (item.key or "/".join(item.nested_key)) == key:
                    steps.append(int(float(json.loads(item.value_json))))
    return steps


def _quiet_writer_threads() -> None:
    """Keep the traceback of TensorBoard's writer thread off the console: the thread keeps the error it dies of
    (a folder that cannot be written, a full disk) and the writer raises it again in the training process at the
    next write or flush, where :class:`MetricsWriter` names it once; Python would also print the thread's own
    copy. Other threads' errors are printed as before."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args):
        if type(args.thread).__name__ != "_AsyncWriterThread":  # tensorboard/summary/writer/event_file_writer.py
            previous(args)

    hook.quiets_tensorboard = True
    threading.excepthook = hook


class WandbSteps:
    """The W&B run of an output dir: its id, in ``<out>/wandb/laconic_run.json`` (a resumed run continues the same
    run), and the last step W&B holds, from W&B's own files or server (:meth:`held`), never from what this
    process handed W&B's service: a step is sent when it is past that step, so none is sent twice and none is
    lost with a killed process (the next session sends it again).

    key: the name under which the logger records the step (None: W&B's own step, as :class:`WandbSink` logs it;
    NeMo's WandbLogger: ``trainer/global_step``)."""

    def __init__(self, out: str | Path, key: str | None = None):
        self.folder = wandb_dir(out)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file = self.folder / WANDB_STATE
        self.key = key
        state = json.loads(self.file.read_text()) if self.file.is_file() else {}
        self.run_id = state.get("id") or secrets.token_hex(6)
        self.last_step = 0
        tmp = self.file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"id": self.run_id}))
        os.replace(tmp, self.file)

    def held(self, starting_step: int = 0) -> int:
        """The last step W&B holds: the newest step on disk in the run's earlier offline sessions, or the online
        run's ``starting_step`` - 1 (W&B's server says where the resumed run continues), whichever is later. Also
        where this session starts counting (:meth:`take`)."""
        on_disk = wandb_offline_steps(self.folder, self.run_id, self.key)
        self.last_step = max([int(starting_step) - 1, 0, *on_disk])
        return self.last_step

    def take(self, step: int) -> bool:
        """True (and the step counted) when W&B does not hold ``step`` yet and this session has not sent it."""
        if step <= self.last_step:
            return False
        self.last_step = step
        return True


class WandbSink:
    """A Weights & Biases run (``wandb.init``: project, name, entity, mode online | offline, files under
    ``<out>/wandb``), resumed under the id of :class:`WandbSteps` (``resume="allow"``).

    W&B does not say when it cannot write its files (:mod:`laconic_nemo.grpo.wandb_writes`): the sink checks after
    opening the run and before each step it hands W&B that its own log met no write error and its folder has space
    left, and raises the OSError otherwise (:class:`MetricsWriter` names it once and :meth:`abandon` s the run); W&B's
    log errors never reach the console."""

    def __init__(self, out: str | Path, project: str, name: str, mode: str, entity: str | None = None,
                 config: dict | None = None):
        import wandb

        self.log_errors = LogWriteErrors.install()
        self.seen = len(self.log_errors.errors)  # errors of an earlier run of this process are not this one's
        self.steps = WandbSteps(out)
        self.run = wandb.init(project=project, name=name, entity=entity, mode=mode, dir=str(out),
                              id=self.steps.run_id, resume="allow", config=config)
        try:
            self.check()
        except OSError:
            self.abandon()
            raise
        self.steps.held(int(getattr(self.run, "starting_step", 0) or 0))

    def describe(self) -> str:
        return f"W&B run {self.steps.run_id} ({self.run.settings.mode}, files in {self.steps.folder})"

    def check(self) -> None:
        """Raise the OSError W&B's log met writing since this run started, or ENOSPC when W&B's folder is full."""
        error = self.log_errors.since(self.seen) or no_space(self.steps.folder)
        if error is not None:
            raise error

    def catch_up(self, rows: list[dict[str, Any]]) -> list[int]:
        """Send the rows of ``metrics.jsonl`` (the steps this session resumes after) that W&B does not hold: the
        steps a killed session handed W&B's service but W&B never wrote out. Returns the steps sent."""
        return _catch_up(self, self.steps, rows)

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        self.check()
        if self.steps.take(step):
            self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits for W&B's service to write out the run (offline: its run file) before returning
        self.check()

    def abandon(self) -> None:
        """End the run of a sink that failed, quietly (it was named once; what W&B meets now is not news)."""
        import wandb

        for end in (self.run.finish, wandb.teardown):
            try:
                end()
            except Exception:  # noqa: BLE001 - the sink is left out already
                pass


class FailedSink:
    """A dashboard that could not be opened: ``describe`` names it, ``error`` says why; :class:`MetricsWriter`
    names it once and leaves it out."""

    def __init__(self, what: str, error: BaseException):
        self.what, self.error = what, error

    def describe(self) -> str:
        return self.what

    def log(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        raise self.error

    def close(self) -> None:
        pass


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

    def catch_up(self, rows: list[dict[str, Any]]) -> list[int]:
        """W&B only: the rows W&B does not hold (as :meth:`WandbSink.catch_up`)."""
        return [] if self.wandb_steps is None else _catch_up(self, self.wandb_steps, rows)


def _catch_up(sink: MetricSink, steps: WandbSteps, rows: list[dict[str, Any]]) -> list[int]:
    """Log through ``sink`` the ``rows`` past the last step W&B holds (``steps``), in step order; their steps."""
    todo = [r for r in sorted(rows, key=lambda r: r["step"]) if int(r["step"]) > steps.last_step]
    for row in todo:
        sink.log(int(row["step"]), *split_row(row))
    return [int(r["step"]) for r in todo]

    def close(self) -> None:
        self.logger.finalize("success")


def build_sinks(cfg, resume_step: int) -> list[MetricSink]:
    """The dashboards ``cfg.logging`` asks for, opened to continue after step ``resume_step`` (rank 0 only). One
    that cannot be opened comes back as a :class:`FailedSink` (training goes on without it)."""
    sinks: list[MetricSink] = []
    lg = cfg.logging
    if tensorboard_enabled(lg):
        try:
            sinks.append(TensorBoardSink(tensorboard_dir(cfg), resume_step))
        except Exception as exc:  # noqa: BLE001 - a dashboard never costs the run
            sinks.append(FailedSink(f"TensorBoard {tensorboard_dir(cfg)}", exc))
    if lg.wandb:
        try:
            sinks.append(WandbSink(cfg.run.output_dir, lg.wandb_project, lg.wandb_name or cfg.run.name,
                                   lg.wandb_mode, lg.wandb_entity, config=to_dict(cfg)))
        except Exception as exc:  # noqa: BLE001
            sinks.append(FailedSink(f"W&B run (files in {wandb_dir(cfg.run.output_dir)})", exc))
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
            "id": WandbSteps(out, key=NEMO_STEP_KEY).run_id if rank == 0 else None, "resume": "allow"}
    return settings


NEMO_STEP_KEY = "trainer/global_step"  # where Lightning's WandbLogger records the step it is given


def nemo_sinks(loggers, cfg) -> list[MetricSink]:
    """Sinks over the Lightning loggers NeMo's exp_manager attached (``trainer.loggers``)."""
    sinks: list[MetricSink] = []
    for logger in loggers:
        steps = None
        if type(logger).__name__ == "WandbLogger":
            steps = WandbSteps(cfg.run.output_dir, key=NEMO_STEP_KEY)
            steps.held()
        sinks.append(LightningLoggerSink(logger, steps))
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
        self.notes: list[str] = []  # run notes not yet in a row of metrics.jsonl

    def start(self, resume_step: int, sinks: list[MetricSink] | None = None, checkpoint: Path | None = None):
        """At the start of training (after step ``resume_step`` was restored from ``checkpoint``): ``metrics.jsonl``
        keeps rows 1..resume_step (:meth:`truncate`), the ETA counts from here, ``sinks`` (rank 0) receive every
        later row; a sink that can catch up (W&B) first receives the kept rows it does not hold."""
        rows = self.truncate(resume_step, checkpoint)
        self.clock = ProgressClock(resume_step, self.num_steps)
        if not self.is_logger:
            return
        self.sinks = []
        for sink in sinks or []:
            if isinstance(sink, FailedSink):
                self._failed(sink, "could not be opened", sink.error, resume_step + 1)
            else:
                self.sinks.append(sink)
        if self.sinks:
            print("dashboards: " + "; ".join(sink.describe() for sink in self.sinks), flush=True)
        for sink in list(self.sinks):
            if rows and hasattr(sink, "catch_up"):
                try:
                    sent = sink.catch_up(rows)
                except Exception as exc:  # noqa: BLE001 - a dashboard never costs the run
                    self._failed(sink, "failed re-sending the steps it lacks", exc, resume_step + 1)
                    continue
                if sent:
                    print(f"{sink.describe()}: re-sent step{'s' if len(sent) > 1 else ''} {_span(sent)} from "
                          f"{self.out / 'metrics.jsonl'} (it did not hold them)", flush=True)

    def _failed(self, sink: MetricSink, what: str, exc: BaseException, step: int) -> None:
        """Name a dashboard that failed, once (console and the run notes), and leave it out from here on (one that
        holds a run, W&B, ends it quietly)."""
        note = (f"dashboard {sink.describe()} {what} at step {step}: {type(exc).__name__}: {exc}; training goes on "
                "without it for the rest of this session")
        print(f"laconic-nemo train: {note}", file=sys.stderr, flush=True)
        self.notes.append(note)
        if sink in self.sinks:
            self.sinks.remove(sink)
            if hasattr(sink, "abandon"):
                sink.abandon()

    def write(self, m: dict[str, Any]):
        """Send the step's row to the dashboards, append it to ``metrics.jsonl`` (with the run notes of this step,
        ``notes``: a dashboard that failed) and print the progress line (rank 0)."""
        if not self.is_logger:
            return
        scalars, texts = split_row(m)
        for sink in list(self.sinks):
            try:
                sink.log(int(m["step"]), scalars, texts)
            except Exception as exc:  # noqa: BLE001 - a dashboard never costs the run
                self._failed(sink, "failed writing", exc, int(m["step"]))
        if self.notes:
            m = {**m, "notes": self.notes}
            self.notes = []
        line = json.dumps(m) + "\n"
        with (self.out / "metrics.jsonl").open("a") as f:
            action = armed("metrics_torn", m["step"])
            if action is not None:  # fault injection: a row cut short by a crash
                f.write(line[: len(line) // 2])
                f.flush()
                fire(action)
            f.write(line)
        if m["step"] % self.log_every == 0 or m["step"] == self.num_steps:
            lam, budgets = multipliers_text(m)
            print(
                f"step {m['step']:>4}/{self.num_steps} | {lam} | "
                f"mean_len {m['mean_response_length']:7.1f} (B {budgets or format(m['budget'], '.0f')}) | "
                f"task_reward {m['task_reward']:.3f} | over_budget {m['frac_over_budget']:.2f} | "
                f"{m['step_seconds']:.2f}s | eta {self.clock.eta(int(m['step']))}",
                flush=True,
            )

    def close(self):
        """Flush and close the dashboards (rank 0); one that fails to is named on the console."""
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - the run's steps are done: say so and go on
                print(f"laconic-nemo train: dashboard {sink.describe()} failed closing: {type(exc).__name__}: {exc}",
                      file=sys.stderr, flush=True)
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

    def truncate(self, upto_step: int, checkpoint: Path | None = None) -> list[dict]:
        """Keep the rows of the steps the resumed ``checkpoint`` holds; drop a torn last row (a crash while it
        was written); refuse any other corrupt line, naming the file and the line. When the file lacks a row
        of steps 1..``upto_step`` (removed, or cut short), the rows come back from the checkpoint's copy.
        Returns the rows kept (rank 0)."""
        from laconic_nemo.grpo.resume import METRICS_COPY, ResumeError, missing_steps, read_metrics

        path = self.out / "metrics.jsonl"
        if not self.is_logger or (not path.is_file() and not upto_step):
            return []
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
        kept = [r for r in rows if r["step"] <= upto_step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
        return kept


CLASS_LAMBDA = "laconic/lambda/class_"  # a budget class's multiplier in a row (core.constraints.Constraints.step)
MU_TAIL = "laconic/mu_tail"
LISTED_CLASSES = 4  # more classes than this are shown as the range of their multipliers and budgets


def multipliers_text(row: dict[str, Any], digits: int = 4) -> tuple[str, str | None]:
    """The multipliers of a row (or of a resumed run's constraints, named as in a row) for a console line, and the
    budgets they hold: ``("lambda 0.1234", None)`` for lambda alone (its budget is the row's ``budget``); with
    budget classes (lambda is then unused) each class's multiplier and the classes' budgets, ``("lambda 22:0.1234
    40:0.0000", "22, 40")``, or over more than :data:`LISTED_CLASSES` classes their range, ``("lambda
    0.0000..0.5123 over 6 classes", "16-40")``; ``mu`` of a tail constraint after them."""
    classes = {k[len(CLASS_LAMBDA):]: float(v) for k, v in row.items() if k.startswith(CLASS_LAMBDA)}
    if not classes:
        text, budgets = f"lambda {float(row['lambda']):.{digits}f}", None
    elif len(classes) <= LISTED_CLASSES:
        text = "lambda " + " ".join(f"{name}:{v:.{digits}f}" for name, v in classes.items())
        budgets = ", ".join(classes)
    else:
        lo, hi = min(classes.values()), max(classes.values())
        text = f"lambda {lo:.{digits}f}..{hi:.{digits}f} over {len(classes)} classes"
        edges = [float(x) for name in classes for x in name.split("-")]  # a class key: its budget, or its bin lo-hi
        budgets = f"{min(edges):g}-{max(edges):g}"
    if row.get(MU_TAIL) is not None:
        text += f" | mu {float(row[MU_TAIL]):.{digits}f}"
    return text, budgets


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
