"""Recipe loading: ``defaults:`` chains, command-line overrides, unknown keys, types and ranges checked once, and
the :class:`~laconic_nemo.config.schema.Config` built from them; its plain and YAML forms."""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path
from typing import Any, Iterable, List

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from laconic_nemo.config.fields import PACKAGE_RECIPES, REPO_RECIPES, ConfigError, Range
from laconic_nemo.config.schema import Config


# ------------------------------------------------------------------------------------------------------------------
# loading
# ------------------------------------------------------------------------------------------------------------------
def base_config_path() -> Path:
    for folder in (REPO_RECIPES, PACKAGE_RECIPES):
        if (folder / "base.yaml").is_file():
            return folder / "base.yaml"
    raise ConfigError("recipes/base.yaml not found next to the package")


def resolve_recipe_path(name: str | Path) -> Path:
    """A recipe path, or a bare recipe name looked up in the recipes folder."""
    p = Path(name)
    # Recipe names contain dots (deepscaler_1.5b_b2000), so ".yaml" is appended, never substituted.
    candidates = [p] if p.name.endswith(".yaml") else [p, p.with_name(p.name + ".yaml")]
    for folder in (REPO_RECIPES, PACKAGE_RECIPES):
        candidates += [folder / p.name, folder / f"{p.name}.yaml"]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise ConfigError(f"recipe {str(name)!r} not found (looked for {', '.join(str(c) for c in candidates[:4])})")


def _load_with_defaults(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    if path in seen:
        raise ConfigError(f"recipe defaults form a cycle: {' -> '.join(str(s) for s in (*seen, path))}")
    try:
        raw = OmegaConf.load(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: YAML syntax error: {getattr(exc, 'problem', None) or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} {not_utf8(path, exc)}") from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {omegaconf_message(exc)}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: a recipe must be a mapping")
    parents = raw.pop("defaults", None) or []
    if isinstance(parents, (str,)):
        parents = [parents]
    if not isinstance(parents, (list, ListConfig)):
        raise ConfigError(f"{path}: `defaults` must be a list of recipe names")
    merged = OmegaConf.create({})
    for parent in parents:
        parent_path = path.parent / str(parent)
        if not parent_path.name.endswith(".yaml"):
            parent_path = parent_path.with_name(parent_path.name + ".yaml")
        if not parent_path.is_file():
            raise ConfigError(f"{path}: defaults entry {parent!r} not found at {parent_path}")
        merged = OmegaConf.merge(merged, _load_with_defaults(parent_path.resolve(), (*seen, path)))
    return OmegaConf.merge(merged, raw)


def not_utf8(path: str | Path, exc: UnicodeDecodeError) -> str:
    """Where in ``path`` the bytes that are not UTF-8 sit ("line 3, column 7: byte 0xff is not UTF-8 text")."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        data = exc.object if isinstance(exc.object, bytes) else b""
    head = data[: exc.start]
    line, column = head.count(b"\n") + 1, exc.start - (head.rfind(b"\n") + 1) + 1
    return f"line {line}, column {column}: byte 0x{data[exc.start]:02x} is not UTF-8 text (save the file as UTF-8)"


def omegaconf_message(exc: OmegaConfBaseException) -> str:
    """One line for an OmegaConf error: the key, what is wrong and, for an interpolation, what is allowed."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    key = getattr(exc, "full_key", None)
    allowed = ""
    if "nterpolation" in type(exc).__name__ or "Grammar" in type(exc).__name__:
        allowed = " (allowed: a value, or ${section.key} naming an existing key, e.g. ${run.name})"
    return f"{key}: {first}{allowed}" if key else f"{first}{allowed}"


def _check_known_keys(cfg: DictConfig, schema: type, prefix: str = "") -> None:
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"unknown config key {dotted!r} (known keys here: {', '.join(sorted(fields))})")
        sub_schema = hints[key]
        if dataclasses.is_dataclass(sub_schema):
            sub = cfg[key]
            if not isinstance(sub, DictConfig):
                raise ConfigError(f"{dotted} = {sub!r} is invalid: allowed a mapping of the keys "
                                  f"{', '.join(sorted(f.name for f in dataclasses.fields(sub_schema)))}")
            _check_known_keys(sub, sub_schema, prefix=f"{dotted}.")


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}


def _kind(annotation: Any) -> tuple[type, bool]:
    """(int | float | bool | str | list, nullable) of a field annotation."""
    nullable = False
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation, nullable = args[0], True
    if typing.get_origin(annotation) in (list, List):
        return list, nullable
    return annotation, nullable


def _type_ok(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, (list, ListConfig))
    return isinstance(value, kind)


