"""The project's bridge against Megatron-Bridge's AutoBridge (benchmarks/bridge_crosscheck.py), where Megatron-Bridge
imports: it needs Python 3.12 (megatron-bridge 0.6.2: Requires-Python >=3.12,<3.13), so on the CPU tier (Python
3.11) the comparison is skipped with the import error as its reason; in a Python 3.12 environment with megatron-core
0.19.2 and megatron-bridge 0.6.2 it runs (docs/bridge.md has the run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parent.parent


def _crosscheck():
    spec = importlib.util.spec_from_file_location("bridge_crosscheck", ROOT / "benchmarks" / "bridge_crosscheck.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_project_bridge_and_autobridge_give_the_same_tensors():
    """Qwen2, tied Qwen2, Qwen3 and Llama layouts: AutoBridge's export of the model the project's bridge loaded is the
    checkpoint, bit for bit, and AutoBridge's import writes the parameters the project's bridge writes."""
    check = _crosscheck()
    why = check.megatron_bridge_missing()
    if why is not None:
        pytest.skip(f"megatron.bridge does not import here: {why}")
    rows, _ = check.run(check.FAMILIES, "cpu")
    assert [r["family"] for r in rows] == list(check.FAMILIES)
    for r in rows:
        assert r["export_mismatch"] == [] and r["import_mismatch"] == [], r
        assert r["export_max_diff"] == 0.0 and r["import_max_diff"] == 0.0, r


def test_the_script_reports_why_it_did_not_compare(capsys, monkeypatch):
    """Without Megatron-Bridge the script compares nothing, says why in one line and exits 0 (a GPU check stage must
    not fail on a host that lacks it); the reason is the import error itself."""
    check = _crosscheck()
    monkeypatch.setitem(sys.modules, "megatron.bridge", None)  # what an absent package does to `import`
    why = check.megatron_bridge_missing()
    assert why is not None and "megatron.bridge" in why
    assert check.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("bridge cross-check skipped: megatron.bridge does not import here (") and why in out
