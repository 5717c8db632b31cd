"""laconic-nemo: LACONIC length-constrained GRPO on megatron-core and NeMo-Aligner."""

__version__ = "0.1.0"
