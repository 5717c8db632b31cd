"""Recipe loading and validation.

A recipe is a YAML file. It may name parent recipes in a ``defaults:`` list (paths relative to the
recipe's folder, ``.yaml`` optional); parents are merged first, in order, then the recipe itself,
then command-line overrides (OmegaConf dotlist, e.g. ``laconic.budget=1000``). Every key must be
defined in ``recipes/base.yaml``, which documents each one: an unknown key is an error naming it,
so a typo never silently falls back to a default.

``validate_config`` checks ranges and cross-field constraints that do not depend on the cluster
layout; ``laconic_nemo.launch_plan`` adds the layout checks (TP x PP x DP, batch divisibility).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from laconic_nemo.kernels import ATTENTION_CHOICES, REFERENCE_CHOICES, SAMPLER_CHOICES

PACKAGE_RECIPES = Path(__file__).resolve().parent / "recipes"
REPO_RECIPES = Path(__file__).resolve().parent.parent / "recipes"


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key and the allowed values."""


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


def _check_known_keys(cfg: DictConfig, schema: DictConfig, prefix: str = "") -> None:
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        if key not in schema:
            known = ", ".join(sorted(str(k) for k in schema.keys()))
            raise ConfigError(f"unknown config key {dotted!r} (known keys here: {known})")
        sub, sub_schema = cfg[key], schema[key]
        if isinstance(sub_schema, DictConfig) and not isinstance(sub, DictConfig):
            raise ConfigError(f"{dotted} = {sub!r} is invalid: allowed a mapping of the keys "
                              f"{', '.join(sorted(str(k) for k in sub_schema.keys()))}")
        if isinstance(sub_schema, DictConfig) and isinstance(sub, DictConfig):
            _check_known_keys(sub, sub_schema, prefix=f"{dotted}.")


def load_config(path: str | Path, overrides: Iterable[str] = (), validate: bool = True) -> DictConfig:
    """Load ``path`` with its defaults chain and ``overrides``; reject unknown keys.

    Returns a resolved DictConfig (interpolations such as ``${run.name}`` expanded)."""
    recipe = resolve_recipe_path(path)
    schema = OmegaConf.load(base_config_path())
    cfg = _load_with_defaults(recipe)
    _check_known_keys(cfg, schema)
    cfg = OmegaConf.merge(schema, cfg)
    overrides = list(overrides)
    if overrides:
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like key=value")
        try:
            ov = OmegaConf.from_dotlist(overrides)
        except Exception as exc:  # omegaconf raises several grammar errors
            raise ConfigError(f"cannot parse overrides {overrides}: {exc}") from exc
        _check_known_keys(ov, schema)
        cfg = OmegaConf.merge(cfg, ov)
    OmegaConf.resolve(cfg)
    check_types(cfg, schema)
    if validate:
        validate_config(cfg)
    return cfg


# Keys whose base.yaml default is an integer but which take any real number.
REAL_KEYS = {"laconic.budget"}
# Keys whose default is null: the types they take besides null.
NULLABLE = {
    "model.path": str, "warmup.cache_dir": str, "laconic.ceiling": float, "laconic.penalty_cap": float,
    "laconic.alpha": float, "grpo.clip_eps_high": float, "rollout.vllm.max_model_len": int,
    "data.target_length_range": list,
}
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}


def _type_ok(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, (list, ListConfig))
    return isinstance(value, kind)


def check_types(cfg: DictConfig, schema: DictConfig, prefix: str = "") -> None:
    """Every value has the type of its base.yaml default (an integer key refuses 2.7 and "abc", a list key
    refuses a string); keys defaulting to null take null or the type in :data:`NULLABLE`."""
    for key in schema.keys():
        dotted = f"{prefix}{key}"
        default, value = schema[key], cfg[key]
        if isinstance(default, DictConfig):
            check_types(value, default, f"{dotted}.")
            continue
        if default is None:
            kind = NULLABLE.get(dotted)
            if value is None or kind is None:
                continue
        else:
            kind = float if dotted in REAL_KEYS or isinstance(default, float) else type(default)
            if isinstance(default, ListConfig):
                kind = list
        if kind in _TYPE_WORDS and not _type_ok(value, kind):
            hint = f" (write a list: {dotted}=[{value}])" if kind is list and isinstance(value, str) else ""
            allowed = _TYPE_WORDS[kind] + (" or null" if default is None else "")
            raise ConfigError(f"{dotted} = {value!r} is invalid: allowed {allowed}{hint}")


