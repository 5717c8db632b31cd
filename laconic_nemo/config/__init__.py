"""The recipe: its schema (:mod:`~laconic_nemo.config.schema`, one dataclass per section, each field documented where
it is defined, built from :mod:`~laconic_nemo.config.fields`), its loading (:mod:`~laconic_nemo.config.loading`) and
recipes/base.yaml generated from the schema (:mod:`~laconic_nemo.config.base_yaml`). Every public name is importable
from ``laconic_nemo.config``.

A recipe is a YAML file. It may name parent recipes in a ``defaults:`` list (paths relative to the
recipe's folder, ``.yaml`` optional); parents are merged first, in order, then the recipe itself,
then command-line overrides (OmegaConf dotlist, e.g. ``laconic.budget=1000``). The dataclasses of ``schema`` are
the schema and the defaults (OmegaConf structured configs: values are typed); ``recipes/base.yaml`` is
generated from them (``python -m laconic_nemo.config > recipes/base.yaml``; a test checks it is current).
An unknown key is an error naming it, so a typo never silently falls back to a default.

Values are checked once, here: a field's range (``ge`` / ``gt`` / ``le`` / ``lt`` / ``choices`` given to
:func:`opt`, kept in the field's metadata: :func:`ranged_keys` lists them, :func:`check_ranges` applies every
one of them), then each section's ``__post_init__`` its rules across fields, :class:`Config`'s the rules across
sections; :func:`check_layout` adds the rules of a (DP, TP, PP) layout (batch divisibility).

:func:`load_config` returns the :class:`Config` object itself (the dataclasses, with slots: a key the schema does
not define cannot be set on it either). Below this boundary the code reads its typed fields (``cfg.laconic.budget``)
and never checks them again; :func:`to_dict` and :func:`to_yaml` give its plain and YAML forms (checkpoints,
``config.yaml``).
"""

from __future__ import annotations

from laconic_nemo.config.base_yaml import (  # noqa: F401
    BASE_HEADER,
    render_base_yaml,
)
from laconic_nemo.config.fields import (  # noqa: F401
    PACKAGE_RECIPES,
    REPO_RECIPES,
    SYNTHETIC_ALPHABET,
    SYNTHETIC_MAX_TERMS,
    TARGET_PLACEHOLDERS,
    ConfigError,
    LayoutError,
    Range,
    fits,
    number_text,
    opt,
    require,
    section,
    state_target,
    states_a_target,
    synthetic_unencodable,
)
from laconic_nemo.config.loading import (  # noqa: F401
    base_config_path,
    build_config,
    check_ranges,
    check_types,
    defaults,
    load_config,
    not_utf8,
    omegaconf_message,
    ranged_keys,
    resolve_recipe_path,
    to_dict,
    to_yaml,
    validate_config,
)
from laconic_nemo.config.schema import (  # noqa: F401
    CheckpointConfig,
    Config,
    DataConfig,
    GRPOConfig,
    LaconicConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SyntheticConfig,
    VllmConfig,
    WarmupConfig,
    check_layout,
)
