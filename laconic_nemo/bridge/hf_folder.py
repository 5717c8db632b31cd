"""What a Hugging Face model folder holds besides its weights: its ``config.json`` (:func:`hf_config`) and its
tokenizer (:func:`load_hf_tokenizer`). ``transformers`` is imported only by :func:`load_hf_tokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["HFConfigError", "hf_config", "load_hf_tokenizer"]


class HFConfigError(ValueError):
    """A model folder's ``config.json`` cannot be read as the checkpoint's configuration; the message names the
    file (and the line)."""


def hf_config(path: str | Path | None) -> dict | None:
    """The HF ``config.json`` next to (or inside) ``path`` when it is here, else None. A ``config.json`` that is
    not a JSON object raises :class:`HFConfigError` naming the file and the line."""
    if not path:
        return None
    p = Path(path)
    for cand in (p / "config.json", p.parent / "config.json"):
        if cand.is_file():
            try:
                raw = cand.read_bytes()
                data = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                head = raw[: exc.start]
                line, column = head.count(b"\n") + 1, exc.start - (head.rfind(b"\n") + 1) + 1
                raise HFConfigError(f"{cand} line {line}, column {column}: byte 0x{raw[exc.start]:02x} is not "
                                    "UTF-8 text (save the file as UTF-8)") from None
            except ValueError as exc:
                line = f" line {exc.lineno}" if hasattr(exc, "lineno") else ""
                raise HFConfigError(f"{cand}{line}: invalid JSON ({getattr(exc, 'msg', exc)}); the model folder's "
                                    "config.json must be the checkpoint's JSON configuration") from None
            except OSError as exc:
                raise HFConfigError(f"{cand}: unreadable ({exc.strerror})") from None
            if not isinstance(data, dict):
                raise HFConfigError(f"{cand}: a JSON object expected (the checkpoint's configuration)")
            return data
    return None


def load_hf_tokenizer(path: str | Path):
    """The fast tokenizer of an HF folder (as NeMo's ``AutoTokenizer`` loads it: ``use_fast=True``)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(path), use_fast=True)
