"""recipes/base.yaml, generated from the schema's dataclasses: every key, its default and its documentation
(``python -m laconic_nemo.config > recipes/base.yaml``; a test checks the file is current)."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import yaml

from laconic_nemo.config.schema import Config

BASE_HEADER = """Base configuration shared by every recipe. A recipe names this file in `defaults:` and overrides
what differs. Every key is documented here, where it is defined; `laconic-nemo plan` rejects keys
that are not defined here. GENERATED from the dataclasses of laconic_nemo/config/schema.py: edit those and run
`python -m laconic_nemo.config > recipes/base.yaml`.

Notation as in the paper: B = laconic.budget, L_max = rollout.max_new_tokens, G = grpo.group_size,
eta = laconic.eta, Lambda = laconic.ceiling."""


# ------------------------------------------------------------------------------------------------------------------
# recipes/base.yaml, generated from the dataclasses
# ------------------------------------------------------------------------------------------------------------------
def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        if "e" in text:
            mantissa, exp = text.split("e")
            text = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{int(exp)}"
        return text
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, str):
        plain = value == value.strip() and "#" not in value and ": " not in value and yaml.safe_load(value) == value
        return value if plain and value else json.dumps(value)
    return str(value)


def _comment_block(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}".rstrip() for line in text.splitlines()]


def _render(schema: type, indent: str) -> list[str]:
    lines: list[str] = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.metadata.get("above"):
            lines += _comment_block(f.metadata["above"], indent)
        doc = f.metadata.get("doc", "").splitlines()
        if dataclasses.is_dataclass(hints[f.name]):
            head = f"{indent}{f.name}:"
            body = _render(hints[f.name], indent + "  ")
        else:
            head = f"{indent}{f.name}: {_scalar(f.default_factory() if f.default is dataclasses.MISSING else f.default)}"
            body = []
        if doc:
            col = max(len(head) + 2, 31)
            lines.append(f"{head.ljust(col)}# {doc[0]}")
            lines += [f"{' ' * col}# {line}" for line in doc[1:]]
        else:
            lines.append(head)
        lines += body
        if not indent:
            lines.append("")
    return lines


def render_base_yaml() -> str:
    """The text of recipes/base.yaml: every key, its default and its documentation."""
    return "\n".join([*_comment_block(BASE_HEADER, ""), "", *_render(Config, "")]).rstrip() + "\n"
