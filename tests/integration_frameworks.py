"""Import a framework for the plug-in tests: skipped with the reason when it is not installed, except in the
integrations tier of .ci/run (LACONIC_INTEGRATIONS_REQUIRED=1), where the tier installed it and a missing
framework is a failure."""

from __future__ import annotations

import importlib
import os

import pytest


def framework(name: str):
    if os.environ.get("LACONIC_INTEGRATIONS_REQUIRED") == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"{name} is not installed (the integrations tier of .ci/run installs it: "
                                            "bash containers/cpu_integrations_venv.sh .venv-integrations)")
