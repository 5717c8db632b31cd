"""What a run may resume from, read without torch: complete checkpoints, ``metrics.jsonl``, config changes.

Used by the launcher's pre-flight checks (before any rank starts) and by the trainer itself (every
rank, also under torchrun / srun), so both decide alike.

* A checkpoint counts only once it is complete: a folder ``step_NNNNNN`` (renamed from its ``.tmp``
  after every rank wrote and fsynced its files) holding ``trainer_state.json``. ``latest`` is a hint; a
  ``latest`` naming a missing folder is ignored.
* A complete checkpoint is also intact: every file its ``manifest.json`` lists (written last, before
  the rename) has the listed size (:func:`damage`; the ranks also compare each file's CRC-32 when they
  load it). A damaged one (a file cut short or emptied, as a power cut can leave one on a file system
  that lost unsynced data) is skipped for the newest intact one before it, and the skip is reported.
  Checkpoints written before manifests existed count as intact unless a file of theirs is empty.
* A complete checkpoint's ``trainer_state.json`` also holds sound values (:func:`state_problem`: the step, the
  shaper's and every constraint's multipliers, numbers where numbers belong; the constraint state its own config
  asks for). One that does not (an edit with its manifest updated to match) is skipped like a damaged one, with
  the file and the key named; with no intact checkpoint before it the resume is refused (ResumeError naming the
  folder, the file and the key) rather than started over.
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
from typing import Any, Callable

from laconic_nemo.config import Config, ConfigError, build_config
from laconic_nemo.core import classes_state_problem, shaper_problem, tail_state_problem

STEP_DIR = re.compile(r"^step_(\d{6,})$")
MANIFEST = "manifest.json"
METRICS_COPY = "metrics.jsonl"  # the run's metrics rows up to the checkpoint's step, kept in the step folder

# Keys that may change between a checkpoint and its resumption without changing what is trained:
# run length, logging, checkpoint bookkeeping, the warm-up (already done when a checkpoint exists),
# timeouts, grading workers. Exact keys, or prefixes ending in ".".
ALWAYS_ALLOWED = (
    "run.num_steps", "run.log_every", "run.name", "run.output_dir", "logging.", "checkpoint.", "warmup.",
    "reward.num_workers", "parallel.collective_timeout_s", "parallel.watchdog_s", "parallel.watchdog_step_factor",
    "parallel.watchdog_min_s",
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


def read_manifest(ckpt: str | Path) -> dict | None:
    """``{file name: {"size", "crc32"}}`` of ``ckpt``'s manifest; None when it has none (an older checkpoint).
    Raises ResumeError when the manifest itself is unreadable."""
    path = Path(ckpt) / MANIFEST
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_bytes().decode("utf-8"))["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not a mapping")
        return files
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ResumeError(f"{path}: unreadable manifest ({exc})") from None


def damage(ckpt: str | Path) -> str | None:
    """Why the complete checkpoint ``ckpt`` is damaged (the file and what is wrong), or None when every file
    of its manifest is present with its size (without a manifest: when no file of it is empty)."""
    ckpt = Path(ckpt)
    try:
        files = read_manifest(ckpt)
    except ResumeError as exc:
        return str(exc)
    if files is None:
        empty = sorted(p.name for p in ckpt.iterdir() if p.is_file() and p.stat().st_size == 0)
        return f"{ckpt / empty[0]} is empty" if empty else None
    for name, meta in sorted(files.items()):
        path = ckpt / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{path} is missing (listed in {MANIFEST})"
        if size != int(meta["size"]):
            return f"{path} has {size} bytes, {MANIFEST} says {int(meta['size'])}"
    return None


def state_problem(ckpt: str | Path) -> str | None:
    """What is wrong with the values of ``ckpt``'s ``trainer_state.json``, or None: one line naming the file (in its
    checkpoint folder) and the key (``C/trainer_state.json key constraints.tail.dual.lam = "0.3" is invalid: allowed
    a finite number``). Checks what a resume reads: the step, the layout, the config, the shaper's state and the
    constraints' state (:mod:`laconic_nemo.core`'s checks of saved states), without a run to load them into."""
    ckpt = Path(ckpt)
    path = ckpt / "trainer_state.json"
    try:
        state = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:
        return f"{path} is unreadable ({exc})"
    problem = _trainer_state_problem(state)
    if problem is None:
        return None
    key, value, allowed = problem
    shown = "(missing)" if value is _MISSING else json.dumps(value) if _jsonable(value) else repr(value)
    return f"{path} key {key or '(the whole file)'} = {shown} is invalid: allowed {allowed}"


_MISSING = object()


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _trainer_state_problem(state: Any) -> tuple[str, Any, str] | None:
    """(key, value, allowed) of the first bad value of a trainer state, or None."""
    if not isinstance(state, dict):
        return "", state, "a JSON object (step, shaper, world_size, dp_size, config, ...)"
    for key in ("step", "world_size", "dp_size"):
        v = state.get(key, _MISSING)
        if key == "step" or v is not _MISSING:  # world_size, dp_size: absent in the oldest checkpoints
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "step" else 1):
                return key, v, f"an integer >= {0 if key == 'step' else 1}"
    if not isinstance(state.get("config", {}), dict):
        return "config", state["config"], "a mapping (the run's resolved config)"
    problem = shaper_problem(state.get("shaper", _MISSING))
    if problem is not None:
        return (f"shaper.{problem[0]}" if problem[0] else "shaper"), problem[1], problem[2]
    laconic = state.get("config", {}).get("laconic") or {}
    wants = {"classes": bool(laconic.get("per_prompt_budget")), "tail": laconic.get("tail_budget") is not None}
    saved = state.get("constraints")
    if saved is None and not any(wants.values()):
        return None
    if not isinstance(saved, dict):
        return "constraints", saved, ("a mapping {classes, tail} (the checkpoint's config asks for "
                                      f"{' and '.join(k for k, v in wants.items() if v) or 'none'})")
    for name, check in (("classes", classes_state_problem), ("tail", tail_state_problem)):
        part = saved.get(name)
        if part is None:
            if wants[name]:
                return f"constraints.{name}", part, f"the state of the {name} constraint its config asks for"
            continue
        problem = check(part)
        if problem is not None:
            return f"constraints.{name}" + (f".{problem[0]}" if problem[0] else ""), problem[1], problem[2]
    return None


def choose_checkpoint(root: str | Path, exclude: tuple[Path, ...] = ()) -> tuple[Path | None, list[str]]:
    """(the checkpoint ``resume: auto`` continues from, one line per damaged checkpoint skipped on the way).

    ``latest`` when it names a complete, intact checkpoint, else the newest complete and intact one, else
    None. Incomplete ``.tmp`` folders are never chosen; ``exclude``: checkpoints found damaged otherwise
    (a CRC-32 mismatch seen by a rank). A checkpoint whose files are intact but whose trainer state holds a bad
    value (:func:`state_problem`) is skipped the same way; when no intact checkpoint is left after such a one,
    ResumeError names it (starting over would drop the run's steps for a value that can be repaired)."""
    root = Path(root)
    notes: list[str] = []
    bad_state = None
    candidates = complete_checkpoints(root)
    latest = root / "latest"
    if latest.is_file():
        name = latest.read_bytes().decode("utf-8", "replace").strip()
        if STEP_DIR.match(name) and (root / name) in candidates:
            candidates.remove(root / name)
            candidates.append(root / name)  # tried first
    for ckpt in reversed(candidates):
        if ckpt in exclude:
            continue
        why = damage(ckpt)
        if why is None:
            why = state_problem(ckpt)
            bad_state = bad_state or (None if why is None else (ckpt, why))
        if why is None:
            if notes:
                notes.append(f"resuming from the previous complete checkpoint {ckpt}")
            return ckpt, notes
        notes.append(f"checkpoint {ckpt} is damaged and skipped: {why}")
    if bad_state is not None:
        older = [c.name for c in reversed(candidates) if c not in exclude and c != bad_state[0]]
        raise ResumeError(f"cannot resume: {bad_state[1]}; no intact checkpoint to fall back to"
                          + (f" ({', '.join(older)} damaged too)" if older else "")
                          + ": repair the value, or move the checkpoint folders aside to start over")
    if notes:
        notes.append("no intact checkpoint is left: the run starts from step 1")
    return None, notes


def find_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``resume: auto`` continues from (:func:`choose_checkpoint`, without its notes)."""
    return choose_checkpoint(root)[0]


def read_trainer_state(ckpt: str | Path) -> dict:
    path = Path(ckpt) / "trainer_state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResumeError(f"{path}: unreadable checkpoint state ({exc}); remove that checkpoint folder "
                          "to resume from an older one") from exc


def saved_config(state: dict, where: str | Path) -> Config:
    """The run config a checkpoint's trainer state holds (``state["config"]``, the resolved config the run was
    trained with), read through the recipe loader: a checked :class:`~laconic_nemo.config.Config` (keys it lacks
    take their defaults). Raises ResumeError naming ``where`` (the checkpoint) when it has none or it fails a check."""
    values = state.get("config") if isinstance(state, dict) else None
    if not isinstance(values, dict):
        raise ResumeError(f"{where}: trainer_state.json holds no run config (key config)")
    try:
        return build_config(values)
    except ConfigError as exc:
        raise ResumeError(f"{where}: the run config in trainer_state.json is invalid: {exc}") from None


def read_metrics(path: str | Path) -> tuple[list[dict], bool]:
    """(rows, torn): the rows of ``metrics.jsonl`` and whether a torn last line was left out.

    Raises ResumeError naming the file and the 1-based line for any other line that is not a JSON
    object with an integer ``step`` (or that is not UTF-8 text), and for a ``metrics.jsonl`` that is not a file."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ResumeError(f"{path} is a folder, not a file: the run writes its metrics rows there; move it aside")
    if not path.is_file():
        return [], False
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        if b"\n" in raw[exc.start:]:
            raise ResumeError(f"{path} line {line}: corrupt metrics row (byte 0x{raw[exc.start]:02x} is not UTF-8); "
                              "a complete file has one JSON object per line - repair or remove that line") from None
        text = raw[: raw.rfind(b"\n") + 1].decode("utf-8") + "\ufffd"  # a torn last line, dropped below
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


