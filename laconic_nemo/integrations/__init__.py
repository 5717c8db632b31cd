"""LACONIC as a plug-in for other GRPO frameworks (docs/integrations.md).

- :mod:`laconic_nemo.integrations.trl`: Hugging Face TRL's ``GRPOTrainer`` (extra ``[trl]``),
- :mod:`laconic_nemo.integrations.verl`: verl 0.9 (extra ``[verl]``),
- :mod:`laconic_nemo.integrations.nemo_rl`: NVIDIA NeMo-RL's GRPO.

Each is a thin adapter over :mod:`laconic_nemo.integrations.common`, the one place that imports
:mod:`laconic_nemo.core`. Importing this package imports none of the frameworks.
"""
