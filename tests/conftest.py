"""Test-wide setup. The multi-process helpers in tests/dist/ are scripts as well as modules (torchrun runs
``tests/dist/bridge_parallel.py`` as a file, whose folder Python then puts first on ``sys.path``); the test
modules import them by the same plain names (``import actor_checks``, ``from bridge_common import ...``), so
the folder goes on ``sys.path`` here, once, before any test module is collected. Processes started by
``torch.multiprocessing.spawn`` inherit this ``sys.path``. Shared fixtures live in the ``tests`` package:
``from tests.hf_fixtures import ...``."""

from __future__ import annotations

import sys
from pathlib import Path

DIST = str(Path(__file__).resolve().parent / "dist")
if DIST not in sys.path:
    sys.path.insert(0, DIST)