def change_allowed(key: str, allow: list[str]) -> bool:
    """A config key that may differ from the checkpoint's: operational (:data:`ALWAYS_ALLOWED`), or named in ``allow``
    (``checkpoint.resume_allow_changes``) itself or by a section above it."""
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
                        defaults: dict | None = None,
                        suggest: Callable[[list[str]], list[str]] | None = None) -> list[tuple[str, Any, Any]]:
    """Raise ResumeError listing every difference not allowed; return the allowed ones. The refusal names the
    ``checkpoint.resume_allow_changes`` list that accepts them: ``allow`` and the keys refused, or what ``suggest``
    makes of that list (the carry-over entries the change then needs as well, so that the list given passes)."""
    diffs = config_differences(saved, now, defaults)
    refused = [d for d in diffs if not change_allowed(d[0], allow)]
    if refused:
        lines = "\n".join(f"  {k}: checkpoint {_show(old)} -> this run {_show(new)}" for k, old, new in refused)
        accept = [*allow, *(k for k, _, _ in refused)]
        if suggest is not None:
            accept = suggest(accept)
        raise ResumeError(
            f"cannot resume from {ckpt}: this run's config differs from the checkpoint's in {len(refused)} "
            f"key(s):\n{lines}\nResume with the checkpoint's values, or accept the change with "
            f"checkpoint.resume_allow_changes=[{','.join(accept)}], or start a fresh run in another run.output_dir.")
    return diffs


