"""Cross-check of the project's Hugging Face <-> megatron-core bridge (laconic_nemo/bridge) against Megatron-Bridge's
``AutoBridge``, where Megatron-Bridge imports (it needs Python 3.12; a GPU host, docs/bridge.md). Not a dependency:
nothing of the project imports Megatron-Bridge; without it this prints why and exits 0.

    python benchmarks/bridge_crosscheck.py [--device cpu|cuda] [--families qwen2,qwen2_tied,qwen3,llama]

For each layout (tiny random Qwen2, Qwen2 with tied embeddings, Qwen3 with head_dim != hidden / heads, Llama; the
models of tests/dist/bridge_common.py, saved as a Hugging Face folder) it builds the project's megatron-core GPTModel
(``laconic_nemo.bridge.model_provider``, TP = PP = 1) and compares, tensor for tensor and bit for bit:

* export: ``AutoBridge.export_hf_weights(model)`` (megatron-bridge 0.6.2, ``auto_bridge.py:631-696``) of the model the
  project's bridge loaded, against the checkpoint's tensors and the project's own export
  (``laconic_nemo.bridge.export_hf_state_dict``): the same names, shapes and values;
* import: ``AutoBridge.load_hf_weights(model)`` (``auto_bridge.py:573-629``, the bridge built by
  ``AutoBridge.from_hf_pretrained(folder)``, ``:458-537``) into a second, randomly initialised model, against the
  parameters the project's ``load_hf_state_dict`` wrote: the same values in every megatron parameter.

Both directions use the project's layout with the vocabulary unpadded, Megatron-Bridge's convention
(:func:`compare_family`); what AutoBridge does with the padded vocabulary the project trains with is printed beside.

Megatron-Bridge maps megatron names written for TransformerEngine's fused layer norms (``linear_qkv.layer_norm_weight``)
and adds the separate-norm names of the local spec the project builds (``input_layernorm.weight``; megatron-bridge
``mapping_registry.py:73-82``), so both bridges address the same parameters.

Prints one row per layout and a last line ``bridge cross-check: N of N layouts agree``; exit status 1 when any
differs, 0 when all agree or Megatron-Bridge does not import (the line says why).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "dist"))  # bridge_common: the tiny models of the bridge tests

FAMILIES = ("qwen2", "qwen2_tied", "qwen3", "llama")


LORA_LAYERS = "megatron.bridge.peft.lora_layers"
STAND_IN = []  # what was stood in for to import Megatron-Bridge (printed with the result)


def _stand_in_lora_layers() -> None:
    """megatron-bridge 0.6.2 imports TransformerEngine unconditionally in one module, its LoRA layers
    (``megatron/bridge/peft/lora_layers.py:20``), which ``import megatron.bridge`` reaches through its PEFT code. A
    plain model's conversion never builds a LoRA layer (the exporter only asks whether a module is one), so where
    TransformerEngine is absent (a bare GPU host, a CPU machine) that module is replaced by empty classes of the names
    the rest of Megatron-Bridge imports from it; nothing of TransformerEngine is stood in for, so megatron-core keeps
    its own no-TransformerEngine paths."""
    import types

    module = types.ModuleType(LORA_LAYERS)
    for name in ("LinearAdapter", "LoRALinear", "LoRATopKRouter", "TEFusedLoRALinear"):
        setattr(module, name, type(name, (), {}))
    sys.modules[LORA_LAYERS] = module
    STAND_IN.append(f"{LORA_LAYERS} (its LoRA layers need TransformerEngine, absent here)")


def megatron_bridge_missing() -> str | None:
    """Why ``megatron.bridge.AutoBridge`` cannot be imported here, or None when it can (after standing in for its
    LoRA layers when only TransformerEngine is missing: :func:`_stand_in_lora_layers`)."""
    try:
        from megatron.bridge import AutoBridge  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "transformer_engine" or STAND_IN:
            return f"{type(exc).__name__}: {exc}"
        for name in [m for m in sys.modules if m == "megatron.bridge" or m.startswith("megatron.bridge.")]:
            del sys.modules[name]  # the partial import, redone with the stand-in
        _stand_in_lora_layers()
        return megatron_bridge_missing()
    except Exception as exc:  # noqa: BLE001 - any failure to import is a reason to skip, named
        return f"{type(exc).__name__}: {exc}"
    return None


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def compare_family(family: str, device: str, folder: Path) -> dict:
    """The two comparisons of the module docstring for one layout; returns the row (what differs, max diffs).

    Both use the project's layout with the vocabulary unpadded (``model_provider(vocab_divisible_by=1)``): Megatron-
    Bridge never pads it (its divisor is the largest power of two <= 128 that divides the vocabulary,
    megatron-bridge 0.6.2 ``model_bridge.py:1505-1536``) and its embedding mapping requires the Hugging Face shape
    (``:1135-1146``), while the project pads to a multiple of 128 x TP and drops the padding on export. What
    AutoBridge does with the padded layout the project trains with is recorded beside (``padded``)."""
    from bridge_common import hf_checkpoint_tensors, tiny_hf_model
    from megatron.bridge import AutoBridge

    from laconic_nemo.bridge import arch_from_hf_config, export_hf_state_dict, load_hf_state_dict, model_provider
    from laconic_nemo.bridge.mapping import local_parameters

    cfg, hf = tiny_hf_model(family)
    hf.save_pretrained(str(folder))
    arch = arch_from_hf_config(str(folder))
    reference = hf_checkpoint_tensors(hf, arch.tie_word_embeddings)
    bridge = AutoBridge.from_hf_pretrained(str(folder), torch_dtype=torch.float32)

    def built(pad: int, load: bool = True):
        model = model_provider(arch, cpu=device == "cpu", dtype=torch.float32, vocab_divisible_by=pad)(True, True)
        model = model.to(device)
        if load:
            load_hf_state_dict([model], hf.state_dict(), arch)
        return model

    def exported(model) -> tuple[list[str], float]:
        """AutoBridge's export of ``model`` against the checkpoint and the project's own export."""
        theirs = {n: t.detach().cpu() for n, t in bridge.export_hf_weights([model], cpu=True, show_progress=False)}
        own = export_hf_state_dict([model], arch)
        bad = [f"{n}: {'only AutoBridge' if n in theirs else 'not exported'}" for n in sorted(set(theirs) ^ set(reference))]
        bad += [n for n in sorted(set(theirs) & set(reference))
                if not torch.equal(theirs[n], reference[n]) or not torch.equal(theirs[n], own[n])]
        return bad, max((_max_diff(theirs[n], reference[n]) for n in set(theirs) & set(reference)), default=0.0)

    ours = built(1)
    export_bad, export_diff = exported(ours)
    # import: Megatron-Bridge loading the checkpoint into a second model of the same layout
    other = built(1, load=False)
    bridge.load_hf_weights([other])
    wanted, loaded = local_parameters([ours]), local_parameters([other])
    import_bad = [n for n in sorted(wanted) if n not in loaded or not torch.equal(wanted[n].cpu(), loaded[n].cpu())]
    import_diff = max((_max_diff(wanted[n].cpu(), loaded[n].cpu()) for n in wanted if n in loaded), default=0.0)
    # the layout the project trains with (vocabulary padded to a multiple of 128)
    padded_export, _ = exported(built(128))
    try:
        bridge.load_hf_weights([built(128, load=False)])
        padded_import = "accepted"
    except ValueError as exc:
        padded_import = f"refused ({str(exc).splitlines()[0].rstrip(':')})"
    padded = (f"export differs in {padded_export}" if padded_export else "export equal") + f", import {padded_import}"
    return {"family": family, "tensors": len(reference), "parameters": len(wanted), "export_mismatch": export_bad,
            "export_max_diff": export_diff, "import_mismatch": import_bad, "import_max_diff": import_diff,
            "padded": padded}


def run(families, device: str) -> tuple[list[dict], str | None]:
    """Rows of :func:`compare_family` for ``families``, or ([], the reason) when Megatron-Bridge does not import."""
    why = megatron_bridge_missing()
    if why is not None:
        return [], why
    from laconic_nemo.runtime.megatron_env import destroy_distributed, init_distributed

    init_distributed(1, 1, seed=0)
    try:
        rows = []
        for family in families:
            with tempfile.TemporaryDirectory() as tmp:
                rows.append(compare_family(family, device, Path(tmp)))
        return rows, None
    finally:
        destroy_distributed()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--families", default=",".join(FAMILIES))
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows, why = run([f for f in args.families.split(",") if f], args.device)
    if why is not None:
        print(f"bridge cross-check skipped: megatron.bridge does not import here ({why})")
        return 0
    print(f"{'layout':<11} {'HF tensors':>10} {'params':>6}  {'export (AutoBridge vs ours)':<30} import (AutoBridge vs ours)")
    for r in rows:
        exp = "equal" if not r["export_mismatch"] else f"{len(r['export_mismatch'])} differ: {r['export_mismatch'][:3]}"
        imp = "equal" if not r["import_mismatch"] else f"{len(r['import_mismatch'])} differ: {r['import_mismatch'][:3]}"
        print(f"{r['family']:<11} {r['tensors']:>10} {r['parameters']:>6}  {exp:<30} {imp}"
              f"  (max |diff| {max(r['export_max_diff'], r['import_max_diff']):.3g})")
        print(f"{'':<11} vocabulary padded to 128: {r['padded']}")
    agree = sum(not r["export_mismatch"] and not r["import_mismatch"] for r in rows)
    import megatron.bridge as mb
    import megatron.core as mc

    stood = f"; stand-in for {', '.join(STAND_IN)}" if STAND_IN else ""
    print(f"bridge cross-check: {agree} of {len(rows)} layouts agree (megatron-bridge {mb.__version__}, megatron-core "
          f"{mc.__version__}, torch {torch.__version__}, Python {sys.version.split()[0]}, {args.device}{stood})")
    return 0 if agree == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
