"""The model folder of a launch: checks of a model's tokenizer and Hugging Face folder that must hold before a
cluster job starts (:func:`check_model_folder`), and the NeMo overrides that bear on them.

* End strings. NeMo's sampler (``nemo.collections.nlp.modules.common.text_generation_strategy``,
  ``TextGenerationStrategy._get_end_of_generation_tokens_and_strings``, nemo-toolkit 2.2.1) treats an end
  string as a token id only when ``text_to_ids("<extra_id_1>" + s)`` is ``text_to_ids("<extra_id_1>")`` plus
  exactly one id; ``"<|endoftext|>"`` is always mapped to the EOS id. Any other string is checked by
  decoding every row's whole text at every decode step (``end_of_generation_condition``), which costs
  far more than the forward pass on long rollouts. :func:`resolve_end_strings` builds the end strings
  from the loaded tokenizer and refuses a requested string that is not a single token.
* The HF folder given to NeMo's Qwen2 converter (``--prepare``): :func:`check_converter_folder` names the
  missing file (config.json of a Qwen2ForCausalLM, weights, a tokenizer).

* NeMo overrides: a launch's ``key=value`` arguments prefixed ``nemo.`` go to the NeMo-Aligner config
  (:func:`split_overrides`); the end strings one of them may set (:data:`END_STRINGS_KEY`) are checked here too.

Pure Python; ``transformers`` is imported only by the bridge's
:func:`~laconic_nemo.bridge.hf_folder.load_hf_tokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

from omegaconf import OmegaConf

from laconic_nemo.bridge.hf_folder import load_hf_tokenizer
from laconic_nemo.config import Config, LayoutError

END_STRINGS_KEY = "model.reinforce.sampling_params.end_strings"

# NeMo's alias for the tokenizer's EOS id (text_generation_strategy.py: END_OF_SEQ = '<|endoftext|>').
END_OF_SEQ = "<|endoftext|>"
# End-of-turn strings of the supported chat templates (DeepSeek-R1 distills, Qwen chat); kept only where
# the loaded tokenizer holds them as single tokens.
CHAT_END_STRINGS = ("<｜end▁of▁sentence｜>", "<|im_end|>")
# NeMo's probe prefix in _get_end_of_generation_tokens_and_strings.
_PROBE = "<extra_id_1>"

TextToIds = Callable[[str], Sequence[int]]


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(recipe overrides, NeMo-config overrides with the ``nemo.`` prefix removed)."""
    recipe, nemo = [], []
    for o in overrides:
        (nemo.append(o[len("nemo."):]) if o.startswith("nemo.") else recipe.append(o))
    return recipe, nemo


def end_strings_override(nemo_overrides: list[str]) -> bool:
    """True when the NeMo overrides set the sampler's end strings explicitly."""
    return any(o.split("=", 1)[0].strip() == END_STRINGS_KEY for o in nemo_overrides)


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


# ---------------------------------------------------------------------------------------------- HF folders
QWEN2_ARCHITECTURE = "Qwen2ForCausalLM"


def check_converter_folder(path: str | Path) -> None:
    """Raise FileNotFoundError / ValueError naming the file when the HF folder ``path`` cannot be converted
    by NeMo's ``convert_qwen2_hf_to_nemo.py`` (run through :mod:`laconic_nemo.tools.convert_qwen2`): it loads
    ``Qwen2ForCausalLM`` (config.json with that architecture, safetensors or PyTorch weights) and a tokenizer
    (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``)."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"HF model folder {p} does not exist")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} is missing (the converter loads {QWEN2_ARCHITECTURE} from it)")
    try:
        arch = json.loads(cfg_file.read_text()).get("architectures") or []
    except ValueError as exc:
        raise ValueError(f"{cfg_file} is not valid JSON: {exc}") from exc
    if QWEN2_ARCHITECTURE not in arch:
        raise ValueError(f"{cfg_file}: architectures {arch} has no {QWEN2_ARCHITECTURE}; NeMo's Qwen2 converter "
                         "handles only that architecture (use model.source = hf for others)")
    weights = list(p.glob("*.safetensors")) + list(p.glob("pytorch_model*.bin"))
    if not weights:
        raise FileNotFoundError(f"{p} holds no weights (*.safetensors or pytorch_model*.bin)")
    if not (p / "tokenizer.json").is_file() and not ((p / "vocab.json").is_file() and (p / "merges.txt").is_file()):
        missing = [f for f in ("tokenizer.json", "vocab.json", "merges.txt") if not (p / f).is_file()]
        raise FileNotFoundError(f"{p} holds no tokenizer: {', '.join(str(p / f) for f in missing)} missing "
                                "(tokenizer.json, or vocab.json + merges.txt)")


def hf_text_to_ids(tok) -> TextToIds:
    """NeMo's ``AutoTokenizer.text_to_ids`` for a Hugging Face tokenizer (tokenize, then ids; no specials)."""
    return lambda text: tok.convert_tokens_to_ids(tok.tokenize(text))


def check_model_folder(cfg: Config, hf_model: str | None, nemo_overrides: list[str] = ()) -> dict:
    """Check the HF folder of a launch when it exists here (``--hf-model`` for ``model.source: nemo``,
    ``model.path`` for ``hf``): a folder to convert must suit NeMo's Qwen2 converter, the tokenizer must
    load, and for the NeMo sampler every end string must be a single token (built from the tokenizer, or
    the ``nemo.model.reinforce.sampling_params.end_strings`` override). Returns {"tokenizer", "end_strings",
    "loaded"} (the folder, the end strings and the loaded tokenizer object, for :func:`build_step_one` to reuse;
    None values when no folder is readable); raises LayoutError naming the file or the string."""
    m = cfg.model
    folder = hf_model if m.source == "nemo" else (str(m.path) if m.source == "hf" else None)
    if not folder or not Path(folder).is_dir():
        return {"tokenizer": None, "end_strings": None, "loaded": None}
    if m.source == "nemo" and not Path(str(m.path)).exists():
        try:
            check_converter_folder(folder)
        except (OSError, ValueError) as exc:
            raise LayoutError(f"--hf-model {folder} cannot be converted to model.path: {exc}") from exc
    try:
        tok = load_hf_tokenizer(folder)
    except Exception as exc:  # transformers raises several types
        raise LayoutError(f"the tokenizer of {folder} does not load ({type(exc).__name__}: {exc})") from exc
    if tok.eos_token is None:
        raise LayoutError(f"the tokenizer of {folder} has no eos_token ({Path(folder) / 'tokenizer_config.json'})")
    ends = None
    if m.source == "nemo":
        requested = None
        if end_strings_override(list(nemo_overrides)):
            node = OmegaConf.select(OmegaConf.from_dotlist(list(nemo_overrides)), END_STRINGS_KEY)
            requested = [str(x) for x in (node if node is not None else [])]
        try:
            ends = resolve_end_strings(hf_text_to_ids(tok), requested)
        except EndStringError as exc:
            raise LayoutError(f"nemo.{END_STRINGS_KEY}: {exc} (tokenizer {folder})") from exc
    return {"tokenizer": str(folder), "end_strings": ends, "loaded": tok}
