"""What a run may resume from, read without torch: complete checkpoints, ``metrics.jsonl``, config changes.

Used by the launcher's pre-flight checks (before any rank starts) and by the trainer itself (every
rank, also under torchrun / srun), so both decide alike.

* A checkpoint counts only once it is complete: a folder ``step_NNNNNN`` (renamed from its ``.tmp``
  after every rank wrote its files) holding ``trainer_state.json``. ``latest`` is a hint; a
  ``latest`` naming a missing folder is ignored.
* ``metrics.jsonl`` has one JSON object per line. A last line without its newline that does not
  parse is a row torn by a crash: it is dropped (the step is recomputed after resume). Any other
  line that does not parse is corruption, refused with the file and the 1-based line named.
* A resumed run must use the checkpoint's configuration: every key of the resolved config is
  compared, every difference is listed, and resume is refused unless each differing key is
  operational (:data:`ALWAYS_ALLOWED`) or named in ``checkpoint.resume_allow_changes``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

STEP_DIR = re.compile(r"^step_(\d{6,})$")

# Keys that may change between a checkpoint and its resumption without changing what is trained:
# run length, logging, checkpoint bookkeeping, the warm-up (already done when a checkpoint exists),
# timeouts, grading workers. Exact keys, or prefixes ending in ".".
ALWAYS_ALLOWED = (
    "run.num_steps", "run.log_every", "run.name", "run.output_dir", "logging.", "checkpoint.", "warmup.",
    "reward.num_workers", "parallel.collective_timeout_s", "parallel.watchdog_s",
)
# Keys derived from the task at start-up rather than set by the user.
DERIVED = ("model.vocab_size",)


class ResumeError(ValueError):
    """The output folder cannot be resumed as asked; the message names the file, line or key."""


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root`` (``<output_dir>/checkpoints``), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def find_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``resume: auto`` continues from: ``latest`` when it names a complete one, else the
    newest complete one, else None. Incomplete ``.tmp`` folders are never chosen."""
    root = Path(root)
    latest = root / "latest"
    if latest.is_file():
        name = latest.read_text().strip()
        if STEP_DIR.match(name) and (root / name / "trainer_state.json").is_file():
            return root / name
    done = complete_checkpoints(root)
    return done[-1] if done else None


def read_trainer_state(ckpt: str | Path) -> dict:
    path = Path(ckpt) / "trainer_state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResumeError(f"{path}: unreadable checkpoint state ({exc}); remove that checkpoint folder "
                          "to resume from an older one") from exc


def read_metrics(path: str | Path) -> tuple[list[dict], bool]:
    """(rows, torn): the rows of ``metrics.jsonl`` and whether a torn last line was left out.

    Raises ResumeError naming the file and the 1-based line for any other line that is not a JSON
    object with an integer ``step``."""
    path = Path(path)
    if not path.is_file():
        return [], False
    text = path.read_text()
    lines = text.split("\n")
    rows, torn = [], False
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a JSON object with an integer 'step'")
        except ValueError as exc:
            if i == len(lines) and not text.endswith("\n"):
                torn = True  # the last row was being written when the run died
                continue
            raise ResumeError(f"{path} line {i}: corrupt metrics row ({exc}); a complete file has one JSON "
                              "object per line - repair or remove that line") from exc
        rows.append(row)
    return rows, torn


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _allowed(key: str, allow: list[str]) -> bool:
    return any(key == a or (a.endswith(".") and key.startswith(a)) for a in (*ALWAYS_ALLOWED, *allow)) or any(
        key.startswith(a + ".") for a in allow)


def config_differences(saved: dict, now: dict, defaults: dict | None = None) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint value, this run's value) for every resolved key that differs. A key missing from
    the checkpoint's config (written before the key existed) counts with its ``defaults`` value."""
    a, b = _flatten(saved), _flatten(now)
    if defaults:
        for k, v in _flatten(defaults).items():
            a.setdefault(k, v)
    missing = object()
    return [(k, a.get(k, missing), b[k]) for k in sorted(b)
            if k not in DERIVED and a.get(k, missing) != b[k]]


def check_resume_config(ckpt: str | Path, saved: dict, now: dict, allow: list[str],
                        defaults: dict | None = None) -> list[tuple[str, Any, Any]]:
    """Raise ResumeError listing every difference not allowed; return the allowed ones."""
    diffs = config_differences(saved, now, defaults)
    refused = [d for d in diffs if not _allowed(d[0], allow)]
    if refused:
        lines = "\n".join(f"  {k}: checkpoint {_show(old)} -> this run {_show(new)}" for k, old, new in refused)
        keys = ",".join(k for k, _, _ in refused)
        raise ResumeError(
            f"cannot resume from {ckpt}: this run's config differs from the checkpoint's in {len(refused)} "
            f"key(s):\n{lines}\nResume with the checkpoint's values, or accept the change with "
            f"checkpoint.resume_allow_changes=[{keys}], or start a fresh run in another run.output_dir.")
    return diffs


def _show(v: Any) -> str:
    return "(absent)" if not isinstance(v, (str, int, float, bool, list, dict, type(None))) else json.dumps(v)


def resume_source(cfg: DictConfig) -> Path | None:
    """The checkpoint this run resumes from (None: a fresh start); ConfigError when that is not possible."""
    from laconic_nemo.config import ConfigError

    out = Path(str(cfg.run.output_dir))
    mode = str(cfg.checkpoint.resume)
    if mode == "never":
        used = [p for p in (out / "metrics.jsonl",) if p.is_file() and p.stat().st_size > 0]
        used += complete_checkpoints(out / "checkpoints")
        if used:
            raise ConfigError(
                f"checkpoint.resume = 'never' but run.output_dir = {str(out)!r} already holds a run "
                f"({', '.join(p.name for p in used[:3])}): a fresh run there would mix the two. Choose another "
                "run.output_dir, move the old run aside, or resume it with checkpoint.resume=auto")
        return None
    if mode == "auto":
        return find_checkpoint(out / "checkpoints")
    p = Path(mode)
    if not (p / "trainer_state.json").is_file() or p.name.endswith(".tmp"):
        raise ConfigError(f"checkpoint.resume = {mode!r} is invalid: allowed auto, never or a complete checkpoint "
                          "folder (step_NNNNNN holding trainer_state.json)")
    return p