def _show(v: Any) -> str:
    return "(absent)" if not isinstance(v, (str, int, float, bool, list, dict, type(None))) else json.dumps(v)


def missing_steps(rows: list[dict], step: int) -> list[int]:
    """The steps 1..``step`` that have no row in ``rows``."""
    have = {r["step"] for r in rows}
    return [s for s in range(1, int(step) + 1) if s not in have]


def resume_source(cfg: Config, notes: list[str] | None = None) -> Path | None:
    """The checkpoint this run resumes from (None: a fresh start); ConfigError when that is not possible.
    ``notes`` receives a line for each damaged checkpoint skipped (:func:`choose_checkpoint`)."""
    from laconic_nemo.config import ConfigError

    out = Path(cfg.run.output_dir)
    mode = cfg.checkpoint.resume
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
        found, skipped = choose_checkpoint(out / "checkpoints")
        if notes is not None:
            notes += skipped
        return found
    p = Path(mode)
    if not (p / "trainer_state.json").is_file() or p.name.endswith(".tmp"):
        raise ConfigError(f"checkpoint.resume = {mode!r} is invalid: allowed auto, never or a complete checkpoint "
                          "folder (step_NNNNNN holding trainer_state.json)")
    why = damage(p) or state_problem(p)
    if why is not None:
        raise ConfigError(f"checkpoint.resume = {mode!r} is invalid: the checkpoint is damaged ({why}); name an "
                          "intact one, or auto")
    return p