def check_types(cfg: DictConfig, schema: type = None, prefix: str = "") -> None:
    """Every value has its field's type (an integer key refuses 2.7 and "abc", a list key refuses a string, a
    number key takes integers); ``Optional`` fields also take null."""
    schema = Config if schema is None else schema
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in cfg:
            continue
        dotted, value, annotation = f"{prefix}{f.name}", cfg[f.name], hints[f.name]
        if dataclasses.is_dataclass(annotation):
            check_types(value, annotation, f"{dotted}.")
            continue
        kind, nullable = _kind(annotation)
        if value is None and nullable:
            continue
        if not _type_ok(value, kind):
            hint = f" (write a list: {dotted}=[{value}])" if kind is list and isinstance(value, str) else ""
            allowed = _TYPE_WORDS[kind] + (" or null" if nullable else "")
            raise ConfigError(f"{dotted} = {value!r} is invalid: allowed {allowed}{hint}")


def ranged_keys(schema: type = None, prefix: str = "") -> list[tuple[str, Range, type, bool]]:
    """(dotted key, range, int | float | str, nullable) of every field with a range, section by section."""
    schema = Config if schema is None else schema
    hints = typing.get_type_hints(schema)
    out = []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            out += ranged_keys(hints[f.name], f"{prefix}{f.name}.")
        elif "range" in f.metadata:
            kind, nullable = _kind(hints[f.name])
            out.append((f"{prefix}{f.name}", f.metadata["range"], kind, nullable))
    return out


def check_ranges(cfg: DictConfig) -> None:
    """Every value inside its field's range (:class:`Range`); raises ConfigError naming the key and the range."""
    for key, rng, kind, nullable in ranged_keys():
        value = OmegaConf.select(cfg, key)
        if value is None and nullable:
            continue
        if not rng.allows(value):
            allowed = rng.describe(kind) + (" or null" if nullable else "")
            raise ConfigError(f"{key} = {value!r} is invalid: allowed {allowed}")


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> Config:
    """Load ``path`` with its defaults chain and ``overrides``: the checked :class:`Config`.

    Unknown keys, mistyped values, values outside their range and broken rules across keys raise ConfigError naming
    the key; interpolations such as ``${run.name}`` are expanded."""
    recipe = resolve_recipe_path(path)
    cfg = _load_with_defaults(recipe)
    _check_known_keys(cfg, Config)
    overrides = list(overrides)
    if overrides:
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like key=value")
        try:
            ov = OmegaConf.from_dotlist(overrides)
        except OmegaConfBaseException as exc:  # omegaconf raises several grammar errors
            raise ConfigError(f"cannot parse the overrides: {omegaconf_message(exc)}") from None
        except Exception as exc:
            raise ConfigError(f"cannot parse overrides {overrides}: {exc}") from exc
        _check_known_keys(ov, Config)
        cfg = OmegaConf.merge(cfg, ov)
    return build_config(cfg)


_SCHEMA: list = []


def _schema() -> tuple[DictConfig, dict]:
    """The structured config of :class:`Config` and its plain defaults, built once (building them is most of
    the cost of loading a recipe)."""
    if not _SCHEMA:
        structured = OmegaConf.structured(Config)
        _SCHEMA.extend([structured, OmegaConf.to_container(structured)])
    return _SCHEMA[0], _SCHEMA[1]


def build_config(values: Any) -> Config:
    """The checked :class:`Config` from a mapping of recipe values (missing keys take their defaults): unknown
    keys, mistyped values, values outside their range and broken rules across keys raise ConfigError naming the
    key."""
    try:
        cfg = values if isinstance(values, DictConfig) else OmegaConf.create(values)
        _check_known_keys(cfg, Config)
        # untyped first (the type check names the key in this module's words), typed once the values passed it
        plain = OmegaConf.merge(OmegaConf.create(_schema()[1]), cfg)
        OmegaConf.resolve(plain)  # an interpolation naming a missing key fails here, naming the key
    except OmegaConfBaseException as exc:
        raise ConfigError(omegaconf_message(exc)) from None
    check_types(plain)
    return validate_config(OmegaConf.merge(_schema()[0], plain))  # merge copies its first argument


def validate_config(cfg: DictConfig) -> Config:
    """The fields' ranges (:func:`check_ranges`), then the rules across fields and sections (the sections' and
    :class:`Config`'s ``__post_init__``, run as the objects are built). Returns the :class:`Config`; raises
    ConfigError."""
    check_ranges(cfg)
    return OmegaConf.to_object(cfg)


def defaults() -> dict[str, Any]:
    """Every key's default, section by section, interpolations unresolved (``${run.name}``): recipes/base.yaml as
    plain values."""
    return copy.deepcopy(_schema()[1])


def to_dict(cfg: Config) -> dict[str, Any]:
    """The plain form of ``cfg`` (nested dicts and lists, section by section in schema order): what a checkpoint's
    trainer state and a W&B run hold."""
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    """``cfg`` as YAML (a run's ``config.yaml``; :func:`load_config` reads it back)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
