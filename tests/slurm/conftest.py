"""The `slurm` tier: run with `pytest -m slurm tests/slurm` (.ci/run does, after the main suite). A plain
`pytest tests` collects these tests and skips them, so the main suite never starts a cluster."""

from __future__ import annotations

import pytest

from tests.slurm.cluster import LocalSlurm, StartError, missing_binaries


def pytest_collection_modifyitems(config, items):
    if "slurm" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="Slurm tier: run with -m slurm (.ci/run does, after the main suite)")
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm is not installed here (missing {', '.join(missing)}; "
                    "bash tests/slurm/install_slurm.sh installs slurm-wlm and munge)")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except (StartError, OSError, RuntimeError) as exc:
        cluster.stop()
        pytest.skip(f"a local Slurm cluster could not be started here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
