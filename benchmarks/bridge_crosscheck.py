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
  ``AutoBridge.from_hf_pretrained(folder)``, ``:459-538``) into a second, randomly initialised model, against the
  parameters the project's ``load_hf_state_dict`` wrote: the same values in every megatron parameter.

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


def megatron_bridge_missing() -> str | None:
    """Why ``megatron.bridge.AutoBridge`` cannot be imported here, or None when it can."""
    try:
        from megatron.bridge import AutoBridge  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import is a reason to skip, named
        return f"{type(exc).__name__}: {exc}"
    return None


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def compare_family(family: str, device: str, folder: Path) -> dict:
    """The two comparisons of the module docstring for one layout; returns the row (mismatch lists, max diffs)."""
    from bridge_common import hf_checkpoint_tensors, tiny_hf_model
    from megatron.bridge import AutoBridge

    from laconic_nemo.bridge import arch_from_hf_config, export_hf_state_dict, load_hf_state_dict, model_provider
    from laconic_nemo.bridge.mapping import local_parameters

    cfg, hf = tiny_hf_model(family)
    hf.save_pretrained(str(folder))
    arch = arch_from_hf_config(str(folder))
    reference = hf_checkpoint_tensors(hf, arch.tie_word_embeddings)

    def fresh():
        model = model_provider(arch, cpu=device == "cpu", dtype=torch.float32)(True, True)
        return model.to(device)

    ours = fresh()
    load_hf_state_dict([ours], hf.state_dict(), arch)
    bridge = AutoBridge.from_hf_pretrained(str(folder), torch_dtype=torch.float32)

    # export: Megatron-Bridge reading the model the project loaded
    theirs = {name: t.detach().cpu() for name, t in bridge.export_hf_weights([ours], cpu=True, show_progress=False)}
    own = export_hf_state_dict([ours], arch)
    export_bad = sorted(set(theirs) ^ set(reference))
    export_bad += [n for n in sorted(set(theirs) & set(reference))
                   if not torch.equal(theirs[n], reference[n]) or not torch.equal(theirs[n], own[n])]
    export_diff = max((_max_diff(theirs[n], reference[n]) for n in set(theirs) & set(reference)), default=0.0)

    # import: Megatron-Bridge loading the checkpoint into a second model of the project's layout
    other = fresh()
    bridge.load_hf_weights([other])
    mine, loaded = local_parameters([ours]), local_parameters([other])
    import_bad = [n for n in sorted(mine) if n not in loaded or not torch.equal(mine[n].cpu(), loaded[n].cpu())]
    import_diff = max((_max_diff(mine[n].cpu(), loaded[n].cpu()) for n in mine if n in loaded), default=0.0)
    return {"family": family, "tensors": len(reference), "parameters": len(mine), "export_mismatch": export_bad,
            "export_max_diff": export_diff, "import_mismatch": import_bad, "import_max_diff": import_diff}


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
    agree = sum(not r["export_mismatch"] and not r["import_mismatch"] for r in rows)
    import megatron.bridge as mb
    import megatron.core as mc

    print(f"bridge cross-check: {agree} of {len(rows)} layouts agree (megatron-bridge {mb.__version__}, megatron-core "
          f"{mc.__version__}, torch {torch.__version__}, {args.device})")
    return 0 if agree == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
