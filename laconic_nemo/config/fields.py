"""The building blocks of the recipe schema: the errors a bad recipe raises, a field's documented default and
allowed values (:func:`opt`, :class:`Range`), and the synthetic task's alphabet the schema checks texts against."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

PACKAGE_RECIPES = Path(__file__).resolve().parent.parent / "recipes"
# the synthetic task labels its terms with the letters a..l (laconic_nemo.data.synthetic.LETTERS; a test checks)
SYNTHETIC_MAX_TERMS = 12
# the characters of the synthetic task's tokenizer (laconic_nemo.data.synthetic.ALPHABET; a test checks)
SYNTHETIC_ALPHABET = "0123456789:,Q\n\\boxed{}hm. abcdefghijkl"
# the placeholders a stated-target instruction (data.target_instruction) is written with
TARGET_PLACEHOLDERS = ("{target}", "{budget}")


def states_a_target(instruction: str) -> bool:
    """Whether ``instruction`` holds a placeholder for the stated target ({target} or {budget})."""
    return any(p in instruction for p in TARGET_PLACEHOLDERS)


def state_target(instruction: str, target: int) -> str:
    """``instruction`` stating ``target``: its {target} and {budget} replaced by the number."""
    return str(instruction).format(target=int(target), budget=int(target))


def synthetic_unencodable(text: str, template: bool = False) -> list[str]:
    """The characters of ``text`` the synthetic task's character tokenizer lacks, sorted (placeholders of a
    ``template`` aside)."""
    if template:
        for p in TARGET_PLACEHOLDERS:
            text = text.replace(p, "")
    return sorted(set(text) - set(SYNTHETIC_ALPHABET))


REPO_RECIPES = Path(__file__).resolve().parent.parent.parent / "recipes"


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key and the allowed values."""


class LayoutError(ConfigError):
    """The recipe does not fit the requested cluster layout; the message names the key."""


def require(cond: bool, key: str, allowed: str, value) -> None:
    if not cond:
        raise ConfigError(f"{key} = {value!r} is invalid: allowed {allowed}")


def fits(cond: bool, key: str, value, allowed: str) -> None:
    if not cond:
        raise LayoutError(f"{key} = {value!r} does not fit the layout: {allowed}")


@dataclass(frozen=True)
class Range:
    """The allowed values of a number key (bounds inclusive with ``ge`` / ``le``, exclusive with ``gt`` / ``lt``;
    NaN and infinities are never allowed) or of a string key (``choices``). Null passes where the field is
    Optional."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None

    def allows(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def describe(self, kind: type) -> str:
        """The allowed values in words ("an integer >= 1", "a number in (0, 1]", "one of a, b")."""
        if self.choices is not None:
            return f"one of {', '.join(map(str, self.choices))}"
        word = "an integer" if kind is int else "a number"
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        high = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        if low and high:
            return f"{word} in {low[0]}{number_text(low[1])}, {number_text(high[1])}{high[0]}"
        if low:
            return f"{word} {'>=' if low[0] == '[' else '>'} {number_text(low[1])}"
        if high:
            return f"{word} {'<=' if high[0] == ']' else '<'} {number_text(high[1])}"
        return f"a finite {word[2:] if kind is not int else 'integer'}"


def number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def opt(default: Any, doc: str = "", above: str = "", *, ge: float | None = None, gt: float | None = None,
        le: float | None = None, lt: float | None = None, choices: Iterable[str] | None = None) -> Any:
    """A schema field: its default, the comment written beside it in base.yaml, the block written above it and its
    allowed values (:class:`Range`; checked by :func:`check_ranges` before the sections' own rules)."""
    meta: dict[str, Any] = {"doc": doc, "above": above}
    if any(b is not None for b in (ge, gt, le, lt)) or choices is not None:
        meta["range"] = Range(ge, gt, le, lt, None if choices is None else tuple(choices))
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, doc: str = "") -> Any:
    return field(default_factory=cls, metadata={"doc": doc, "above": ""})
