"""The tokens that end a response: NeMo's end strings checked against a tokenizer, and their ids for the decode
engine.

NeMo's sampler (``nemo.collections.nlp.modules.common.text_generation_strategy``,
``TextGenerationStrategy._get_end_of_generation_tokens_and_strings``, nemo-toolkit 2.2.1) treats an end string as a
token id only when ``text_to_ids("<extra_id_1>" + s)`` is ``text_to_ids("<extra_id_1>")`` plus exactly one id;
``"<|endoftext|>"`` is always mapped to the EOS id. Any other string is checked by decoding every row's whole text at
every decode step (``end_of_generation_condition``), which costs far more than the forward pass on long rollouts.
:func:`resolve_end_strings` builds the end strings from the loaded tokenizer and refuses a requested string that is
not a single token; :func:`end_token_ids` gives the decode engine the same stops as token ids. Pure Python: a
tokenizer is passed in as its ``text -> ids`` function.
"""

from __future__ import annotations

from typing import Callable, Sequence

# NeMo's alias for the tokenizer's EOS id (text_generation_strategy.py: END_OF_SEQ = '<|endoftext|>').
END_OF_SEQ = "<|endoftext|>"
# End-of-turn strings of the supported chat templates (DeepSeek-R1 distills, Qwen chat); kept only where
# the loaded tokenizer holds them as single tokens.
CHAT_END_STRINGS = ("<｜end▁of▁sentence｜>", "<|im_end|>")
# NeMo's probe prefix in _get_end_of_generation_tokens_and_strings.
_PROBE = "<extra_id_1>"

TextToIds = Callable[[str], Sequence[int]]



class EndStringError(ValueError):
    """An end string is not a single token of the model's tokenizer; the message names it."""


def end_string_token(text_to_ids: TextToIds, s: str) -> int | None:
    """The id NeMo maps end string ``s`` to, or None when NeMo would compare decoded text instead.

    text_to_ids: the tokenizer's text -> ids (NeMo's ``tokenizer.text_to_ids``; for a Hugging Face
    tokenizer ``lambda t: tok.encode(t, add_special_tokens=False)``)."""
    ref = list(text_to_ids(_PROBE))
    ids = list(text_to_ids(_PROBE + s))
    if len(ids) == len(ref) + 1 and ids[:-1] == ref:
        return int(ids[-1])
    return None


def resolve_end_strings(text_to_ids: TextToIds, requested: Sequence[str] | None = None) -> list[str]:
    """End strings for NeMo's sampler, every one a single token of this tokenizer.

    requested: None builds them from the tokenizer: ``"<|endoftext|>"`` (NeMo's EOS alias) plus those of
    :data:`CHAT_END_STRINGS` that are single tokens. A list is checked as given: each string must be
    ``"<|endoftext|>"`` or a single token, else :class:`EndStringError` names it and its ids.
    """
    if requested is None:
        return [END_OF_SEQ] + [s for s in CHAT_END_STRINGS if end_string_token(text_to_ids, s) is not None]
    out = []
    for s in requested:
        s = str(s)
        if s != END_OF_SEQ and end_string_token(text_to_ids, s) is None:
            raise EndStringError(
                f"end string {s!r} is not a single token of the model's tokenizer (ids {list(text_to_ids(s))}); "
                "NeMo would decode every row at every generation step to look for it. Use the tokenizer's "
                f"EOS ({END_OF_SEQ!r}) or single-token strings (model.reinforce.sampling_params.end_strings)")
        out.append(s)
    if not out:
        raise EndStringError("model.reinforce.sampling_params.end_strings is empty: give at least "
                             f"{END_OF_SEQ!r} (the tokenizer's EOS)")
    return out


def end_token_ids(text_to_ids: TextToIds, eos_id: int, requested: Sequence[str] | None = None) -> list[int]:
    """The token ids that end a response for the decode engine (``SamplingParams.stop_ids``): the ids of the end
    strings NeMo's sampler is given (:func:`resolve_end_strings`; ``"<|endoftext|>"`` is NeMo's alias for
    ``eos_id``), so that ``rollout.engine: megatron`` stops where ``rollout.engine: nemo`` does, e.g. on Qwen's
    ``<|im_end|>`` when the tokenizer's EOS is ``<|endoftext|>``. EOS first, no repeats."""
    out = [int(eos_id)]
    for s in resolve_end_strings(text_to_ids, requested):
        tid = int(eos_id) if s == END_OF_SEQ else end_string_token(text_to_ids, s)
        if tid is not None and tid not in out:
            out.append(int(tid))
    return out


def hf_text_to_ids(tok) -> TextToIds:
    """NeMo's ``AutoTokenizer.text_to_ids`` for a Hugging Face tokenizer (tokenize, then ids; no specials)."""
    return lambda text: tok.convert_tokens_to_ids(tok.tokenize(text))
