"""The model folder of a launch: checks of a model's tokenizer and Hugging Face folder that must hold before a
cluster job starts (:func:`check_model_folder`), and the NeMo overrides that bear on them.

* End strings: every end string NeMo's sampler is given must be a single token of the loaded tokenizer
  (:func:`laconic_nemo.bridge.end_tokens.resolve_end_strings` says why and checks it).
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

from omegaconf import OmegaConf

from laconic_nemo.bridge.end_tokens import EndStringError, hf_text_to_ids, resolve_end_strings
from laconic_nemo.bridge.hf_folder import load_hf_tokenizer
from laconic_nemo.config import Config, LayoutError

END_STRINGS_KEY = "model.reinforce.sampling_params.end_strings"

def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(recipe overrides, NeMo-config overrides with the ``nemo.`` prefix removed)."""
    recipe, nemo = [], []
    for o in overrides:
        (nemo.append(o[len("nemo."):]) if o.startswith("nemo.") else recipe.append(o))
    return recipe, nemo


def end_strings_override(nemo_overrides: list[str]) -> bool:
    """True when the NeMo overrides set the sampler's end strings explicitly."""
    return any(o.split("=", 1)[0].strip() == END_STRINGS_KEY for o in nemo_overrides)


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
    if m.source == "nemo" and not Path(m.path).exists():
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
