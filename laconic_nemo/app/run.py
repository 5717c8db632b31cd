"""One run of GRPO + LACONIC, shared by both entry points: ``run(trainer, task)``.

The entry point (:mod:`laconic_nemo.app.train_cli` for the megatron-core actor, :mod:`laconic_nemo.app.nemo_entry`
for the NeMo-Aligner actor) initialises torch.distributed, holds ``run.output_dir``, builds the actor, the
:class:`~laconic_nemo.app.task.Task` and the :class:`~laconic_nemo.grpo.trainer.GRPOTrainer` (handing it the typed
config); :func:`run` then warms up the policy when the recipe asks for it and no checkpoint is resumed,
trains, and prints the closing summary (and the curves).
"""

from __future__ import annotations

import sys
from pathlib import Path

from laconic_nemo.app.task import Task
from laconic_nemo.grpo.checkpoint import barrier
from laconic_nemo.grpo.trainer import OOM_EXIT, GRPOTrainer, TrainingOutOfMemory, summarize
from laconic_nemo.runtime.faults import heartbeat


def run(trainer: GRPOTrainer, task: Task, early_signal: int | None = None) -> int:
    """Train ``trainer.actor`` on ``task`` for ``run.num_steps`` steps (every rank, SPMD), the warm-up first.

    early_signal: a SIGUSR1 / SIGTERM / SIGINT received before the trainer's handler was installed.

    Returns 0 when the run finished (whatever signal arrives after its last checkpoint), 3 when it stopped on a
    signal (after a checkpoint, or before the first step), 5 (:data:`~laconic_nemo.grpo.trainer.OOM_EXIT`) when a
    step ran out of device memory (its last line names the memory model's prediction and the keys to change).
    """
    cfg, actor = trainer.cfg, trainer.actor
    is_logger = trainer.is_logger

    def log(msg: str):
        if is_logger:
            print(msg, flush=True)

    stop = trainer.stop
    stop.install(early=early_signal)
    if stop.requested():
        log("stopped on a signal during start-up; nothing to save yet")
        return 3
    if cfg.warmup.num_steps > 0 and trainer.find_resume_checkpoint() is None:
        from laconic_nemo.app.warmup import warm_up

        if not warm_up(cfg, actor, task.warmup_example, task.pad_id, trainer.rank, log, stop.requested):
            log("stopped on a signal during the warm-up; its progress is saved and a rerun continues it")
            return 3
        if stop.requested():
            log("stopped on a signal after the warm-up; the warmed-up policy is cached")
            return 3
    heartbeat("resume")
    try:
        status = trainer.fit()
    except TrainingOutOfMemory as exc:  # this rank's last line; the other ranks stop at their next collective
        print(str(exc), file=sys.stderr, flush=True)
        return OOM_EXIT
    if status == "finished" and cfg.checkpoint.export_hf:
        # the final checkpoint as a Hugging Face folder <output_dir>/hf (rank 0)
        heartbeat("export_hf", trainer.step)
        if is_logger:
            from laconic_nemo.tools.export import export_hf

            ckpt = export_hf(trainer.out, trainer.out / "hf")
            print(f"exported {ckpt} as a Hugging Face model to {trainer.out / 'hf'}", flush=True)
        barrier()
    heartbeat("finish")
    if is_logger:
        from laconic_nemo.grpo.resume import read_metrics

        # the whole run, also the steps before a resume
        rows, _ = read_metrics(Path(cfg.run.output_dir) / "metrics.jsonl")
        if rows:
            s = summarize(rows)
            log("summary: " + ", ".join(f"{k} {v:.4f}" for k, v in s.items()))
        if rows and cfg.logging.plot:
            from laconic_nemo.app.plots import plot_training_curves

            png = plot_training_curves(Path(cfg.run.output_dir) / "metrics.jsonl",
                                       Path(cfg.run.output_dir) / "training_curves.png",
                                       title=f"{cfg.run.name}: shaper {cfg.laconic.shaper}, B={cfg.laconic.budget}")
            log(f"wrote {png}")
    if status != "finished":
        return 3
    # Finished: a stop signal from here on has nothing to stop (status 0 even while the interpreter exits).
    stop.ignore()
    return 0
