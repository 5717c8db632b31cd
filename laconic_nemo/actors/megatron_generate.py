"""Generation for the megatron-core actor: the decode engine on the actor's GPTModel
(:mod:`laconic_nemo.rollout.engine`: static KV cache, CUDA-graphed steps on GPU, ``rollout.sampler`` exact or
device), or an attached engine (vLLM, :mod:`laconic_nemo.rollout.vllm`) that refits the weights itself.

:class:`Generation` is the generation part of :class:`laconic_nemo.actors.megatron_core.MegatronCoreActor`, given
the schedule part (the model chunks and eval mode).
"""

from __future__ import annotations

from typing import Any

from laconic_nemo.actors.megatron_schedule import ScheduleRunner
from laconic_nemo.grpo.interfaces import GenerationOutput, SamplingParams
from laconic_nemo.rollout.engine import DecodeEngine, check_engine_memory


class Generation:
    """Responses from the policy: the decode engine (built on first use, ``engine``; None before) or the attached
    ``rollout_engine``.

    schedule: the schedule part; vocab_size: the real vocabulary V; dp_rank: this rank's data-parallel rank (the
    sampling stream); pad_id: fills rows after their end in generated tokens (None: the EOS id); sampler (resolved,
    :func:`laconic_nemo.rollout.engine.resolve_sampler`), sync_every, compact_rows: ``rollout.sampler`` /
    ``sync_every`` / ``compact``, written into the engine's settings at every :meth:`decode_engine` call;
    engine_settings: the engine's other settings (``rollout.*``; None: its defaults); engine_memory:
    ``rollout.engine_memory`` (release: the engine's cache and graphs freed after every rollout).
    """

    def __init__(self, schedule: ScheduleRunner, vocab_size: int, dp_rank: int, pad_id: int | None, sampler: str,
                 sync_every: int, compact_rows: bool, engine_settings: Any, engine_memory: str):
        self.schedule, self.vocab_size, self.dp_rank = schedule, int(vocab_size), dp_rank
        self.pad_id = None if pad_id is None else int(pad_id)
        self.sampler, self.sync_every, self.compact_rows = sampler, int(sync_every), bool(compact_rows)
        self.engine_settings, self.engine_memory = engine_settings, check_engine_memory(engine_memory)
        self.engine: DecodeEngine | None = None
        self.rollout_engine = None

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, version: int) -> GenerationOutput:
        """One response per prompt (token ids, ragged); CPU tensors, identical on every TP/PP rank. ``version``:
        the optimiser steps taken so far (an attached engine refits the weights when it changed)."""
        if self.rollout_engine is not None:
            return self.rollout_engine.generate_from(self.schedule.model, version, prompts, sampling)
        with self.schedule.eval_mode():
            try:
                return self.decode_engine().generate(prompts, sampling, stream=self.dp_rank, pad_id=self.pad_id)
            finally:
                if self.engine_memory == "release":  # the training step gets the cache's memory
                    self.engine.free()

    def decode_engine(self) -> DecodeEngine:
        """The decode engine on this rank's GPTModel (built on first use; ``sampler``, ``sync_every`` and
        ``compact_rows`` written into its settings at every call)."""
        if self.engine is None:
            self.engine = DecodeEngine(self.schedule.model, self.vocab_size, self.engine_settings)
        s = self.engine.settings
        s.sampler, s.sync_every, s.compact = self.sampler, self.sync_every, self.compact_rows
        return self.engine

    def resident_engine(self) -> DecodeEngine | None:
        """The decode engine if built (what it holds counts in the training step's memory model), else None."""
        return self.engine