def _require(cond: bool, key: str, allowed: str, value) -> None:
    if not cond:
        raise ConfigError(f"{key} = {value!r} is invalid: allowed {allowed}")


SHAPERS = ("laconic", "linear", "fixed", "grpo", "l1_exact", "l1_max", "efficient", "overlong")


def validate_config(cfg: DictConfig) -> None:
    """Range and cross-field checks that need no cluster information. Raises ConfigError."""
    r, m, g, lc, ro, o = cfg.run, cfg.model, cfg.grpo, cfg.laconic, cfg.rollout, cfg.optim
    _require(int(r.num_steps) >= 1, "run.num_steps", "an integer >= 1", r.num_steps)
    _require(m.source in ("synthetic", "hf", "nemo"), "model.source", "one of synthetic, hf, nemo", m.source)
    if m.source in ("hf", "nemo"):
        _require(bool(m.path), "model.path", "a checkpoint path when model.source is hf or nemo", m.path)
    _require(m.precision in ("fp32", "bf16", "fp16"), "model.precision", "one of fp32, bf16, fp16", m.precision)
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        v = cfg.parallel[key]
        _require(isinstance(v, int) and v >= 1, f"parallel.{key}", "an integer >= 1", v)
    _require(cfg.parallel.backend in ("auto", "nccl", "gloo"), "parallel.backend", "auto, nccl or gloo",
             cfg.parallel.backend)
    _require(float(o.lr) > 0, "optim.lr", "> 0", o.lr)
    _require(float(o.grad_clip) >= 0, "optim.grad_clip", ">= 0 (0 disables)", o.grad_clip)
    _require(int(g.num_prompts_per_step) >= 1, "grpo.num_prompts_per_step", "an integer >= 1", g.num_prompts_per_step)
    _require(int(g.group_size) >= 2, "grpo.group_size", "an integer >= 2 (group advantages need G >= 2)",
             g.group_size)
    rollout_size = int(g.num_prompts_per_step) * int(g.group_size)
    _require(int(g.minibatch_size) >= 1 and rollout_size % int(g.minibatch_size) == 0, "grpo.minibatch_size",
             f"a divisor of num_prompts_per_step * group_size = {rollout_size}", g.minibatch_size)
    _require(int(g.micro_batch_size) >= 1, "grpo.micro_batch_size", "an integer >= 1", g.micro_batch_size)
    _require(0 < float(g.clip_eps) < 1, "grpo.clip_eps", "in (0, 1)", g.clip_eps)
    if g.clip_eps_high is not None:
        _require(float(g.clip_eps_high) >= float(g.clip_eps), "grpo.clip_eps_high", ">= grpo.clip_eps or null",
                 g.clip_eps_high)
    if g.clip_dual is not None:
        _require(float(g.clip_dual) > 1, "grpo.clip_dual", "> 1 or null", g.clip_dual)
    _require(g.advantage_std in ("unbiased", "population"), "grpo.advantage_std", "unbiased or population",
             g.advantage_std)
    _require(float(g.kl_beta) >= 0, "grpo.kl_beta", ">= 0", g.kl_beta)
    _require(g.loss_aggregation in ("seq_mean_token_mean", "token_mean"), "grpo.loss_aggregation",
             "seq_mean_token_mean or token_mean", g.loss_aggregation)
    _require(lc.shaper in SHAPERS, "laconic.shaper", f"one of {', '.join(SHAPERS)}", lc.shaper)
    budget, lmax = float(lc.budget), int(ro.max_new_tokens)
    _require(math.isfinite(budget) and budget > 0, "laconic.budget", "a number > 0 (tokens)", lc.budget)
    _require(lmax >= 1, "rollout.max_new_tokens", "an integer >= 1", ro.max_new_tokens)
    if lc.shaper in ("laconic", "linear", "fixed"):
        _require(lmax > budget, "laconic.budget", f"< rollout.max_new_tokens = {lmax} (L_max must exceed B)",
                 lc.budget)
    _require(float(lc.eta) >= 0, "laconic.eta", ">= 0", lc.eta)
    _require(float(lc.floor) >= 0, "laconic.floor", ">= 0", lc.floor)
    if lc.ceiling is not None:
        _require(float(lc.ceiling) >= float(lc.floor), "laconic.ceiling", ">= laconic.floor or null", lc.ceiling)
    _require(float(lc.lambda_init) >= 0, "laconic.lambda_init",
             ">= 0 (below laconic.floor is allowed: the first dual step clips it)", lc.lambda_init)
    if lc.shaper in ("laconic", "linear"):
        ceil = float(lc.ceiling) if lc.ceiling is not None else (budget / (lmax - budget) if lmax > budget else math.inf)
        _require(float(lc.lambda_init) <= ceil, "laconic.lambda_init", f"<= the ceiling Lambda = {ceil:g}",
                 lc.lambda_init)
    _require(lc.controller in ("integral", "pid"), "laconic.controller", "integral or pid", lc.controller)
    for key in ("kp", "kd"):
        v = lc[key]
        _require(not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
                 f"laconic.{key}", "a finite number >= 0", v)
        _require(lc.controller == "pid" or v == 0, f"laconic.{key}", "0 unless laconic.controller = pid", v)
    _require(isinstance(lc.count_eos, bool), "laconic.count_eos", "true or false", lc.count_eos)
    _require(float(ro.temperature) > 0, "rollout.temperature", "> 0", ro.temperature)
    _require(0 < float(ro.top_p) <= 1, "rollout.top_p", "in (0, 1]", ro.top_p)
    _require(ro.engine in ("megatron", "vllm", "nemo"), "rollout.engine", "megatron, vllm or nemo", ro.engine)
    for key, value, choices in (("model.attention", m.attention, ATTENTION_CHOICES),
                                ("rollout.sampler", ro.sampler, SAMPLER_CHOICES),
                                ("grpo.reference_on", g.reference_on, REFERENCE_CHOICES)):
        _require(value in choices, key, f"one of {', '.join(choices)}", value)
    _require(int(ro.sync_every) >= 1, "rollout.sync_every", ">= 1", ro.sync_every)
    _require(int(g.logprob_chunk_size) >= 1, "grpo.logprob_chunk_size", ">= 1", g.logprob_chunk_size)
    # Separate-GPU vLLM has no weight channel: every rank's engine would land on cuda:0 (vLLM's UniProcExecutor)
    # and the in-process refit cannot cross to vLLM's TP worker processes.
    _require(bool(ro.vllm.colocate), "rollout.vllm.colocate", "true (vLLM on separate GPUs is not implemented)",
             ro.vllm.colocate)
    _require(cfg.reward.kind in ("math", "synthetic"), "reward.kind", "math or synthetic", cfg.reward.kind)
    _require(float(cfg.reward.timeout_s) > 0, "reward.timeout_s", "> 0 seconds", cfg.reward.timeout_s)
    _require(0 <= float(cfg.reward.format_weight) < 1, "reward.format_weight", "in [0, 1)", cfg.reward.format_weight)
    _require(cfg.reward.format in ("boxed", "think_boxed"), "reward.format", "boxed or think_boxed", cfg.reward.format)
    _require(int(cfg.checkpoint.every_n_steps) >= 0, "checkpoint.every_n_steps", ">= 0 (0: only at the end)",
             cfg.checkpoint.every_n_steps)
    _require(int(cfg.checkpoint.keep_last) >= 1, "checkpoint.keep_last", "an integer >= 1",
             cfg.checkpoint.keep_last)
    _require(not cfg.checkpoint.get("export_hf", False) or m.source == "hf", "checkpoint.export_hf",
             f"false with model.source = {m.source} (only hf runs have a Hugging Face architecture)",
             cfg.checkpoint.get("export_hf"))
    for key in ("collective_timeout_s", "watchdog_s"):
        v = cfg.parallel[key]
        _require(math.isfinite(float(v)) and float(v) > 0, f"parallel.{key}", "a number of seconds > 0", v)
    for key in cfg.checkpoint.resume_allow_changes:
        _require(OmegaConf.select(cfg, str(key), default="__missing__") != "__missing__",
                 "checkpoint.resume_allow_changes", "a list of config keys (e.g. [run.seed])", str(key))
