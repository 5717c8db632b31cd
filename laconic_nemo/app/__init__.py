"""Entry points: the composition roots that build a task, an actor and a trainer and run them.

``train_cli`` (``laconic-nemo train``, the megatron-core actor), ``nemo_entry`` (the NeMo-Aligner actor in
the NGC container), ``warmup`` (the supervised warm-up before RL) and ``plots``. Nothing in the library
(``core``, ``grpo``, ``actors``, ``rollout``, ``data``, ``rewards``) imports this package.
"""
