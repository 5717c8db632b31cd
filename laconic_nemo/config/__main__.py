"""``python -m laconic_nemo.config``: print recipes/base.yaml."""

from laconic_nemo.config.base_yaml import render_base_yaml

print(render_base_yaml(), end="")
