"""The commands beside training: ``laconic-nemo simulate`` (a length-response model of a run, for choosing eta,
Lambda and pid gains), ``laconic-nemo export`` (a training checkpoint as a Hugging Face folder) and the Qwen2
HF -> ``.nemo`` conversion the NeMo-Aligner launch runs (``python -m laconic_nemo.tools.convert_qwen2``).
"""
