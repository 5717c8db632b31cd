"""Run NeMo's Qwen2 HF -> .nemo converter on a folder that ships only ``tokenizer.json``.

    python -m laconic_nemo.convert_qwen2 [--converter PATH] --input_name_or_path HF_DIR --output_path OUT.nemo
        [--precision bf16]

NeMo's ``scripts/checkpoint_converters/convert_qwen2_hf_to_nemo.py`` (NeMo 2.2.x, the ``nemo:25.02``
container) runs ``tokenizer = Qwen2Tokenizer.from_pretrained(args.input_name_or_path)`` in ``convert()`` and
never uses the result (the .nemo records the HF folder as a ``huggingface`` tokenizer with
``use_fast: True``). The slow ``Qwen2Tokenizer`` of transformers 4.x needs ``vocab.json`` and ``merges.txt``;
the DeepSeek-R1-Distill-Qwen and DeepScaleR repositories ship ``tokenizer.json`` only, so the load fails
(``TypeError: expected str, bytes or os.PathLike object, not NoneType``) and the prepare step dies.

This wrapper loads the converter script as a module (its ``__main__`` block does not run), points the
module's ``Qwen2Tokenizer`` name at ``transformers.Qwen2TokenizerFast`` (which reads ``tokenizer.json``),
and runs the script's own ``convert(get_args())`` with the remaining arguments. Nothing else changes.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from types import ModuleType

QWEN2_CONVERTER = "/opt/NeMo/scripts/checkpoint_converters/convert_qwen2_hf_to_nemo.py"


def load_converter(path: str) -> ModuleType:
    """The converter script as a module, its ``Qwen2Tokenizer`` replaced by ``Qwen2TokenizerFast``."""
    import transformers

    spec = importlib.util.spec_from_file_location("convert_qwen2_hf_to_nemo", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"NeMo's Qwen2 converter not found at {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("convert", "get_args"):
        if not callable(getattr(mod, name, None)):
            raise RuntimeError(f"{path} has no {name}(): not the NeMo 2.2.x Qwen2 converter this wrapper expects")
    if hasattr(mod, "Qwen2Tokenizer"):
        mod.Qwen2Tokenizer = transformers.Qwen2TokenizerFast
    return mod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m laconic_nemo.convert_qwen2", description=__doc__.split("\n\n")[0])
    p.add_argument("--converter", default=QWEN2_CONVERTER, help=f"NeMo's converter script (default {QWEN2_CONVERTER})")
    args, rest = p.parse_known_args(argv)
    mod = load_converter(args.converter)
    saved = sys.argv
    sys.argv = [args.converter, *rest]  # the converter parses sys.argv itself
    try:
        mod.convert(mod.get_args())
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
